"""Prefill / decode timing (kvcal.evaluate.timing) and lm-eval's quiet git probe (kvcal.evaluate.git_probe).

Counts are checked exactly (forwards of a real tiny Llama; a real `kvcal eval` of a generative task whose prompt
and generated tokens are counted back from its samples). No assertion is about how long anything took.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from kvcal.evaluate import timing  # noqa: E402

# ---- the classification and the arithmetic ----------------------------------------------------------------


def test_classify_rule() -> None:
    assert timing.classify(new_tokens=7, cached=0) == timing.PREFILL  # a prompt
    assert timing.classify(new_tokens=1, cached=0) == timing.PREFILL  # a one-token prompt: empty cache
    assert timing.classify(new_tokens=4, cached=16) == timing.PREFILL  # a chunk of a chunked prefill
    assert timing.classify(new_tokens=1, cached=16) == timing.DECODE  # one generate step


def test_totals_summary_and_merge() -> None:
    a = timing.ForwardTotals(1, 10, 0.5, 3, 6, 1.5, [0.5, 0.5])
    b = timing.ForwardTotals(2, 30, 1.5, 0, 0, 0.0, [])
    m = timing.ForwardTotals.merge([a, b])
    assert m == timing.ForwardTotals(3, 40, 2.0, 3, 6, 1.5, [0.5, 0.5])
    s = m.summary()
    assert s["prefill_tokens_per_s"] == 20.0 and s["decode_tokens_per_s"] == 4.0 and s["tpot_s"] == 0.5
    assert s["requests"] == 2 and s["ttft_s_mean"] == 0.5 and s["ttft_s_median"] == 0.5
    assert m.tokens == 46
    assert timing.ForwardTotals.from_record(m.to_record()) == m
    empty = timing.ForwardTotals().summary()
    assert (
        empty["prefill_tokens_per_s"] is None and empty["tpot_s"] is None and empty["ttft_s_median"] is None
    )


def test_run_timing_merges_parts_and_refuses_a_partial_total() -> None:
    a = timing.ForwardTotals(1, 10, 1.0, 2, 2, 1.0, [1.0])
    b = timing.ForwardTotals(1, 5, 1.0, 4, 4, 1.0, [3.0])
    parts = [{timing.FORWARDS_KEY: a.to_record()}, {timing.FORWARDS_KEY: b.to_record()}]
    t = timing.run_timing(parts)
    assert (t["prefill_tokens"], t["decode_tokens"], t["requests"], t["ttft_s_median"]) == (15, 6, 2, 2.0)
    assert all(v is None for v in timing.run_timing([*parts, {}]).values())  # a part finished untimed


# ---- the forwards of a real tiny model ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(word_llama_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(word_llama_dir), dtype=torch.float32).eval()


def test_generate_is_one_prefill_then_one_decode_step_per_token(llama: torch.nn.Module) -> None:
    ids = torch.tensor([[5, 9, 33, 7, 8], [40, 41, 42, 43, 44]])  # [B=2, T=5]
    timer = timing.ForwardTimer(llama)
    try:
        with torch.no_grad(), timer.generate_call(batch=2):
            out = llama.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4, do_sample=False,
                pad_token_id=1,
            )  # fmt: skip
        t = timer.take()
    finally:
        timer.close()
    assert out.shape == (2, 9)  # 4 tokens generated per sequence: the first from the prefill, 3 decode steps
    assert (t.prefill_forwards, t.prefill_tokens, t.decode_steps, t.decode_tokens) == (1, 10, 3, 6)
    assert len(t.ttft_s) == 2 and t.ttft_s[0] == t.prefill_s  # both sequences of the call share its prefill
    assert t.tokens == 16  # what the former token counter summed: every position a forward processed


def test_cacheless_and_chunked_forwards_are_prefill(llama: torch.nn.Module) -> None:
    from transformers import DynamicCache

    timer = timing.ForwardTimer(llama)
    try:
        with torch.no_grad():
            llama(torch.tensor([[3, 4, 5]]))  # a loglikelihood batch: no cache
            cache = DynamicCache(config=llama.config)
            llama(torch.tensor([[3, 4, 5, 6]]), past_key_values=cache, use_cache=True)  # chunk 1
            llama(torch.tensor([[7, 8]]), past_key_values=cache, use_cache=True)  # chunk 2 over 4 cached
            llama(torch.tensor([[9]]), past_key_values=cache, use_cache=True)  # a decode step over 6 cached
        t = timer.take()
        assert timer.take() == timing.ForwardTotals()  # take() started new totals
    finally:
        timer.close()
    assert (t.prefill_forwards, t.prefill_tokens, t.decode_steps, t.decode_tokens) == (3, 9, 1, 1)
    assert t.ttft_s == []  # no generate call marked: no request


# ---- kvcal eval end to end: exact counts from the samples, and no git noise outside a checkout --------------

MAX_GEN = 5
GEN_DOCS = [{"q": "t5 t9 t33", "a": "t7"}, {"q": "t40 t41", "a": "t8"}, {"q": "t100 t3 t4 t200", "a": "t9"}]


@pytest.mark.slow
def test_eval_splits_prefill_from_decode_and_keeps_git_quiet(
    word_llama_dir: Path,
    lm_eval_task: Callable[..., None],
    invoke: Callable[[list[str]], tuple[int, str, str]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    from transformers import AutoTokenizer

    if shutil.which("git") is None:
        pytest.skip("no git on PATH: lm-eval's probe has nothing to print")
    cwd = tmp_path / "not-a-checkout"
    cwd.mkdir()
    probe = subprocess.run(
        ["git", "describe", "--always"], cwd=cwd, capture_output=True, text=True, check=False
    )
    if "fatal:" not in probe.stderr:
        pytest.skip(f"{cwd} is inside a git checkout here: git says nothing to silence")
    # "zz" never appears in the word model's output: a generation stops at EOS or after MAX_GEN tokens
    lm_eval_task(
        tmp_path / "tasks", "gen_timed", "generate_until", GEN_DOCS, ["exact_match"],
        generation_kwargs={"until": ["zz"], "max_gen_toks": MAX_GEN, "do_sample": False},
    )  # fmt: skip
    monkeypatch.chdir(cwd)
    code, _out, err = invoke(
        ["eval", str(word_llama_dir), "--kv-format", "fp8_e4m3", "--tasks", "gen_timed", "--include-path",
         str(tmp_path / "tasks"), "--batch-size", "1", "--output", str(tmp_path / "run")]
    )  # fmt: skip
    assert code == 0, err
    assert "complete" in err  # kvcal's own messages still reach the terminal
    assert "fatal:" not in capfd.readouterr().err  # git's, from lm-eval's probe, do not

    tok = AutoTokenizer.from_pretrained(str(word_llama_dir))
    samples = [
        json.loads(line) for line in (tmp_path / "run" / "samples_gen_timed.jsonl").read_text().splitlines()
    ]
    assert len(samples) == len(GEN_DOCS)
    prompt_tokens = sum(len(tok(s["arguments"][0][0]).input_ids) for s in samples)
    # generated tokens from the text: one word per token (the word-level tokenizer "t0".."t255"; EOS "t2" and pad
    # "t1" are special and decode to nothing), plus the EOS where a generation stopped before MAX_GEN
    words = [s["resps"][0][0].split() for s in samples]
    assert all(w and all(x.startswith("t") for x in w) and len(w) <= MAX_GEN for w in words)
    generated = [len(w) + (len(w) < MAX_GEN) for w in words]

    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    task = metrics["per_task"]["gen_timed"]
    assert task["prefill_tokens"] == prompt_tokens
    # the first token of each request comes from its prefill; each later one from one decode step (batch 1)
    assert task["decode_tokens"] == task["decode_steps"] == sum(g - 1 for g in generated)
    assert task["requests"] == len(samples)
    assert task["tokens"] == task["prefill_tokens"] + task["decode_tokens"]
    for key in ("prefill_tokens_per_s", "ttft_s_mean", "ttft_s_median", "decode_tokens_per_s", "tpot_s"):
        assert task[key] is not None and task[key] > 0, key
    # one prefill forward per request here, so TTFT covers all prefill time
    assert task["ttft_s_mean"] * task["requests"] == pytest.approx(task["prefill_s"], rel=1e-9)
    for key in ("prefill_tokens", "decode_tokens", "decode_steps", "requests", "prefill_s", "decode_s"):
        assert metrics[key] == task[key], key  # one task: the run's totals are its own
    assert metrics["tokens"] == task["tokens"] and metrics["wall_s"] == task["wall_s"]
