"""`kvcal eval --prefix-serde NAME --prefix-tokens N` end to end on a tiny random Llama (kl task): the storage tier
changes exactly what it should.

- `-f bf16` alone is the kl baseline itself (kl 0); with the fp8 serde its first N positions' K/V are e4m3 values,
  so kl > 0; with aesgcm (an exact round trip) kl stays 0, and with a TurboQuant serde too on this 2-layer model
  (LMCache keeps a TurboQuant serde's first and last 2 layers raw).
- `-f fp8_e4m3` at scale 1.0 stores e4m3 values saturated at 448, the serde's own output: the serde changes nothing
  (every window's kl equal bit for bit), while under `int8_per_token_head` it does.
- config.yaml records the serde only when set; the two runs are different configurations (directory names, and
  `differences`); bad input is one `Error:` line with nothing written.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

Invoke = Callable[[list[str]], tuple[int, str, str]]
CORPUS = [
    "the cat sat on the mat and the dog sat on the log",
    "one two three four five six seven eight nine ten",
    "a quick brown fox jumps over the lazy dog near the river bank",
]
KL = ["--tasks", "kl", "--limit", "3", "--kl-seq-len", "24"]


@pytest.fixture(scope="module")
def model(tiny_lm_dir: Callable[..., Path]) -> Path:
    return tiny_lm_dir("llama", CORPUS, k_gain=8.0)  # larger K: more of them off the e4m3 grid's coarse steps


def _run(invoke: Invoke, model: Path, out: Path, fmt: str, *extra: str) -> list[float]:
    """Each kl window's KL of a run (samples_kl.jsonl, doc order)."""
    code, _stdout, err = invoke(["eval", str(model), "--kv-format", fmt, "-o", str(out), *KL, *extra])
    assert code == 0, err
    recs = [json.loads(line) for line in (out / "samples_kl.jsonl").read_text().splitlines()]
    return [r["kl"] for r in sorted(recs, key=lambda r: r["doc_id"])]


def test_fp8_serde_under_a_bf16_cache_moves_kl_off_zero(invoke: Invoke, model: Path, tmp_path: Path) -> None:
    plain = _run(invoke, model, tmp_path / "bf16", "bf16")
    serde = _run(invoke, model, tmp_path / "bf16-serde", "bf16", "--prefix-serde", "fp8", "--prefix-tokens", "4")
    exact = _run(invoke, model, tmp_path / "bf16-aes", "bf16", "--prefix-serde", "aesgcm", "--prefix-tokens", "4")
    # LMCache's TurboQuant serde stores the first and last 2 layers raw: on this 2-layer model, every layer
    tq = _run(invoke, model, tmp_path / "bf16-tq", "bf16", "--prefix-serde", "turboquant_k8v4", "--prefix-tokens", "4")
    assert plain == [0.0] * 3 and exact == [0.0] * 3 and tq == [0.0] * 3
    assert all(k > 0 for k in serde), serde
    cfg = yaml.safe_load((tmp_path / "bf16-serde" / "config.yaml").read_text())
    assert (cfg["prefix_serde"], cfg["prefix_tokens"], cfg["kv_input_dtype"]) == ("fp8", 4, "bfloat16")
    plain_cfg = yaml.safe_load((tmp_path / "bf16" / "config.yaml").read_text())
    assert "prefix_serde" not in plain_cfg and "prefix_tokens" not in plain_cfg
    metrics = json.loads((tmp_path / "bf16-serde" / "metrics.json").read_text())
    plain_metrics = json.loads((tmp_path / "bf16" / "metrics.json").read_text())
    # the storage tier's bytes beside the live cache's (fp8: half of bf16's), the live figure unchanged
    assert metrics["storage_bytes_per_token"] * 2 == metrics["bytes_per_token"] == plain_metrics["bytes_per_token"]
    assert "storage_bytes_per_token" not in plain_metrics


def test_fp8_serde_is_invisible_to_an_fp8_cache_and_not_to_int8(
    invoke: Invoke, model: Path, tmp_path: Path
) -> None:
    serde = ("--prefix-serde", "fp8", "--prefix-tokens", "4")
    fp8 = _run(invoke, model, tmp_path / "fp8", "fp8_e4m3")
    assert fp8 == _run(invoke, model, tmp_path / "fp8-serde", "fp8_e4m3", *serde)
    int8 = _run(invoke, model, tmp_path / "int8", "int8_per_token_head")
    assert int8 != _run(invoke, model, tmp_path / "int8-serde", "int8_per_token_head", *serde)


