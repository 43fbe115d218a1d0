"""kvcal's `divergence` tasks: after how many generated tokens a quantized cache's greedy output leaves the BF16
cache's, and what one decode step through the cache costs.

Prompts: an lm-eval task's own requests (`divergence` and `divergence_gsm8k`: gsm8k; `divergence_aime25`;
`divergence_gpqa_diamond`), built by lm-eval (`Task.build_all_requests`: its few-shot context, its seed, its
`--num-fewshot`), so a prompt is byte for byte what `kvcal eval --tasks gsm8k` sends; `--limit` prompts. The
generation length is `--max-gen-toks` (default 256); a prompt longer than the model's positions leave for it is
cut from the left, as lm-eval's HFLM cuts a generation context.

Per prompt, three passes, each one forward per generated token (the engine's decode path: every step writes one
token into the cache and attends over everything stored):
1. baseline: greedy decode through a BF16 cache (kvcal's attention, as `kl`'s baseline), until EOS or the cap.
   Its tokens are cached on disk (key: model fingerprint, baseline side, BOS-free prompt ids, cap, EOS ids)
   under $KVCAL_CACHE/divergence, so a sweep decodes it once. The BF16 log-probs every comparison needs come
   from one chunked prefill of prompt + trajectory through the BF16 cache (`_one_batch`), recomputed per
   evaluation: a prefill is cheap next to the decodes, and [n, V] float16 per prompt on disk is not (Gemma 3,
   262k vocabulary, 2,048 tokens: 1 GB a prompt).
2. quantized greedy decode from the same prompt: token-exact identity, the first generated position where the
   tokens differ (1-based; censored at the shorter output's length when they never do), the answer lm-eval's
   filters extract from each output (the task's first filter), and vLLM's `check_logprobs_close` at top-k 5
   (vllm-project/vllm tests/models/utils.py @ 9cfdcd89: at the first differing token, each side's token must be
   among the other's top-k log-probs; outputs that never differ pass).
3. teacher-forced decode: the baseline's tokens fed back one per forward through the quantized cache: KL(bf16 ||
   quant), top-1 agreement and the BF16 top-1 margin (log-prob of its best minus its second-best token) by
   generated position, in `kl`'s position buckets (1-512, 513-1024, ...).
And beside (3), the prefill KL of the same tokens: prompt + trajectory through both caches in chunks of
--prefill-chunk (kl's chunked prefill). The two agree for formats whose scales do not depend on what was written
before (static scales, per-token scales); they differ where a scale is fixed at the first write (first-batch
scales: decode quantizes every generated token with the prompt's scale, prefill with the whole sequence's).

Batches (`--batch-size B`, `group_prompts`): each pass runs over B prompts at once (longest first; decode
left-padded, prefill right-padded; positions, padding and every scale per sequence: "decoding a batch" below), one
forward per generated token for the whole batch. A row's stored K/V are what it stores alone; its logits differ
from batch 1's by the float rounding of matmuls of other shapes only (tests/evaluate/test_divergence_batch.py:
equal tokens, KL within a bound derived on the machine). Two exceptions, both by design: `--scales first-batch`
fixes its scales from the first write, which at batch B is B prompts' (vLLM's calculate_kv_scales also sees its
first batch); and a batch's BF16 trajectories are cached under the batch's prompts (`trajectory_key`), so a run
at batch B reuses only what the same batch decoded. Memory: a batch holds its rows' BF16 log-probs, B x n x V
float16 (SmolLM2, 256 tokens: 25 MB a row; Gemma 3, 2,048 tokens: 1 GB a row).

The run's hazard, survival curve and projection to long outputs are the report's (kvcal.report.agreement).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvcal.errors import UsageError
from kvcal.evaluate.kl import mean_stderr
from kvcal.filecache import cache_root as kvcal_cache_root
from kvcal.io import atomic_write_with

DIVERGENCE_VERSION = 2  # 2: the cache holds tokens only
DEFAULT_GEN_LEN = 256
TOP_K = 5  # vLLM's correctness tests ask for 5 log-probs (e.g. tests/models/language/generation)
METRICS = ("answer_agree", "identical", "logprobs_close", "decode_kl", "prefill_kl", "decode_top1")
_LOWER = {"decode_kl", "prefill_kl"}

ChunkForward = Callable[..., torch.Tensor]  # (ids [1, c], keep=None) -> logits [1, c | len(keep), V]


# ---- comparing two outputs ----------------------------------------------------------------------------------


def first_divergence(a: list[int], b: list[int]) -> tuple[int, bool]:
    """(time, event): the 1-based position of the first token where `a` and `b` differ (event True), or the
    shorter length when one is a prefix of the other (event False: censored, the outputs were compared that far)."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i + 1, True
    return n, False


