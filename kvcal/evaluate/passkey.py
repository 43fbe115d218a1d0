"""kvcal's passkey-retrieval tasks `passkey` (generative) and `passkey_mc` (multiple choice), generated as real
lm-eval tasks: can the model still find a number stated once inside a long text, read through the KV cache?

Every document is one prompt of exactly `length` tokens (the model's own tokenizer, BOS counted when the tokenizer
adds it, which is what lm-eval's HFLM feeds the model):

    There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it. I will quiz
    you about the pass key afterwards.
    <filler, k tokens> The pass key is 4803126. Remember it.<filler, F - k tokens>
    What is the pass key? The pass key is

The phrasing is the passkey test of Mohtashami & Jaggi (2023, "Landmark Attention") as InfiniteBench and lm-eval's
`infinitebench_passkey` ask it (task description, "The pass key is {key}. Remember it.", "What is the pass key?
The pass key is"), with the answer prefix placed at the end of the prompt the way RULER's NIAH does
(lm_eval/tasks/ruler/prepare_niah.py, `gen_prefix`, lm-eval 0.4.13); the key is stated once (RULER's single
needle), not repeated as in the original. The filler is a contiguous piece of WikiText-2 test (from --data-dir) or
kvcal's embedded text (kvcal.evaluate.kl.EMBEDDED_TEXT) — never repeated: a length the text cannot fill is an
error naming the tokens available.

Depth d in [0, 1] is the fraction of the filler before the key, token-exact: with F filler tokens the key
sentence starts after k = floor(d * F + 0.5) of them, and the generator checks that the final prompt tokenizes
to exactly [BOS] + prefix + filler[:k] + needle + filler[k:] + question (it moves the piece of filler it takes
until the joints tokenize cleanly). Keys are 5-7 random digits; everything derives from --seed, the length, the
depth and the sample index, so a run is reproducible and adding a length leaves the other cells unchanged.

- `passkey`: greedy generation (at most GEN_TOKS tokens, stop at a newline); exact match of the first run of
  digits in the answer with the key (InfiniteBench's first-integer match). lm-eval metric `exact_match`.
- `passkey_mc`: log-likelihood of " <key>" against three distractor keys of the same number of digits (lm-eval's
  multiple_choice, metric `acc`; chance is 0.25). Small models may retrieve by copying before they can answer in
  free text, which this variant shows.

Both tasks share the same documents. `--limit` is the number of samples per (length, depth) cell. Per-cell
accuracies go to results.json `passkey_by_cell` (`cells`).
"""

from __future__ import annotations

import math
import os
import random
import re
from dataclasses import dataclass
from typing import Any

from kvcal.errors import KvcalError, UsageError
from kvcal.evaluate.tasks import PASSKEY_TASKS, TaskPlan

PASSKEY_TASK, PASSKEY_MC_TASK = PASSKEY_TASKS
PASSKEY_VERSION = 1
# Both fit the embedded filler; longer ones need --data-dir (WikiText-2 test, ~300k tokens).
DEFAULT_LENGTHS = "1k,2k"
DEFAULT_DEPTHS = "0,0.25,0.5,0.75,1"
DEFAULT_PER_CELL = 10  # samples per (length, depth) cell without --limit
GEN_TOKS = 12  # a 7-digit key is at most 8 tokens (a space + one per digit for SmolLM2 and Gemma 3)
METRICS = {PASSKEY_TASK: "exact_match", PASSKEY_MC_TASK: "acc"}
N_CHOICES = 4
MAX_TRIES = 400  # filler offsets tried per sample before the tokenizer is declared unusable

PREFIX = (
    "There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the pass key afterwards.\n"
)
NEEDLE = " The pass key is {key}. Remember it."
QUESTION = "\nWhat is the pass key? The pass key is"

_LENGTH = re.compile(r"^(\d+(?:\.\d+)?)([kK]?)$")


# ---- options ------------------------------------------------------------------------------------------------


def parse_lengths(spec: str, option: str = "--passkey-lengths") -> list[int]:
    """'1k,2k,4096' -> [1024, 2048, 4096] (k = 1024 tokens); UsageError naming `option` for anything else."""
    items = [s.strip() for s in str(spec).split(",") if s.strip()]
    if not items:
        raise UsageError(f"{option} is empty; give lengths in tokens, e.g. 1k,2k,4k")
    out: list[int] = []
    for item in items:
        m = _LENGTH.match(item)
        value = float(m.group(1)) * (1024 if m.group(2) else 1) if m else 0.0
        if not m or value != int(value) or value < 1:
            raise UsageError(
                f"{option}: '{item}' is not a whole number of tokens; use e.g. 1k,2k,4k or 1000,3000"
            )
        if int(value) not in out:
            out.append(int(value))
    return out


