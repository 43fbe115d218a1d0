"""`kvcal eval --nvfp4-global`: which global scale an nvfp4 cache without a scale file uses, recorded in the run.

"one" (the default) is vLLM's behaviour without checkpoint scales (k_scale = v_scale = 1.0); "per_sequence" is each
sequence's amax / (448 * 6) over its real tokens. The two must give different runs (directory names, config.yaml,
the report's scale label) and the option is refused where it means nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from kvcal.evaluate.run import EvalConfig, run_dir_name, run_eval
from kvcal.evaluate.spec import eval_spec
from kvcal.report.compare import describe_scales
from kvcal.rundir import CONFIG, RunConfig

Invoke = Callable[[list[str]], tuple[int, str, str]]
CORPUS = ["the cat sat on the mat and the dog sat on the log", "one two three four five six seven eight"]


@pytest.fixture(scope="module")
def model(tiny_lm_dir: Callable[..., Path]) -> Path:
    return tiny_lm_dir("gemma3", CORPUS)  # head_dim 16: one nvfp4 block


def _kl(model: Path, out: Path, **kw: object) -> tuple[RunConfig, dict]:
    import json

    cfg = EvalConfig(
        model=str(model), kv_format="nvfp4", tasks=["kl"], limit=2, kl_seq_len=16, output=str(out), **kw
    )
    run_dir = run_eval(eval_spec(cfg))
    recorded = RunConfig.from_dict(yaml.safe_load((run_dir / CONFIG).read_text()))
    results = json.loads((run_dir / "results.json").read_text())
    return recorded, results


def test_policies_are_recorded_and_named(model: Path, tmp_path: Path) -> None:
    one, res_one = _kl(model, tmp_path / "one")
    per_seq, res_seq = _kl(model, tmp_path / "seq", nvfp4_global="per_sequence")
    assert one.nvfp4_global == "one" and per_seq.nvfp4_global == "per_sequence"
    assert describe_scales(one) == "uncalibrated" and describe_scales(per_seq) == "per-sequence"
    assert one.identity() != per_seq.identity()  # not the same run: a rerun with the other policy is refused
    assert res_one["kvcal"]["runtime"]["nvfp4_global"] == "one"
    assert res_seq["kvcal"]["runtime"]["nvfp4_global"] == "per_sequence"
    # different global scales quantize differently: the KL against the BF16 cache differs
    assert res_one["results"]["kl"]["kl,none"] != res_seq["results"]["kl"]["kl,none"]
    assert run_dir_name(EvalConfig(model="m", kv_format="nvfp4")).split("__")[2] == "none"
    assert (
        run_dir_name(EvalConfig(model="m", kv_format="nvfp4", nvfp4_global="per_sequence")).split("__")[2]
        == "global-per_sequence"
    )


def test_other_formats_record_no_policy(model: Path, tmp_path: Path) -> None:
    cfg = EvalConfig(
        model=str(model), kv_format="fp8", tasks=["kl"], limit=1, kl_seq_len=16, output=str(tmp_path / "r")
    )
    recorded = RunConfig.from_dict(yaml.safe_load((run_eval(eval_spec(cfg)) / CONFIG).read_text()))
    assert recorded.nvfp4_global is None
    assert "nvfp4_global" not in recorded.to_dict()  # so earlier runs keep their identity hash


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--kv-format", "fp8_e4m3", "--nvfp4-global", "per_sequence"], "--nvfp4-global applies to"),
        (["--kv-format", "nvfp4", "--nvfp4-global", "batch"], "unknown nvfp4 global scale policy 'batch'"),
    ],
)
def test_refused_where_meaningless(
    invoke: Invoke, model: Path, tmp_path: Path, args: list[str], needle: str
) -> None:
    code, _out, err = invoke(["eval", str(model), "--tasks", "kl", "-o", str(tmp_path / "r"), *args])
    assert code == 2, err
    assert err.strip().splitlines() == [err.strip()] and err.startswith("Error: ") and needle in err
    assert not (tmp_path / "r").exists()


def test_describe_scales_follows_the_formats_table() -> None:
    """A static-scale format without a scale file runs at 1.0 ('uncalibrated': FP8, TensorRT-LLM's INT8 per tensor,
    a K/V pair with such a side); per-token / block formats are 'dynamic' (fp8_per_token_head included, whose name
    starts like FP8's); 16-bit formats have none."""
    from kvcal.rundir import RunConfig

    def desc(fmt: str) -> str:
        return describe_scales(RunConfig(model="m", model_dir="m", kv_format=fmt, tasks=["kl"]))

    assert [desc(f) for f in ("fp8_e4m3", "int8_per_tensor", "k=fp8_e4m3,v=int8_per_token_head")] == [
        "uncalibrated"
    ] * 3
    assert [desc(f) for f in ("fp8_per_token_head", "int8_per_token_head", "mxfp4", "turboquant_k8v4")] == [
        "dynamic"
    ] * 4
    assert [desc(f) for f in ("auto", "bf16", "float16")] == ["none"] * 3