def logprobs_close(
    ids_0: list[int], ids_1: list[int], top_0: list[list[int]], top_1: list[list[int]]
) -> bool:
    """vLLM's check_logprobs_close on one prompt, as a pass/fail: at the first position where the tokens differ,
    ids_0's token must be in top_1 (the other side's top-k ids there) and ids_1's in top_0; then stop (the
    sequences diverge from there). No differing position: pass. top_*: [n][k] token ids per generated step."""
    for idx, (t0, t1) in enumerate(zip(ids_0, ids_1, strict=False)):
        if t0 != t1:
            return t0 in top_1[idx] and t1 in top_0[idx]
    return True


# ---- decoding -----------------------------------------------------------------------------------------------


def fp16_logprobs(logits: torch.Tensor) -> torch.Tensor:
    # logits [n, V] -> float16 log-probs [n, V], as kl stores its baseline (kvcal.evaluate.kl._fp16_logprobs)
    from kvcal.evaluate.kl import _fp16_logprobs

    return _fp16_logprobs(logits)


def greedy(
    forward: ChunkForward, prompt: torch.Tensor, gen_len: int, eos: set[int]
) -> tuple[list[int], torch.Tensor]:
    """Greedy decode of up to `gen_len` tokens (EOS included, then stop), one forward per token after the
    prompt's. prompt: [1, P]. Returns (tokens, their top-k ids [n, k])."""
    P = prompt.shape[1]
    logits = forward(prompt, torch.tensor([P - 1], device=prompt.device))[0, -1]  # [V]
    tokens: list[int] = []
    rows: list[torch.Tensor] = []
    while True:
        row = logits.float()
        tok = int(row.argmax())
        tokens.append(tok)
        rows.append(row.topk(TOP_K).indices.cpu())
        if tok in eos or len(tokens) >= gen_len:
            break
        logits = forward(torch.tensor([[tok]], device=prompt.device))[0, -1]
    return tokens, torch.stack(rows)