def parse_depths(spec: str) -> list[float]:
    """'0,0.5,1' -> [0.0, 0.5, 1.0]; each a fraction in [0, 1]; UsageError otherwise."""
    items = [s.strip() for s in str(spec).split(",") if s.strip()]
    if not items:
        raise UsageError("--passkey-depths is empty; give fractions of the filler, e.g. 0,0.25,0.5,0.75,1")
    out: list[float] = []
    for item in items:
        try:
            value = float(item)
        except ValueError:
            value = math.nan
        if not 0.0 <= value <= 1.0:
            raise UsageError(
                f"--passkey-depths: '{item}' is not a fraction in [0, 1]; use e.g. 0,0.25,0.5,0.75,1"
            )
        if value not in out:
            out.append(value)
    return out


def check_positions(lengths: list[int], max_positions: int | None, gen_toks: int = GEN_TOKS) -> None:
    """Every prompt plus its answer must fit the model's positions (lm-eval would otherwise cut the prompt's
    start to make room for the answer)."""
    if not max_positions:
        return
    too_long = [n for n in lengths if n + gen_toks > max_positions]
    if too_long:
        raise UsageError(
            f"--passkey-lengths {too_long[0]}: a prompt of {too_long[0]} tokens plus its answer ({gen_toks} "
            f"tokens) does not fit the model's {max_positions} positions (max_position_embeddings); "
            f"use lengths of at most {max_positions - gen_toks}"
        )


# ---- filler -------------------------------------------------------------------------------------------------


def filler_text(data_dir: str | os.PathLike[str] | None) -> tuple[str, str]:
    """(text, source label): WikiText-2 test from --data-dir, else kvcal's embedded text — kl's text."""
    from kvcal.evaluate.kl import kl_text  # lazy: kl imports torch

    return kl_text(data_dir, task="passkey")


@dataclass(frozen=True)
class Filler:
    """The filler text tokenized once: ids[i] covers text[offsets[i][0]:offsets[i][1]]."""

    text: str
    source: str
    ids: list[int]
    offsets: list[tuple[int, int]]


def tokenize_filler(tokenizer: Any, text: str, source: str) -> Filler:
    if not getattr(tokenizer, "is_fast", False):
        raise KvcalError(
            "the passkey tasks need a fast (Rust) tokenizer for token-exact placement; this model's is slow"
        )
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return Filler(text, source, list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]])


# ---- documents ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Template:
    """The fixed parts of a prompt, tokenized alone (no special tokens); bos: the id the tokenizer prepends."""

    bos: list[int]
    prefix: list[int]
    question: list[int]

    @classmethod
    def of(cls, tokenizer: Any) -> Template:
        def ids(text: str) -> list[int]:
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])

        with_special = list(tokenizer("x")["input_ids"])
        plain = ids("x")
        bos = with_special[: len(with_special) - len(plain)] if with_special[-len(plain) :] == plain else []
        return cls(bos=bos, prefix=ids(PREFIX), question=ids(QUESTION))

    def filler_tokens(self, length: int, needle: int) -> int:
        return length - len(self.bos) - len(self.prefix) - needle - len(self.question)


def _key(rng: random.Random, digits: int) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10**digits))


def _choices(rng: random.Random, key: str) -> tuple[list[str], int]:
    """The key and N_CHOICES - 1 distinct distractors of as many digits, in random order; (choices, label)."""
    keys = [key]
    while len(keys) < N_CHOICES:
        other = _key(rng, len(key))
        if other not in keys:
            keys.append(other)
    order = list(range(N_CHOICES))
    rng.shuffle(order)
    return [keys[i] for i in order], order.index(0)


def depth_split(depth: float, filler_tokens: int) -> int:
    """Filler tokens before the key: depth * F rounded half up (0 -> first, 1 -> last)."""
    return int(math.floor(depth * filler_tokens + 0.5))


