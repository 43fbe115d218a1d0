"""The context the reported capacity assumes, through the pipeline (issue 14 item 4): the sweep YAML's `context:`
(recorded in sweep.yaml, read back by `kvcal compare RUNS_DIR`), the release YAML's `gate.context` (applied by the
release's gate), and `--context` on compare, sweep and release.

Run directories are written here in the run-directory contract (kvcal.rundir) for a model folder holding a
Gemma-3-270M-like config: 18 layers, 15 sliding (window 512) + 3 full, 1 KV head, head_dim 256."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from kvcal.errors import UsageError
from kvcal.pipeline import release
from kvcal.pipeline.release_config import parse_release_config
from kvcal.pipeline.sweep import config_dict, parse_sweep_config, recorded_context
from kvcal.rundir import COMPLETE, CONFIG, METRICS, RESULTS, RunConfig, samples_file

Invoke = Callable[[list[str]], tuple[int, str, str]]
SLIDING_IDX = [i for i in range(18) if i % 6 != 5]
# nvfp4 (4.5 bits) with the 15 sliding layers at 16 bits, vs BF16: at 32768 tokens a sliding layer holds 512 of
# them (15 x 1024 / 64 = 240 bytes per token): (3 x 1024 + 240) / (3 x 288 + 240) = 3; at <= 512: 18 x 1024 /
# (15 x 1024 + 3 x 288)
NVFP4_SKIP_AT_32K = 3.0
NVFP4_SKIP_IN_FULL = 18 * 1024 / (15 * 1024 + 3 * 288)
SWEEP = {"model": "m", "tasks": ["kl"], "formats": ["nvfp4"]}


def _run(root: Path, name: str, fmt: str, model: str, skip: list[int]) -> Path:
    """A complete kl run directory (12 windows) as `kvcal eval` writes it."""
    d = root / "kl" / name
    d.mkdir(parents=True)
    cfg = RunConfig(
        model=model, model_dir=model, kv_format=fmt, tasks=["kl"], skip_layers="sliding_window" if skip else "",
        skip_layer_indices=skip,
    )  # fmt: skip
    (d / CONFIG).write_text(yaml.safe_dump(cfg.to_dict()))
    kl = 0.0 if fmt == "bf16" else 0.01
    recs = [{"doc_id": i, "kl": kl, "top1_agree": 1.0, "nll": 3.0, "n_tokens": 64} for i in range(12)]
    (d / samples_file("kl")).write_text("".join(json.dumps(r) + "\n" for r in recs))
    (d / RESULTS).write_text(json.dumps({"results": {"kl": {"alias": "kl"}}}))
    (d / METRICS).write_text(json.dumps({"tokens_per_s": 100.0}))
    (d / COMPLETE).write_text("{}")
    return d


@pytest.fixture()
def runs_dir(tmp_path: Path, gemma_like: Path) -> Path:
    root = tmp_path / "runs"
    _run(root, "m__bf16", "bf16", str(gemma_like), [])
    _run(root, "m__nvfp4__skip-sliding", "nvfp4", str(gemma_like), SLIDING_IDX)
    return root


def _nvfp4_capacity(payload: dict) -> float:
    return next(c["capacity_vs_bf16"] for c in payload["configurations"] if c["kv_format"] == "nvfp4")


# ---- sweep ------------------------------------------------------------------------------------------------------


def test_sweep_context_key_is_recorded_in_sweep_yaml(tmp_path: Path) -> None:
    cfg = parse_sweep_config({**SWEEP, "context": 8192})
    assert cfg.context == 8192 and parse_sweep_config(SWEEP).context is None
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(config_dict(cfg)))
    assert recorded_context(tmp_path) == 8192
    assert parse_sweep_config(yaml.safe_load((tmp_path / "sweep.yaml").read_text())) == cfg
    assert recorded_context(tmp_path / "nowhere") is None
    for bad in (0, -1, "8k"):
        with pytest.raises(UsageError, match="sweep config: 'context' must be"):
            parse_sweep_config({**SWEEP, "context": bad})


def test_compare_of_a_runs_dir_takes_the_sweeps_context(runs_dir: Path, invoke: Invoke) -> None:
    code, out, err = invoke(["compare", str(runs_dir), "--json", "--bootstrap", "200"])
    assert code == 0, err
    d = json.loads(out)
    assert "capacity_context" not in d  # no context given, none evaluated: sliding layers in full
    assert _nvfp4_capacity(d) == pytest.approx(NVFP4_SKIP_IN_FULL, rel=1e-12)
    (runs_dir / "sweep.yaml").write_text(
        yaml.safe_dump(config_dict(parse_sweep_config({**SWEEP, "context": 32768})))
    )
    code, out, err = invoke(["compare", str(runs_dir), "--json", "--bootstrap", "200"])
    assert code == 0, err
    d = json.loads(out)
    assert d["capacity_context"] == {"tokens": 32768, "source": "the sweep's context: in sweep.yaml"}
    assert _nvfp4_capacity(d) == pytest.approx(NVFP4_SKIP_AT_32K, rel=1e-12)
    # --context wins over sweep.yaml; 512 <= the window: the same as counting sliding layers in full
    code, out, err = invoke(["compare", str(runs_dir), "--context", "512", "--json", "--bootstrap", "200"])
    assert code == 0, err
    assert _nvfp4_capacity(json.loads(out)) == pytest.approx(NVFP4_SKIP_IN_FULL, rel=1e-12)


def test_sweep_context_option_refuses_a_non_positive_context(tmp_path: Path, invoke: Invoke) -> None:
    conf = tmp_path / "sweep.yaml"
    conf.write_text(yaml.safe_dump(SWEEP))
    code, _, err = invoke(["sweep", str(conf), "-o", str(tmp_path / "out"), "--dry-run", "--context", "0"])
    assert code == 2 and "Error: --context must be a positive number of tokens" in err


# ---- release ----------------------------------------------------------------------------------------------------


def test_release_gate_context(runs_dir: Path) -> None:
    raw = {"ship": {"kv_format": "nvfp4"}, "gate": {"context": 32768, "bootstrap": 200}}
    cfg = parse_release_config(raw)
    assert cfg.gate.context == 32768 and cfg.to_dict()["gate"]["context"] == 32768
    assert parse_release_config({"ship": {"kv_format": "nvfp4"}}).gate.context is None
    with pytest.raises(UsageError, match=r"^release config.*'context' must be a positive number of tokens"):
        parse_release_config({"ship": {"kv_format": "nvfp4"}, "gate": {"context": 0}})
    # the release's gate compares its runs at gate.context (its other inputs: the config and a warning sink)
    cells = [SimpleNamespace(path=p) for p in sorted((runs_dir / "kl").iterdir())]
    cmp = release.gate(SimpleNamespace(cfg=cfg, warn=lambda _m: None), cells)  # type: ignore[arg-type]
    assert cmp.context == 32768
    assert cmp.config("m__nvfp4__skip-sliding").capacity == pytest.approx(NVFP4_SKIP_AT_32K, rel=1e-12)


def test_release_has_a_context_option(invoke: Invoke) -> None:
    code, out, _ = invoke(["release", "--help"])
    assert code == 0 and "--context" in out