def teacher_forced(forward: ChunkForward, prompt: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """Logits [n, V] (float32, CPU) of the quantized side predicting each of `tokens`: the prompt's last row,
    then one forward per token of tokens[:-1] (each written into the cache before the next is read)."""
    P = prompt.shape[1]
    rows = [forward(prompt, torch.tensor([P - 1], device=prompt.device))[0, -1].float().cpu()]
    for tok in tokens[:-1]:
        rows.append(forward(torch.tensor([[tok]], device=prompt.device))[0, -1].float().cpu())
    return torch.stack(rows)


def prefilled(forward: ChunkForward, ids: torch.Tensor, first: int, chunk: int) -> torch.Tensor:
    """Logits [T - first, V] (float32, CPU) of rows first..T-1 of ids [1, T], by chunked prefill (chunks of
    `chunk` tokens, each attending to the cache of the earlier ones; only the wanted rows are computed)."""
    T = ids.shape[1]
    out = []
    for s in range(0, T, chunk):
        piece = ids[:, s : min(T, s + chunk)]
        keep = torch.arange(
            min(max(first - s, 0), piece.shape[1]), piece.shape[1]
        )  # none before `first`'s chunk
        if keep.numel() == 0:
            forward(piece, torch.tensor([piece.shape[1] - 1], device=ids.device))  # fills the cache only
            continue
        out.append(forward(piece, keep.to(ids.device))[0].float().cpu())
    return torch.cat(out)


# ---- decoding a batch of prompts ----------------------------------------------------------------------------
# The run's path (`run_divergence`): the three passes over a batch of prompts, every row computed as it would be
# alone. greedy / teacher_forced / prefilled above are the same passes at batch 1 (the reference the tests hold
# these to). Decode passes left-pad the prompts (as lm-eval's generate_until batches): each row's positions count
# its real tokens only (position_ids), its padding is masked and never stored (the 2-D attention mask reaches
# kvcal's cache: QuantizedKVCache.set_attention_mask), so a row's K/V, its per-token / per-block / per-sequence
# scales and its codes are what it stores alone (tests/kernels/test_batch_invariance.py); what can differ is the
# float rounding of matmuls of another shape. Prefill right-pads (as lm-eval's scoring batches), so a row's
# chunks start where its chunks start alone. Rows that finished (EOS, their cap, their trajectory's end) still
# advance with the batch, their outputs ignored, as transformers' generate does.


def group_prompts(prompts: list[list[int]], batch_size: int) -> list[list[int]]:
    """Indices of `prompts` in batches of up to `batch_size`, longest prompt first (the least padding, as lm-eval
    orders generation requests); ties in prompt order. Batch 1: prompt order."""
    if batch_size <= 1:
        return [[i] for i in range(len(prompts))]
    order = sorted(range(len(prompts)), key=lambda i: (-len(prompts[i]), i))
    return [order[s : s + batch_size] for s in range(0, len(order), batch_size)]


class _Decoder:
    """One batch's decode state over one session: the left-padded prompts' ids [B, P], the 2-D mask over every
    token so far ([B, P + steps]; None without padding) and each row's next position [B]."""

    def __init__(self, forward: ChunkForward, prompts: list[list[int]], device: Any) -> None:
        B, P = len(prompts), max(len(p) for p in prompts)
        self.ids = torch.zeros(B, P, dtype=torch.long)
        mask = torch.zeros(B, P, dtype=torch.long)
        for i, p in enumerate(prompts):
            self.ids[i, P - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, P - len(p) :] = 1
        self.positions = (mask.cumsum(-1) - 1).clamp_min(0)  # [B, P]: a row's real tokens count from 0
        self.mask = None if bool(mask.all()) else mask.to(device)
        self.ids, self.positions = self.ids.to(device), self.positions.to(device)
        self.forward, self.device = forward, device

    def first(self) -> torch.Tensor:
        """The prompts' forward: logits [B, V] of each row's last prompt token (the last column)."""
        P = self.ids.shape[1]
        keep = torch.tensor([P - 1], device=self.device)
        logits = self.forward(self.ids, keep, attention_mask=self.mask, position_ids=self.positions)
        self.next = self.positions[:, -1:] + 1  # [B, 1]
        return logits[:, -1]

    def step(self, tokens: list[int]) -> torch.Tensor:
        """One decode step writing tokens[i] into row i: logits [B, V] predicting each row's next token."""
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)[:, None]  # [B, 1]
        if self.mask is not None:
            self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        logits = self.forward(ids, None, attention_mask=self.mask, position_ids=self.next)
        self.next = self.next + 1
        return logits[:, -1]


def greedy_batch(
    forward: ChunkForward, prompts: list[list[int]], gen_len: int, eos: set[int], device: Any
) -> list[tuple[list[int], torch.Tensor]]:
    """`greedy` over a batch of prompts: per row (tokens up to EOS or `gen_len`, their top-k ids [n, k])."""
    dec = _Decoder(forward, prompts, device)
    logits = dec.first()
    B = len(prompts)
    tokens: list[list[int]] = [[] for _ in range(B)]
    tops: list[list[torch.Tensor]] = [[] for _ in range(B)]
    done = [False] * B
    while True:
        rows = logits.float()  # [B, V]
        top = rows.topk(TOP_K, dim=-1).indices.cpu()
        best = rows.argmax(-1).tolist()
        for i in range(B):
            if done[i]:
                continue
            tokens[i].append(int(best[i]))
            tops[i].append(top[i])
            done[i] = best[i] in eos or len(tokens[i]) >= gen_len
        if all(done):
            return [(t, torch.stack(k)) for t, k in zip(tokens, tops, strict=True)]
        logits = dec.step([t[-1] for t in tokens])


Stats = Callable[[int, int, torch.Tensor], None]  # (row, first generated index of the block, logits [m, V])