def make_doc(
    tokenizer: Any, filler: Filler, tpl: Template, length: int, depth: float, index: int, seed: int
) -> dict[str, Any]:
    """One sample of cell (length, depth): a prompt of exactly `length` tokens with the key after
    depth_split(depth, F) filler tokens, verified by tokenizing the final text."""
    rng = random.Random(f"kvcal-passkey/{seed}/{length}/{depth!r}/{index}")
    key = _key(rng, rng.choice((5, 6, 7)))
    choices, label = _choices(rng, key)
    needle_text = NEEDLE.format(key=key)
    needle = list(tokenizer(needle_text, add_special_tokens=False)["input_ids"])
    n_fill = tpl.filler_tokens(length, len(needle))
    _check_fill(filler, length, n_fill, len(filler.ids))
    k = depth_split(depth, n_fill)
    span = len(filler.ids) - n_fill + 1  # possible filler starts
    start0 = rng.randrange(span)
    for t in range(min(MAX_TRIES, span)):
        s = (start0 + t) % span
        text = _prompt_text(filler, s, k, n_fill, needle_text)
        if text is None or any(c in text for c in choices if c != key) or text.count(key) != 1:
            continue  # the key must be stated once, and no distractor may appear in the filler
        expected = tpl.bos + tpl.prefix + filler.ids[s : s + k] + needle + filler.ids[s + k : s + n_fill]
        expected += tpl.question
        if list(tokenizer(text)["input_ids"]) == expected:
            return {
                "prompt": text,
                "key": key,
                "choices": choices,
                "label": label,
                "length": length,
                "depth": depth,
                "index": index,
                "needle_pos": len(tpl.bos) + len(tpl.prefix) + k,  # token index of the needle's first token
                "needle_tokens": len(needle),
                "filler_tokens": n_fill,
                "filler_before": k,
                "filler_start": s,
            }
    raise KvcalError(
        f"passkey: no piece of the {filler.source} filler tokenizes cleanly around the key at length {length}, "
        f"depth {depth} after {min(MAX_TRIES, span)} tries; this tokenizer merges across the prompt's joints"
    )


def _check_fill(filler: Filler, length: int, n_fill: int, available: int) -> None:
    if n_fill < 1:
        raise UsageError(
            f"--passkey-lengths {length} is too short for the passkey prompt itself; use at least "
            f"{length - n_fill + 1} tokens"
        )
    if n_fill > available:
        more = " or pass --data-dir with wikitext2 (~300k tokens)" if filler.source == "embedded" else ""
        raise UsageError(
            f"--passkey-lengths {length} needs {n_fill} filler tokens but the {filler.source} filler text has "
            f"only {available} with this tokenizer (it is never repeated); use lengths of at most "
            f"{length - n_fill + available}{more}"
        )


def _prompt_text(filler: Filler, s: int, k: int, n_fill: int, needle_text: str) -> str | None:
    """The prompt with filler tokens [s, s + n_fill) cut from the text by character offsets and the needle after
    the first k; None when a cut falls inside a character (byte-level tokens of one multi-byte character)."""
    offs = filler.offsets

    def clean(i: int) -> bool:  # the text can be cut between tokens i - 1 and i
        return i <= 0 or i >= len(offs) or offs[i - 1][1] <= offs[i][0]

    if not (clean(s) and clean(s + k) and clean(s + n_fill)):
        return None
    lo, hi = offs[s][0], offs[s + n_fill - 1][1]
    cut = offs[s + k][0] if k < n_fill else hi
    return PREFIX + filler.text[lo:cut] + needle_text + filler.text[cut:hi] + QUESTION


def generate_docs(
    tokenizer: Any, filler: Filler, lengths: list[int], depths: list[float], per_cell: int, seed: int
) -> list[dict[str, Any]]:
    """Every (length, depth) cell's `per_cell` samples, lengths then depths then samples."""
    tpl = Template.of(tokenizer)
    return [
        make_doc(tokenizer, filler, tpl, length, depth, i, seed)
        for length in lengths
        for depth in depths
        for i in range(per_cell)
    ]


# ---- lm-eval tasks ------------------------------------------------------------------------------------------