def test_runs_with_and_without_a_serde_are_different_configurations() -> None:
    from kvcal.evaluate.spec import EvalConfig, eval_spec, run_dir_name
    from kvcal.rundir import RunConfig

    plain = eval_spec(EvalConfig(model="m", kv_format="fp8_e4m3", tasks=["kl"]))
    serde = eval_spec(EvalConfig(model="m", kv_format="fp8_e4m3", tasks=["kl"], prefix_serde="fp8", prefix_tokens=64))
    assert run_dir_name(serde) == run_dir_name(plain) + "__serde-fp8-64"
    recorded = RunConfig(model_dir="", **plain.recorded_fields())
    assert {d.split(":")[0] for d in serde.differences(recorded)} == {"prefix_serde", "prefix_tokens"}
    assert plain.differences(recorded) == []
    # a bf16 run with a serde keeps its K/V dtype (the serde round-trips bf16 K/V) and finds itself again
    bf16 = eval_spec(EvalConfig(model="m", kv_format="bf16", tasks=["kl"], prefix_serde="fp8", prefix_tokens=4))
    assert bf16.differences(RunConfig(model_dir="", **bf16.recorded_fields())) == []


def test_sweep_and_release_settings_carry_the_serde() -> None:
    from kvcal.pipeline.settings import EvalSettings, eval_options, read_fields

    settings = EvalSettings(**read_fields(EvalSettings, {"prefix_serde": "fp8", "prefix_tokens": 16}, None, "key"))
    opts = eval_options(settings, "kl")
    assert (opts["prefix_serde"], opts["prefix_tokens"]) == ("fp8", 16)
    assert "prefix_serde" not in eval_options(EvalSettings(), "kl")


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--prefix-serde", "fp8"], ["--prefix-serde fp8 needs --prefix-tokens N"]),
        (["--prefix-tokens", "4"], ["--prefix-tokens 4 needs --prefix-serde NAME"]),
        (["--prefix-serde", "fp8", "--prefix-tokens", "0"], ["--prefix-tokens must be at least 1"]),
        (["--prefix-serde", "lz4", "--prefix-tokens", "4"], ["unknown --prefix-serde 'lz4'"]),
        (["--prefix-serde", "asym_k16_v8", "--prefix-tokens", "4"], ["asym_k16_v8 is not emulated"]),
        (["--kv-format", "auto", "--prefix-serde", "fp8", "--prefix-tokens", "4"], ["--kv-format bf16"]),
    ],
)
def test_bad_serde_options_are_one_error_line(
    invoke: Invoke, model: Path, tmp_path: Path, args: list[str], needles: list[str]
) -> None:
    out = tmp_path / "run"
    fmt = [] if "--kv-format" in args else ["--kv-format", "bf16"]
    code, _stdout, err = invoke(["eval", str(model), *fmt, "-o", str(out), *KL, *args])
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("Error: "), err
    for needle in needles:
        assert needle in lines[0], err
    assert not out.exists()


def test_lm_eval_model_args_carry_the_serde(model: Path) -> None:
    from kvcal.errors import UsageError
    from kvcal.evaluate.adapter import bind_model_args

    # lm-eval's --model_args strings: "prefix_serde=fp8,prefix_tokens=4" (a string, or an int its parser made)
    for tokens in ("4", 4):
        bound = bind_model_args(str(model), kv_format="bf16", prefix_serde="fp8", prefix_tokens=tokens)
        assert (bound.cache.prefix_serde, bound.cache.prefix_tokens) == ("fp8", 4)
    assert bind_model_args(str(model), kv_format="bf16").cache.prefix_serde is None
    with pytest.raises(UsageError, match="prefix_tokens must be a whole number"):
        bind_model_args(str(model), kv_format="bf16", prefix_serde="fp8", prefix_tokens="four")


@pytest.mark.parametrize("baseline", ["bf16", "auto"])
def test_a_sweeps_candidates_get_the_storage_tier_and_its_baseline_not(tmp_path: Path, baseline: str) -> None:
    from kvcal.pipeline import sweep

    cfg = sweep.parse_sweep_config({
        "model": "/models/m", "tasks": ["kl"], "formats": ["fp8", "int8_per_token_head"], "scales": ["uncalibrated"],
        "baseline": baseline, "prefix_serde": "fp8", "prefix_tokens": 64,
    })  # fmt: skip
    cells = sweep.plan_sweep(cfg, tmp_path / "runs").cells
    assert [c.spec.prefix_serde for c in cells if c.is_baseline] == [None]
    rest = [c for c in cells if not c.is_baseline]
    assert len(rest) == 2 and all((c.spec.prefix_serde, c.spec.prefix_tokens) == ("fp8", 64) for c in rest)
    assert all(c.path.name.endswith("__serde-fp8-64") for c in rest)