def teacher_forced_batch(
    forward: ChunkForward, prompts: list[list[int]], trajectories: list[list[int]], device: Any, take: Stats
) -> None:
    """`teacher_forced` over a batch: row i's trajectory fed back one token per forward; `take(i, t, logits
    [1, V])` receives row i's logits predicting trajectory[i][t], step by step (the caller reduces them at once:
    B x n x V float32 would not fit for long outputs and large vocabularies)."""
    dec = _Decoder(forward, prompts, device)
    logits = dec.first()
    n_max = max(len(t) for t in trajectories)
    for t in range(n_max):
        for i, traj in enumerate(trajectories):
            if t < len(traj):
                take(i, t, logits[i : i + 1].float())
        if t + 1 < n_max:
            logits = dec.step([traj[min(t, len(traj) - 1)] for traj in trajectories])


def prefilled_batch(
    model: Any,
    forward: ChunkForward,
    seqs: list[list[int]],
    firsts: list[int],
    chunk: int,
    device: Any,
    take: Stats,
) -> None:
    """`prefilled` over a batch: seqs right-padded to one length, prefilled in chunks of `chunk` tokens (a row's
    chunks start where they start alone); `take(i, r, logits [m, V])` receives row i's logits of its rows
    firsts[i] + r .. firsts[i] + r + m - 1 in order. The decoder's final hidden states are taken at the head's
    input and projected per row, a block of rows at a time (kvcal.evaluate.scoring's head: the model's own, with
    its post-processing), so no forward holds B x chunk x V logits."""
    from kvcal.evaluate.scoring import _HEAD_BUDGET, _HeadInput

    head = _HeadInput(model)
    B, T = len(seqs), max(len(s) for s in seqs)
    ids = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    ids = ids.to(device)
    full = None if bool(mask.all()) else mask.to(device)
    block = max(1, _HEAD_BUDGET // max(1, int(head.head.weight.shape[0])))
    for s0 in range(0, T, chunk):
        s1 = min(T, s0 + chunk)
        pos = torch.arange(s0, s1, device=device).expand(B, -1)
        with head.active(keep_last=True):  # the head computes one row; the rows wanted are projected below
            forward(
                ids[:, s0:s1], None, attention_mask=None if full is None else full[:, :s1], position_ids=pos
            )
        hidden = head.hidden  # [B, s1 - s0, d]
        assert hidden is not None
        for i, s in enumerate(seqs):
            lo, hi = max(firsts[i], s0), min(len(s), s1)
            for r0 in range(lo, hi, block):
                r1 = min(hi, r0 + block)
                take(i, r0 - firsts[i], head.project(hidden[i, r0 - s0 : r1 - s0]).float())


# ---- baseline cache -----------------------------------------------------------------------------------------


def cache_root() -> Path:
    return kvcal_cache_root() / "divergence"


def prompt_sha256(prompt: list[int]) -> str:
    return hashlib.sha256(json.dumps(prompt).encode()).hexdigest()


def trajectory_key(
    fingerprint: str,
    baseline: dict[str, Any],
    prompt: list[int],
    gen_len: int,
    eos: set[int],
    batch: list[list[int]] | None = None,
) -> str:
    """`batch`: the prompts decoded together with this one (in their batch's order), for a batch of more than one:
    a row's greedy tokens are its own up to float rounding that depends on its batch's shapes, so the cached
    trajectory is the one this very batch decodes (then `-f bf16` still agrees with its baseline bit for bit).
    Batch 1 keeps the key it always had."""
    entry = {
        "v": DIVERGENCE_VERSION,
        "model": fingerprint,
        "baseline": baseline,
        "ids": prompt_sha256(prompt),
        "gen_len": gen_len,
        "eos": sorted(eos),
    }
    if batch is not None and len(batch) > 1:
        entry["batch"] = [prompt_sha256(p) for p in batch]
    return hashlib.sha256(json.dumps(entry, sort_keys=True).encode()).hexdigest()


def _path(root: Path, key: str) -> Path:
    return root / key[:2] / f"{key}.safetensors"


def load_trajectory(root: Path, key: str) -> list[int] | None:
    """The tokens of a cached baseline trajectory; None when absent or damaged."""
    from safetensors.torch import load_file

    try:
        tokens = load_file(str(_path(root, key)))["tokens"].tolist()
    except Exception:
        return None
    return tokens if tokens else None


def store_trajectory(root: Path, key: str, tokens: list[int]) -> None:
    """Only the tokens: the BF16 log-probs a comparison needs are recomputed by one prefill (`baseline_logprobs`),
    since [n, V] float16 per prompt would be 25 MB for SmolLM2's 49k vocabulary at 256 tokens and 2 GB for
    Gemma 3's 262k at 2,048 (100 gsm8k prompts: 2.5 GB; 30 aime25 prompts on Gemma: 60 GB)."""
    from safetensors.torch import save_file

    data = {"tokens": torch.tensor(tokens, dtype=torch.long)}
    try:
        atomic_write_with(_path(root, key), lambda tmp: save_file(data, str(tmp)))
    except OSError as exc:
        raise UsageError(
            f"cannot write the divergence baseline cache under '{root}' ({exc.strerror or exc}); "
            "set KVCAL_CACHE to a writable folder"
        ) from exc


# ---- statistics ---------------------------------------------------------------------------------------------


def margins(lp16: torch.Tensor) -> torch.Tensor:
    """BF16 top-1 margin per step: log p(best) - log p(second best). lp16 [n, V] -> [n] float32."""
    top2 = lp16.float().topk(2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


def by_position(
    per_prompt: list[dict[str, torch.Tensor]], edges: list[tuple[int, int]], gen_len: int
) -> dict[str, Any]:
    """results.json's `divergence_by_position`: per kl position bucket (over the 1-based generated position) the
    token-weighted mean of decode KL, prefill KL, top-1 agreement and the BF16 margin, and the standard error over
    the prompts that reach the bucket (outputs end at EOS, so later buckets hold fewer prompts)."""
    names = ("decode_kl", "prefill_kl", "decode_top1", "margin")
    buckets = []
    for lo, hi in edges:  # kvcal.evaluate.kl.position_buckets(gen_len)
        entry: dict[str, Any] = {"lo": lo, "hi": hi}
        parts = [{m: p[m][lo - 1 : hi] for m in names} for p in per_prompt if p["decode_kl"].numel() >= lo]
        entry["n_prompts"] = len(parts)
        entry["n_tokens"] = int(sum(p["decode_kl"].numel() for p in parts))
        for m in names:
            if not parts:
                entry[m] = entry[f"{m}_stderr"] = None
                continue
            entry[m] = float(torch.cat([p[m] for p in parts]).double().mean())
            means = [float(p[m].double().mean()) for p in parts]
            entry[f"{m}_stderr"] = mean_stderr(means)
        buckets.append(entry)
    return {"gen_len": gen_len, "n_prompts": len(per_prompt), "buckets": buckets}


# ---- prompts ------------------------------------------------------------------------------------------------


def lm_eval_requests(
    spec: str | dict[str, Any],
    task_manager: Any,
    num_fewshot: int | None,
    fewshot_seed: int,
    limit: int | None,
) -> tuple[Any, list[Any]]:
    """(lm-eval Task, its generate_until Instances in doc order) of one task spec, built the way simple_evaluate
    builds them (its --num-fewshot override, its few-shot seed)."""
    from lm_eval.tasks import get_task_dict

    tasks = [t for t in _leaf_tasks(get_task_dict([spec], task_manager))]
    if len(tasks) != 1:
        raise UsageError(f"a divergence task needs one lm-eval task for its prompts, got {len(tasks)}")
    task = tasks[0]
    if task.get_config("output_type") != "generate_until":
        raise UsageError(f"the divergence prompts' task '{task.config.task}' is not a generative task")
    if num_fewshot is not None and task.get_config("num_fewshot") != 0:
        task.set_config(key="num_fewshot", value=num_fewshot)
    elif task.get_config("num_fewshot") is None:
        task.set_config(key="num_fewshot", value=0)
    task.set_fewshot_seed(seed=fewshot_seed)
    task.build_all_requests(limit=limit, rank=0, world_size=1)
    return task, sorted(task.instances, key=lambda inst: inst.doc_id)


def _leaf_tasks(d: Any) -> list[Any]:
    out = []
    for v in d.values():
        out.extend(_leaf_tasks(v) if isinstance(v, dict) else [v])
    return out


def extracted_answers(task: Any, instances: list[Any], texts: list[str]) -> list[str]:
    """The answer lm-eval's first filter of `task` extracts from each text (its filtered response)."""
    for inst, text in zip(instances, texts, strict=True):
        inst.resps = [text]
        inst.filtered_resps = {}
    task.apply_filters()
    name = task._filters[0].name
    out = []
    for inst in instances:
        r = inst.filtered_resps[name]
        out.append(str(r[0] if isinstance(r, (list, tuple)) else r))
    return out


def _cut(text: str, until: list[str]) -> str:
    # lm-eval's HFLM cuts a generation at the first stop sequence
    for term in until:
        if term:
            text = text.split(term)[0]
    return text


def eos_ids(tokenizer: Any, model: Any) -> set[int]:
    ids: set[int] = set()
    gen = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for v in (tokenizer.eos_token_id, gen):
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)
    return ids


# ---- the task -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class UserPrompts:
    """`--prompts FILE.jsonl` read: the prompt texts in file order and the file's sha256 (names the prompts)."""

    texts: list[str]
    sha256: str


@dataclass
class _UserPrompt:
    """What the loop reads of an lm-eval Instance, for a prompt of --prompts: its index and no stop sequence."""

    doc_id: int
    text: str

    @property
    def arguments(self) -> tuple[str, dict[str, Any]]:
        return self.text, {}


def run_divergence(
    lm: Any,
    *,
    task: str,
    prompts_spec: str | dict[str, Any],
    task_manager: Any,
    quant_session: Callable[[], ChunkForward],
    baseline: Any,
    baseline_desc: dict[str, Any],
    evaluated_desc: dict[str, Any],
    fingerprint: str,
    gen_len: int,
    edges: list[tuple[int, int]],
    limit: int | None,
    num_fewshot: int | None,
    fewshot_seed: int,
    prefill_chunk: int,
    cache_dir: Path | None = None,
    user_prompts: UserPrompts | None = None,
    batch_size: int = 1,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Evaluate divergence task `task` (module docstring) with kvcal's lm-eval model `lm` (.model, .tokenizer,
    .tok_encode, .tok_decode, .max_length). `quant_session()` / `baseline()`: as kl's (kvcal.evaluate.kl.lm_sides).
    `fingerprint`: the checkpoint's (kvcal.evaluate.kl.model_fingerprint), part of the baseline trajectories' key.
    `batch_size`: prompts decoded together (`group_prompts`; each pass over a batch, "decoding a batch" above).
    Returns (an lm-eval-shaped results dict with `divergence_by_position`, one sample record per prompt)."""
    from kvcal.models.loading import input_device

    if gen_len >= lm.max_length:
        raise UsageError(
            f"--max-gen-toks {gen_len} leaves no room for a prompt in the model's {lm.max_length} positions; "
            f"use at most {lm.max_length - 1}"
        )
    model, root = lm.model, cache_dir or cache_root()
    device = input_device(model)
    if user_prompts is None:
        lm_task, instances = lm_eval_requests(prompts_spec, task_manager, num_fewshot, fewshot_seed, limit)
        texts = [inst.arguments[0] for inst in instances]
    else:  # --prompts: the user's own; the "answer" is the whole output (no task filter to extract one)
        lm_task, texts = None, user_prompts.texts[:limit] if limit else user_prompts.texts
        instances = [_UserPrompt(i, t) for i, t in enumerate(texts)]
    eos = eos_ids(lm.tokenizer, model)
    room = lm.max_length - gen_len
    prompts = [lm.tok_encode(text)[-room:] for text in texts]
    groups = group_prompts(prompts, batch_size)
    keys: list[str] = [""] * len(prompts)
    for g in groups:
        for i in g:
            keys[i] = trajectory_key(
                fingerprint, baseline_desc, prompts[i], gen_len, eos, [prompts[j] for j in g]
            )
    hits = _baseline_trajectories(baseline, prompts, keys, groups, root, gen_len, eos, device)

    samples: list[dict[str, Any] | None] = [None] * len(prompts)
    per_prompt: list[dict[str, torch.Tensor] | None] = [None] * len(prompts)
    base_texts: list[str] = [""] * len(prompts)
    quant_texts: list[str] = [""] * len(prompts)
    with torch.no_grad():
        for g in groups:
            for i, rec, stats, texts_i in _one_batch(
                lm, g, prompts, keys, root, quant_session, baseline, gen_len, eos, prefill_chunk, device
            ):
                until = list((instances[i].arguments[1] or {}).get("until") or [])
                base_texts[i], quant_texts[i] = (_cut(t, until) for t in texts_i)
                samples[i], per_prompt[i] = {"doc_id": instances[i].doc_id, **rec}, stats
    done = [s for s in samples if s is not None]
    assert len(done) == len(samples)
    if lm_task is None:
        base_answers, quant_answers = base_texts, quant_texts
    else:
        base_answers = extracted_answers(lm_task, instances, base_texts)
        quant_answers = extracted_answers(lm_task, instances, quant_texts)
    for s, a, b in zip(done, base_answers, quant_answers, strict=True):
        s["answer_agree"] = float(a == b)
        s["base_answer"], s["quant_answer"] = a, b
    config = {
        "task": task,
        "output_type": "kvcal_divergence",
        "prompts": lm_task.config.task if lm_task else f"file sha256:{user_prompts.sha256}",
        "num_fewshot": lm_task.get_config("num_fewshot") if lm_task else None,
        "gen_len": gen_len,
        "greedy": True,
        "top_k": TOP_K,
        "eos_token_ids": sorted(eos),
        "answer_filter": lm_task._filters[0].name if lm_task else "none (the whole output)",
        "prefill_chunk": prefill_chunk,
        "batch_size": batch_size,
        "baseline": baseline_desc,
        "evaluated": evaluated_desc,
        "baseline_cache_hits": hits,
    }
    results = _results(task, done, config, len(lm_task.eval_docs) if lm_task else len(user_prompts.texts))
    results["divergence_by_position"] = {
        task: by_position([p for p in per_prompt if p is not None], edges, gen_len)
    }
    return results, done


def _baseline_trajectories(
    baseline: Any,
    prompts: list[list[int]],
    keys: list[str],
    groups: list[list[int]],
    root: Path,
    gen_len: int,
    eos: set[int],
    device: torch.device,
) -> int:
    """Greedy-decode the BF16 baseline of every batch with a prompt not cached yet (the whole batch, as the
    evaluated side decodes it), in one baseline() entry, and store its tokens. Returns the number of cache hits."""
    missing = {i for i, k in enumerate(keys) if load_trajectory(root, k) is None}
    todo = [g for g in groups if missing.intersection(g)]
    if todo:
        with baseline() as new_session, torch.no_grad():
            for g in todo:
                outs = greedy_batch(new_session(), [prompts[i] for i in g], gen_len, eos, device)
                for i, (tokens, _) in zip(g, outs, strict=True):
                    store_trajectory(root, keys[i], tokens)
    return len(keys) - len(missing)


def _one_batch(
    lm: Any,
    group: list[int],
    prompts: list[list[int]],
    keys: list[str],
    root: Path,
    quant_session: Callable[[], ChunkForward],
    baseline: Any,
    gen_len: int,
    eos: set[int],
    prefill_chunk: int,
    device: Any,
) -> list[tuple[int, dict[str, Any], dict[str, torch.Tensor], tuple[str, str]]]:
    """The three passes over one batch of prompts (indices `group`): per prompt (index, its sample record without
    doc_id and answers, its per-position statistics, (baseline text, quantized text) before the stop sequences)."""
    from kvcal.evaluate.kl import token_stats

    model = lm.model
    ps = [prompts[i] for i in group]
    base = [load_trajectory(root, keys[i]) for i in group]
    assert all(b is not None for b in base)  # stored by _baseline_trajectories
    base_tokens: list[list[int]] = [b for b in base if b is not None]
    seqs = [p + b[:-1] for p, b in zip(ps, base_tokens, strict=True)]
    firsts = [len(p) - 1 for p in ps]

    # the BF16 log-probs [n, V] float16 of each row: one chunked prefill through the BF16 cache
    lp_parts: list[list[torch.Tensor]] = [[] for _ in group]
    with baseline() as new_session:
        prefilled_batch(
            model, new_session(), seqs, firsts, prefill_chunk, device,
            lambda i, _r, logits: lp_parts[i].append(fp16_logprobs(logits).contiguous()),
        )  # fmt: skip
    base_lp16 = [torch.cat(p) for p in lp_parts]
    targets = [torch.tensor(b, dtype=torch.long) for b in base_tokens]

    quant = greedy_batch(quant_session(), ps, gen_len, eos, device)

    dec: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in group]
    pre: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in group]

    def reduce(into: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> Stats:
        def take(i: int, r: int, logits: torch.Tensor) -> None:
            m = logits.shape[0]
            kl, top1, _ = token_stats(base_lp16[i][r : r + m], logits, targets[i][r : r + m])
            into[i].append((kl, top1))

        return take

    teacher_forced_batch(quant_session(), ps, base_tokens, device, reduce(dec))
    prefilled_batch(model, quant_session(), seqs, firsts, prefill_chunk, device, reduce(pre))

    out = []
    for j, i in enumerate(group):
        b_tok, (q_tok, q_top) = base_tokens[j], quant[j]
        d_kl, d_top1 = (torch.cat(x) for x in zip(*dec[j], strict=True))
        p_kl = torch.cat([x[0] for x in pre[j]])
        base_top = base_lp16[j].float().topk(TOP_K, dim=-1).indices
        t, event = first_divergence(b_tok, q_tok)
        stats = {
            "decode_kl": d_kl,
            "prefill_kl": p_kl,
            "decode_top1": d_top1,
            "margin": margins(base_lp16[j]),
        }
        rec = {
            "filter": "none",
            "metrics": list(METRICS),
            "identical": float(b_tok == q_tok),
            "logprobs_close": float(logprobs_close(b_tok, q_tok, base_top.tolist(), q_top.tolist())),
            "decode_kl": float(d_kl.mean()),
            "prefill_kl": float(p_kl.mean()),
            "decode_top1": float(d_top1.mean()),
            "first_divergence": t,
            "diverged": event,
            "prompt_tokens": len(ps[j]),
            "prompt_sha256": prompt_sha256(ps[j]),
            "base_len": len(b_tok),
            "quant_len": len(q_tok),
            "base_tokens": b_tok,
            "quant_tokens": q_tok,
        }
        out.append((i, rec, stats, (lm.tok_decode(b_tok), lm.tok_decode(q_tok))))
    return out


def _results(task: str, samples: list[dict[str, Any]], config: dict[str, Any], total: int) -> dict[str, Any]:
    """lm-eval's results-dict shape for a divergence task: per-prompt means with their standard errors, and the
    divergences per 1,000 compared tokens (the report gives its interval, survival and projection)."""
    metrics: dict[str, Any] = {"alias": task}
    for m in METRICS:
        vals = [s[m] for s in samples]
        metrics[f"{m},none"] = sum(vals) / len(vals)
        se = mean_stderr(vals)
        metrics[f"{m}_stderr,none"] = "N/A" if se is None else se
    exposure = sum(s["first_divergence"] for s in samples)
    events = sum(bool(s["diverged"]) for s in samples)
    metrics["divergences_per_1k,none"] = events / exposure * 1000 if exposure else None
    metrics["divergences_per_1k_stderr,none"] = "N/A"
    hib = {m: m not in _LOWER for m in METRICS}
    hib["divergences_per_1k"] = False
    return {
        "results": {task: metrics},
        "configs": {
            task: {
                **config,
                "metric_list": [
                    {"metric": m, "higher_is_better": hib[m]} for m in (*METRICS, "divergences_per_1k")
                ],
                "metadata": {"version": DIVERGENCE_VERSION},
            }
        },
        "versions": {task: DIVERGENCE_VERSION},
        "n-shot": {task: config["num_fewshot"] or 0},
        "higher_is_better": {task: hib},
        "n-samples": {task: {"original": total, "effective": len(samples)}},
    }


def private_record(rec: dict[str, Any]) -> dict[str, Any]:
    """A divergence record of a private task: token ids dropped (decodable text), answers hashed."""
    out = {k: v for k, v in rec.items() if k not in ("base_tokens", "quant_tokens")}
    for k in ("base_answer", "quant_answer"):
        out[k] = "sha256:" + hashlib.sha256(str(rec[k]).encode()).hexdigest()
    return out
