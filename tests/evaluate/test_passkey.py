"""kvcal's passkey tasks: the generator (deterministic, key token-exact at the requested depth, prompts of exactly
the requested length), the per-cell results, lm-eval end to end on a tiny random model (wiring only: accuracy
claims come from the real models), and bad input as one `Error:` line."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvcal.errors import UsageError
from kvcal.evaluate import passkey as pk
from kvcal.evaluate.kl import EMBEDDED_TEXT

pytestmark = pytest.mark.usefixtures("one_thread")

Invoke = Callable[[list[str]], tuple[int, str, str]]
# The tiny model's BPE (vocab 320) learns the prompt's fixed text too, so a 160-token prompt has filler to spare.
CORPUS = [p for p in EMBEDDED_TEXT.split("\n\n") if p.strip()] + [pk.PREFIX + pk.NEEDLE + pk.QUESTION] * 5
DEPTHS = [0.0, 0.1, 0.25, 0.5, 0.75, 1.0]


@pytest.fixture(scope="module")
def model(tiny_lm_dir: Callable[..., Path]) -> Path:
    return tiny_lm_dir("llama", CORPUS)  # max_position_embeddings 256


def _tokenizer(folder: Path | str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))  # a fresh object each time


def _docs(tok: Any, lengths: list[int], depths: list[float], per_cell: int, seed: int = 0) -> list[dict]:
    text, source = pk.filler_text(None)
    return pk.generate_docs(tok, pk.tokenize_filler(tok, text, source), lengths, depths, per_cell, seed)


def _ids(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


# ---- options ------------------------------------------------------------------------------------------------


def test_parse_lengths_and_depths() -> None:
    assert pk.parse_lengths("1k, 2k,4096,1.5k,1k") == [1024, 2048, 4096, 1536]
    assert pk.parse_depths("0,0.25,1,0.25") == [0.0, 0.25, 1.0]
    for bad in ("", "1q", "-1k", "0", "1.3", "0.1k", "k"):
        with pytest.raises(UsageError, match="--passkey-lengths"):
            pk.parse_lengths(bad)
    for bad in ("", "1.5", "-0.1", "half", "nan"):
        with pytest.raises(UsageError, match="--passkey-depths"):
            pk.parse_depths(bad)


# ---- the generator ------------------------------------------------------------------------------------------


def test_generator_is_deterministic_and_seeded(model: Path) -> None:
    a = _docs(_tokenizer(model), [160, 240], [0.0, 0.5], 3, seed=7)
    b = _docs(_tokenizer(model), [160, 240], [0.0, 0.5], 3, seed=7)
    assert a == b
    other = _docs(_tokenizer(model), [160, 240], [0.0, 0.5], 3, seed=8)
    assert [d["key"] for d in other] != [d["key"] for d in a]
    # a cell does not depend on which other cells are generated
    alone = _docs(_tokenizer(model), [240], [0.5], 3, seed=7)
    assert alone == [d for d in a if d["length"] == 240 and d["depth"] == 0.5]


def _check_placement(tok: Any, doc: dict[str, Any]) -> None:
    """The prompt tokenizes (as lm-eval's HFLM does: the tokenizer's own special tokens) to exactly `length`
    tokens: [BOS] + prefix + k filler + needle + (F - k) filler + question, k = round-half-up(depth * F)."""
    ids = list(tok(doc["prompt"])["input_ids"])
    bos = list(tok("x")["input_ids"])[: -len(_ids(tok, "x"))]
    prefix, question = _ids(tok, pk.PREFIX), _ids(tok, pk.QUESTION)
    needle = _ids(tok, pk.NEEDLE.format(key=doc["key"]))
    n_fill = doc["length"] - len(bos) - len(prefix) - len(needle) - len(question)
    k = math.floor(doc["depth"] * n_fill + 0.5)
    assert len(ids) == doc["length"]
    assert ids[: len(bos) + len(prefix)] == bos + prefix
    assert doc["needle_pos"] == len(bos) + len(prefix) + k
    assert ids[doc["needle_pos"] : doc["needle_pos"] + len(needle)] == needle
    assert ids[len(ids) - len(question) :] == question
    assert (doc["filler_tokens"], doc["filler_before"]) == (n_fill, k)
    if doc["depth"] == 0.0:
        assert doc["needle_pos"] == len(bos) + len(prefix)  # right after the instruction
    if doc["depth"] == 1.0:
        assert doc["needle_pos"] + len(needle) == len(ids) - len(question)  # right before the question
    assert doc["prompt"].count(doc["key"]) == 1
    assert 5 <= len(doc["key"]) <= 7 and doc["key"][0] != "0"
    assert doc["choices"][doc["label"]] == doc["key"] and len(set(doc["choices"])) == pk.N_CHOICES
    assert {len(c) for c in doc["choices"]} == {len(doc["key"])}
    assert all(c == doc["key"] or c not in doc["prompt"] for c in doc["choices"])


def test_key_at_the_requested_depth_token_exact(model: Path) -> None:
    tok = _tokenizer(model)
    docs = _docs(tok, [160, 240], DEPTHS, 3)
    assert len(docs) == 2 * len(DEPTHS) * 3
    for doc in docs:
        _check_placement(tok, doc)
    # the depths really move the key: k grows with depth within a length
    ks = [d["filler_before"] for d in docs if d["length"] == 240 and d["index"] == 0]
    assert ks == sorted(ks) and ks[0] == 0 and ks[-1] == docs[-1]["filler_tokens"]


@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m"])
def test_real_tokenizers_place_the_key_token_exact(
    name: str, real_model_path: Callable[[str], str], shared_data: Path
) -> None:
    from kvcal.models.resolve import resolve_model

    tok = _tokenizer(resolve_model(real_model_path(name)))
    docs = _docs(tok, [1024], [0.0, 0.5, 1.0], 1)  # the embedded filler
    text, source = pk.filler_text(shared_data)
    docs += pk.generate_docs(tok, pk.tokenize_filler(tok, text, source), [4096], [0.0, 0.5, 1.0], 1, 0)
    for doc in docs:
        _check_placement(tok, doc)


def test_filler_that_cannot_fill_a_length(model: Path) -> None:
    tok = _tokenizer(model)
    text, source = pk.filler_text(None)
    filler = pk.tokenize_filler(tok, text, source)
    tpl = pk.Template.of(tok)
    with pytest.raises(UsageError, match=f"has only {len(filler.ids)} with this tokenizer") as err:
        pk.generate_docs(tok, filler, [len(filler.ids) + 1000], [0.5], 1, 0)
    assert "--data-dir" in str(err.value) and "never repeated" in str(err.value)
    with pytest.raises(UsageError, match="too short for the passkey prompt"):
        pk.generate_docs(tok, filler, [len(tpl.prefix)], [0.5], 1, 0)


# ---- results ------------------------------------------------------------------------------------------------


def test_cells_accuracy_and_stderr() -> None:
    def rec(length: int, depth: float, hit: float) -> dict[str, Any]:
        return {"doc": {"length": length, "depth": depth}, "acc": hit}

    samples = [rec(2048, 0.5, 1.0)] + [rec(1024, 0.5, h) for h in (1, 1, 1, 0)] + [rec(1024, 0.0, 0.0)]
    assert pk.cells("passkey_mc", samples) == [
        {"length": 1024, "depth": 0.0, "n": 1, "acc": 0.0, "acc_stderr": None},
        {"length": 1024, "depth": 0.5, "n": 4, "acc": 0.75, "acc_stderr": 0.25},  # sd 0.5 / sqrt(4)
        {"length": 2048, "depth": 0.5, "n": 1, "acc": 1.0, "acc_stderr": None},
    ]


def test_first_integer_match() -> None:
    doc = {"key": "4803126"}
    assert pk.first_integer_match(doc, [" 4803126. Remember"]) == {"exact_match": 1.0}
    assert pk.first_integer_match(doc, ["4803126"]) == {"exact_match": 1.0}
    assert pk.first_integer_match(doc, [" 48031260"]) == {"exact_match": 0.0}
    assert pk.first_integer_match(doc, [" 12 then 4803126"]) == {"exact_match": 0.0}
    assert pk.first_integer_match(doc, [" none"]) == {"exact_match": 0.0}


# ---- lm-eval end to end -------------------------------------------------------------------------------------


def _eval(invoke: Invoke, model: Path, out: Path, *extra: str) -> tuple[int, str]:
    code, _stdout, err = invoke(["eval", str(model), "--kv-format", "auto", "-o", str(out), *extra])
    return code, err


def test_eval_end_to_end(invoke: Invoke, model: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = ["--tasks", "passkey,passkey_mc", "--passkey-lengths", "160,240", "--passkey-depths", "0,0.5,1"]
    code, err = _eval(invoke, model, out, *args, "--limit", "2", "--seed", "3")
    assert code == 0, err
    results = json.loads((out / "results.json").read_text())
    by_cell = results["passkey_by_cell"]
    assert set(by_cell) == {"passkey", "passkey_mc"}
    for task, metric in (("passkey", "exact_match"), ("passkey_mc", "acc")):
        cells = by_cell[task]
        assert [(c["length"], c["depth"], c["n"]) for c in cells] == [
            (n, d, 2) for n in (160, 240) for d in (0.0, 0.5, 1.0)
        ]
        overall = results["results"][task][f"{metric},none"]  # lm-eval's own aggregate over all 12 samples
        assert overall == pytest.approx(sum(c["acc"] for c in cells) / len(cells))
        records = [json.loads(line) for line in (out / f"samples_{task}.jsonl").read_text().splitlines()]
        assert len(records) == 12
        assert json.loads((out / "tasks" / f"{task}.json").read_text())["passkey_by_cell"] == {task: cells}
    # lm-eval's own context for the multiple-choice requests is the prompt: exactly `length` tokens
    tok = _tokenizer(model)
    mc = [json.loads(line) for line in (out / "samples_passkey_mc.jsonl").read_text().splitlines()]
    for rec in mc:
        contexts = {context for context, _ in rec["arguments"]}  # one (context, continuation) per choice
        assert len(contexts) == 1 and len(tok(contexts.pop())["input_ids"]) == rec["doc"]["length"]
        assert [cont for _, cont in rec["arguments"]] == [" " + c for c in rec["doc"]["choices"]]
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert (config["passkey_lengths"], config["passkey_depths"], config["limit"]) == (
        [160, 240],
        [0, 0.5, 1],
        2,
    )
    assert {d["key"] for d in (r["doc"] for r in mc)} == {
        d["key"] for d in _docs(tok, [160, 240], [0.0, 0.5, 1.0], 2, seed=3)
    }


def test_runs_without_passkey_keep_their_config() -> None:
    from kvcal.rundir import RunConfig

    keys = RunConfig(model="m", model_dir="d", kv_format="auto", tasks=["kl"]).to_dict()
    assert "passkey_lengths" not in keys and "passkey_depths" not in keys


# ---- bad input ----------------------------------------------------------------------------------------------


def _refused(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), err
    for needle in needles:
        assert needle in lines[0], err


def test_bad_input(invoke: Invoke, model: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    code, err = _eval(invoke, model, out, "--tasks", "passkey", "--passkey-lengths", "250")
    _refused(code, err, "256 positions", "at most 244")
    code, err = _eval(invoke, model, out, "--tasks", "passkey_mc", "--passkey-lengths", "1k,two")
    _refused(code, err, "'two'")
    code, err = _eval(invoke, model, out, "--tasks", "passkey", "--passkey-depths", "0,1.5")
    _refused(code, err, "'1.5'", "[0, 1]")
    data = tmp_path / "data"
    (data / "wikitext2").mkdir(parents=True)
    (data / "wikitext2" / "wiki.test.joined.txt").write_text("The cat sat on the mat. " * 3)
    code, err = _eval(
        invoke, model, out, "--tasks", "passkey", "--passkey-lengths", "240", "--data-dir", str(data)
    )
    _refused(code, err, "wikitext2-test filler text has only", "never repeated")
    assert not out.exists()  # refused before the run directory is written