def first_integer_match(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """lm-eval process_results of `passkey`: 1.0 when the first run of digits in the answer is the key."""
    found = re.search(r"\d+", results[0] if results else "")
    return {"exact_match": float(found is not None and found.group(0) == doc["key"])}


class PasskeyDocs:
    """lm-eval `custom_dataset` hook: the generated documents as a datasets.DatasetDict (split 'test')."""

    def __init__(self, docs: list[dict[str, Any]]) -> None:
        self._docs = docs

    def __repr__(self) -> str:  # results.json stores a repr of the config: name the hook, not the documents
        return "kvcal.evaluate.passkey.PasskeyDocs"

    def __call__(self, **_: Any) -> Any:
        import datasets

        return datasets.DatasetDict({"test": datasets.Dataset.from_list(self._docs)})


def task_config(name: str, docs: list[dict[str, Any]], settings: dict[str, Any]) -> dict[str, Any]:
    """The inline lm-eval config of `passkey` or `passkey_mc` over `docs`; `settings` (lengths, depths,
    per_cell, seed, filler) are recorded as dataset_kwargs (lm-eval passes them to the hook, which ignores them)."""
    common: dict[str, Any] = {
        "task": name,
        "dataset_path": "kvcal-passkey",
        "custom_dataset": PasskeyDocs(docs),
        "dataset_kwargs": dict(settings),
        "test_split": "test",
        "doc_to_text": "{{prompt}}",
        "target_delimiter": " ",
        "metadata": {"version": PASSKEY_VERSION},
    }
    if name == PASSKEY_TASK:
        return {
            **common,
            "output_type": "generate_until",
            "doc_to_target": "{{key}}",
            "process_results": first_integer_match,
            "generation_kwargs": {"until": ["\n"], "do_sample": False, "max_gen_toks": GEN_TOKS},
            "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
        }
    if name == PASSKEY_MC_TASK:
        return {
            **common,
            "output_type": "multiple_choice",
            "doc_to_choice": "choices",
            "doc_to_target": "label",
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
        }
    raise ValueError(f"not a passkey task: {name!r}")


# ---- results ------------------------------------------------------------------------------------------------


def cells(task: str, samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """results.json `passkey_by_cell[task]`: accuracy per (length, depth) from lm-eval's sample records, in
    length then depth order. acc_stderr is lm-eval's stderr of a mean (sample sd / sqrt(n)); None for n = 1."""
    metric = METRICS[task]
    groups: dict[tuple[int, float], list[float]] = {}
    for rec in samples:
        doc = rec["doc"]
        groups.setdefault((int(doc["length"]), float(doc["depth"])), []).append(float(rec[metric]))
    out = []
    for (length, depth), vals in sorted(groups.items()):
        n = len(vals)
        acc = sum(vals) / n
        sd = math.sqrt(sum((v - acc) ** 2 for v in vals) / (n - 1)) if n > 1 else None
        out.append(
            {
                "length": length,
                "depth": depth,
                "n": n,
                "acc": acc,
                "acc_stderr": sd / math.sqrt(n) if sd is not None else None,
            }
        )
    return out


def task_specs(
    names: list[str],
    tokenizer: Any,
    *,
    data_dir: str | os.PathLike[str] | None,
    lengths: list[int],
    depths: list[float],
    per_cell: int,
    seed: int,
) -> dict[str, dict[str, Any]]:
    """name -> inline lm-eval config for each passkey task in `names`, over one set of generated documents.
    UsageError when the filler cannot fill a length."""
    wanted = [n for n in names if n in PASSKEY_TASKS]
    if not wanted:
        return {}
    text, source = filler_text(data_dir)
    docs = generate_docs(tokenizer, tokenize_filler(tokenizer, text, source), lengths, depths, per_cell, seed)
    settings = {
        "lengths": lengths,
        "depths": depths,
        "samples_per_cell": per_cell,
        "seed": seed,
        "filler": source,
    }
    return {name: task_config(name, docs, settings) for name in wanted}


def bind_passkey(
    plan: TaskPlan | None,
    model_dir: str | os.PathLike[str],
    *,
    max_positions: int | None,
    gen_toks: int | None,
    data_dir: str | os.PathLike[str] | None,
    lengths: list[int],
    depths: list[float],
    limit: int | None,
    seed: int,
    trust_remote_code: bool,
) -> None:
    """The passkey part of binding a spec to its checkpoint (kvcal.evaluate.bound.bind): every prompt length must
    fit the model's positions, and the plan's passkey tasks get their lm-eval configs, the documents generated with
    the model's own tokenizer (the one lm-eval's HFLM loads from the same folder). `limit`: samples per cell."""
    check_positions(lengths, max_positions, gen_toks or GEN_TOKS)
    if plan is None or not plan.has_passkey:
        return
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    plan.lm_eval_specs.update(
        task_specs(
            plan.names,
            tokenizer,
            data_dir=data_dir,
            lengths=lengths,
            depths=depths,
            per_cell=limit or DEFAULT_PER_CELL,
            seed=seed,
        )
    )
