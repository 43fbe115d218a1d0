"""`kvcal release` end to end on a tiny random Llama: the first release calibrates, a rerun reuses everything (no
model forward: counted on the model class's forward), a changed weight makes the scales stale, traffic beyond the
calibrated amax drifts, a regressing candidate fails the gate; and one `Error:` line per bad input."""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.usefixtures("one_thread")

Invoke = Callable[[list[str]], tuple[int, str, str]]

# Small enough to run in seconds: kl on 12 windows of 32 tokens of kvcal's embedded text, calibration on 4 x 32
# tokens of the generated corpus.
BASE: dict[str, Any] = {
    "ship": {"kv_format": "fp8_e4m3", "granularity": "tensor"},
    "calibration": {"num_samples": 4, "seq_len": 32},
    "evaluate": {"tasks": ["kl"], "limit": 12, "kl_seq_len": 32, "dtype": "float32", "impl": "torch"},
    "gate": {"min_samples": 5, "bootstrap": 400},
    "export": {"engines": ["vllm", "sglang"]},
}
# what a rerun must decide the same (`recalibrated` / `reason` say what this run did: they differ on a rerun)
DECISION_KEYS = (
    "decision", "exit_code", "model_sha256", "scales_path", "scales_sha256", "drift",
    "gate", "configurations", "exports", "serve_flags",
)  # fmt: skip


def _config(tmp: Path, name: str = "release.yaml", **override: Any) -> Path:
    raw = json.loads(json.dumps(BASE))
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict):
            raw[key].update(value)
        else:
            raw[key] = value
    path = tmp / name
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def _record(out: Path) -> dict[str, Any]:
    return json.loads((out / "release.json").read_text())


def _decision(record: dict[str, Any]) -> dict[str, Any]:
    return {k: record[k] for k in DECISION_KEYS}


@pytest.fixture
def counts(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Real counters: every forward of the Llama class and every kvcal.models.loading.load_model (the wrappers call the
    real functions)."""
    import transformers

    from kvcal.calibrate import drift
    from kvcal.models import loading
    from kvcal.pipeline import sweep

    seen = {"forward": 0, "load_model": 0}
    real_forward = transformers.LlamaForCausalLM.forward
    real_load = loading.load_model

    @functools.wraps(real_forward)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen["forward"] += 1
        return real_forward(self, *args, **kwargs)

    @functools.wraps(real_load)
    def load(*args: Any, **kwargs: Any) -> Any:
        seen["load_model"] += 1
        return real_load(*args, **kwargs)

    monkeypatch.setattr(transformers.LlamaForCausalLM, "forward", forward)
    for module in (loading, sweep, drift):
        monkeypatch.setattr(module, "load_model", load)
    yield seen


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private copy of the tiny Llama (one test changes a weight in it)."""
    dst = tmp_path_factory.mktemp("release-model") / "tiny-llama"
    shutil.copytree(tiny_llama_dir, dst)
    return dst


def _change_one_weight(model: Path) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(str(model / "model.safetensors"))
    name = "model.layers.0.self_attn.k_proj.weight"
    weights[name] = weights[name].clone()
    weights[name][0, 0] += 0.5
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})


def test_release_calibrates_then_reuses_then_recalibrates_when_stale(
    model_dir: Path, tmp_path: Path, invoke: Invoke, counts: dict[str, int]
) -> None:
    out = tmp_path / "out"
    cfg = _config(tmp_path)
    code, stdout, stderr = invoke(["release", str(model_dir), "--config", str(cfg), "-o", str(out)])
    assert code == 0, stderr
    first = _record(out)
    assert first["decision"] == "ship" and first["gate"] == "pass" and first["recalibrated"] is True
    assert first["reason"].startswith("no scale file configured")
    assert first["drift"] is None
    assert Path(first["scales_path"]).parent == out / "scales" and Path(first["scales_path"]).is_file()
    assert first["work"]["calibrations_run"] == 1 and first["work"]["evaluations_run"] == 2
    assert [c["role"] for c in first["configurations"]] == ["baseline", "ship"]
    assert first["configurations"][1]["gate"] == "pass"
    vllm = Path(first["exports"]["vllm"]["path"])
    assert (vllm / "kv_scales.safetensors").is_file() and (vllm / "config.json").is_file()
    sglang = json.loads(Path(first["exports"]["sglang"]["path"]).read_text())
    assert sglang["kv_cache"]["dtype"] == "float8_e4m3fn"
    assert first["serve_flags"]["vllm"] == ["--kv-cache-dtype", "fp8"]
    assert first["serve_flags"]["sglang"] == [
        "--kv-cache-dtype", "fp8_e4m3", "--quantization-param-path", first["exports"]["sglang"]["path"],
    ]  # fmt: skip
    assert f"serve (vllm): vllm serve {vllm} --kv-cache-dtype fp8" in stdout
    # every evaluated configuration's engine commands (kvcal.engines): in release.json, release.md and stdout
    assert sorted(first["engine_commands"]) == sorted(c["label"] for c in first["configurations"])
    ship = first["engine_commands"][first["configurations"][1]["label"]]
    assert ship["vllm"]["serve_argv"][:2] == ["vllm", "serve"]
    argv = ship["vllm"]["serve_argv"]
    assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8"
    assert ship["vllm"]["export_argv"][:2] == ["kvcal", "export"]
    assert f"engine commands for {first['configurations'][1]['label']}:" in stdout
    assert "## Engine commands" in (out / "release.md").read_text()
    assert "# kvcal release: SHIP" in (out / "release.md").read_text()
    assert counts["forward"] > 0 and counts["load_model"] == 1  # calibration (eval loads through lm-eval)

    # Rerun, nothing changed: the same decision, and not one forward pass or model load.
    counts.update(forward=0, load_model=0)
    code, stdout, stderr = invoke(["release", str(model_dir), "--config", str(cfg), "-o", str(out)])
    assert code == 0, stderr
    again = _record(out)
    assert counts == {"forward": 0, "load_model": 0}
    assert again["work"]["reused_everything"] is True
    # it says what happened: nothing was recalibrated, the earlier release's file was reused
    name = Path(first["scales_path"]).name
    assert again["recalibrated"] is False and again["work"]["calibrations_run"] == 0
    assert (
        again["reason"]
        == f"no scale file configured (scales:): calibrated by an earlier release ({name}), reused"
    )
    assert f"recalibrated: no ({again['reason']})" in stdout and "everything reused" in stdout
    assert "**Recalibrated:** no" in (out / "release.md").read_text()
    assert again["work"]["calibrations_reused"] == 1 and again["work"]["evaluations_reused"] == 2
    assert again["work"]["exports_reused"] == 2
    assert _decision(again) == _decision(first)

    # The file in service is the one the first release calibrated: bound, not recalibrated, runs reused.
    bound = _config(tmp_path, "bound.yaml", scales=first["scales_path"])
    code, _, stderr = invoke(["release", str(model_dir), "--config", str(bound), "-o", str(out)])
    assert code == 0, stderr
    rec = _record(out)
    assert rec["recalibrated"] is False and rec["reason"] == "bound to this checkpoint"
    assert rec["verify"]["bound"] is True and rec["scales_sha256"] == first["scales_sha256"]
    assert counts["forward"] == 0

    # One weight changes: the scale file is stale -> recalibrated on the new checkpoint, evaluated again.
    _change_one_weight(model_dir)
    code, _, stderr = invoke(["release", str(model_dir), "--config", str(bound), "-o", str(out)])
    assert code == 0, stderr
    stale = _record(out)
    assert stale["recalibrated"] is True
    assert stale["reason"].startswith("stale: weights changed (model.safetensors)")
    assert stale["verify"]["bound"] is False
    assert stale["model_sha256"] != first["model_sha256"]
    assert stale["scales_sha256"] != first["scales_sha256"]
    assert stale["work"]["calibrations_run"] == 1 and stale["work"]["evaluations_run"] == 2
    assert counts["forward"] > 0
    # only the current export of each engine stays
    assert sorted(p.name for p in (out / "exports").iterdir()) == sorted(
        Path(stale["exports"][e]["path"]).name for e in ("vllm", "sglang")
    )


def test_drifted_traffic_recalibrates_and_the_rerun_reuses_the_check(
    tiny_llama_dir: Path, tmp_path: Path, invoke: Invoke, counts: dict[str, int]
) -> None:
    from kvcal.calibrate.default_corpus import generate_corpus

    calib = tmp_path / "calib.txt"
    calib.write_text("the cat sat\n")  # a few tokens: their amax is far below what other text reaches
    traffic = tmp_path / "traffic.txt"
    traffic.write_text("\n\n".join(generate_corpus(24, seed=7)))
    cfg = _config(
        tmp_path,
        calibration={"dataset": str(calib), "num_samples": 1, "seq_len": 8},
        drift={"dataset": str(traffic), "num_samples": 8, "seq_len": 32},
        export={"engines": ["vllm"]},
        ship={"kv_format": "fp8_e4m3", "granularity": "tensor", "skip_layers": "0"},
    )
    out = tmp_path / "out"
    code, _, stderr = invoke(["release", str(tiny_llama_dir), "--config", str(cfg), "-o", str(out)])
    assert code == 0, stderr
    rec = _record(out)
    assert rec["drift"]["verdict"] == "drifted" and rec["drift"]["reasons"]
    assert rec["recalibrated"] is True and "drifted on traffic.txt" in rec["reason"]
    assert rec["drift"]["checked_scales_sha256"] != rec["scales_sha256"]  # shipped: the traffic's scales
    assert rec["work"]["calibrations_run"] == 2 and rec["work"]["drift_checks_run"] == 1
    from kvcal.scales import load_scale_file

    assert load_scale_file(rec["scales_path"]).manifest["calibration"]["source"] == str(traffic)
    assert rec["serve_flags"]["vllm"] == ["--kv-cache-dtype", "fp8", "--kv-cache-dtype-skip-layers", "0"]

    counts.update(forward=0, load_model=0)
    code, _, stderr = invoke(["release", str(tiny_llama_dir), "--config", str(cfg), "-o", str(out)])
    assert code == 0, stderr
    again = _record(out)
    assert counts == {"forward": 0, "load_model": 0}
    assert again["work"]["drift_checks_reused"] == 1 and again["work"]["reused_everything"] is True
    assert again["recalibrated"] is False and again["reason"].endswith("reused")
    assert _decision(again) == _decision(rec)

    # on_drift: fail -> exit 1, nothing evaluated or exported (the stored drift check answers: no forward)
    raw = yaml.safe_load(cfg.read_text())
    raw["drift"]["on_drift"] = "fail"
    fail = tmp_path / "fail.yaml"
    fail.write_text(yaml.safe_dump(raw))
    code, _, stderr = invoke(["release", str(tiny_llama_dir), "--config", str(fail), "-o", str(out)])
    assert code == 1
    rec = _record(out)
    assert rec["decision"] == "fail" and rec["gate"] == "not run" and rec["exports"] == {}
    assert rec["failed_because"].startswith("drift")
    assert counts["forward"] == 0


def test_a_regressing_candidate_fails_the_gate(tiny_llama_dir: Path, tmp_path: Path, invoke: Invoke) -> None:
    cfg = _config(
        tmp_path,
        evaluate={"candidates": [{"kv_format": "fp4_e2m1"}]},
        gate={"max_drop": {"default": 0.5, "kl": 1e-4}},  # the per-metric form: kl gates tightly
        export={"engines": ["vllm"]},
    )
    out = tmp_path / "out"
    code, _, stderr = invoke(["release", str(tiny_llama_dir), "--config", str(cfg), "-o", str(out)])
    assert code == 1, stderr
    rec = _record(out)
    assert rec["decision"] == "fail" and rec["gate"] == "fail" and rec["exports"] == {}
    by_role = {c["label"]: c for c in rec["configurations"]}
    mx = next(c for c in by_role.values() if c["kv_format"] == "fp4_e2m1")
    assert mx["role"] == "candidate" and mx["gate"] == "FAIL"
    assert any(f["config"] == mx["label"] for f in rec["gate_failures"])
    assert not (out / "exports").exists()
    assert "DO NOT SHIP" in (out / "release.md").read_text()


def test_an_interrupted_release_resumes(
    tiny_llama_dir: Path, tmp_path: Path, invoke: Invoke, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvcal.pipeline import sweep

    real_run_eval = sweep.run_eval
    calls = {"n": 0}

    def interrupted_second(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt  # Ctrl-C while the second evaluation starts
        return real_run_eval(*args, **kwargs)

    monkeypatch.setattr(sweep, "run_eval", interrupted_second)
    cfg = _config(tmp_path, export={"engines": []})
    out = tmp_path / "out"
    code, _, stderr = invoke(["release", str(tiny_llama_dir), "--config", str(cfg), "-o", str(out)])
    assert code == 1
    lines = stderr.strip().splitlines()
    assert lines[-1].startswith("Error: release interrupted") and "rerun the same command" in lines[-1]
    assert sum(ln.startswith("Error:") for ln in lines) == 1
    assert not (out / "release.json").exists()
    assert not list(out.rglob("*.tmp"))  # only whole files: atomic writes
    monkeypatch.setattr(sweep, "run_eval", real_run_eval)
    code, _, stderr = invoke(["release", str(tiny_llama_dir), "--config", str(cfg), "-o", str(out)])
    assert code == 0, stderr
    rec = _record(out)
    assert rec["work"]["calibrations_reused"] == 1 and rec["work"]["calibrations_run"] == 0
    assert rec["work"]["evaluations_reused"] == 1 and rec["work"]["evaluations_run"] == 1


# ---- bad input: one `Error:` line, exit 2, nothing written ---------------------------------------------------


def _one_error(invoke: Invoke, args: list[str], code: int = 2) -> str:
    rc, _, stderr = invoke(args)
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    assert rc == code, stderr
    assert len(lines) == 1 and lines[0].startswith("Error: "), stderr
    return lines[0]


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ({"model": "x"}, "unknown key 'model' (MODEL is the command's argument)"),
        ({"shipp": {"kv_format": "fp8"}}, "unknown key 'shipp'"),
        ({"drift": {"dataset": "t.txt", "max_clips": 0.1}}, "unknown key 'drift.max_clips'"),
        ({"calibration": {"num_sample": 4}}, "unknown calibration key(s) num_sample"),
        ({"ship": {"granularity": "tensor"}}, "'ship.kv_format' is required"),
        ({"drift": {"num_samples": 4}}, "'drift.dataset' is required"),
        ({"evaluate": {"candidates": [{"scales": "uncalibrated"}]}}, "'evaluate.candidates[1].kv_format' is required"),
        ({"export": {"engines": ["trtllm"]}}, "unknown engine 'trtllm' in export.engines; kvcal exports for vllm, sglang"),
        ({"ship": {"kv_format": "nvfp4"}}, "vllm cannot load nvfp4 scales; its export takes FP8 E4M3 scales"),
        ({"ship": {"kv_format": "fp8_e5m2"}}, "vllm cannot load fp8_e5m2 scales"),
        ({"ship": {"kv_format": "fp8", "granularity": "head"}},
         "sglang's --quantization-param-path takes one FP8 scale per layer (per tensor)"),
        ({"ship": {"kv_format": "mxfp4"}}, "'ship.kv_format' mxfp4 takes no calibrated scales"),
        ({"gate": {"alpha": 2}}, "gate.alpha must lie between 0 and 1"),
        ({"gate": {"max_drop": {"kl": "lots"}}}, "gate.max_drop kl: expected a number"),
    ],
)  # fmt: skip
def test_bad_release_configs(
    tmp_path: Path, invoke: Invoke, word_llama_dir: Path, override: dict[str, Any], needle: str
) -> None:
    raw = json.loads(json.dumps(BASE))
    for key, value in override.items():
        raw[key] = value if key not in raw or key == "ship" else {**raw[key], **value}
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    out = tmp_path / "out"
    line = _one_error(invoke, ["release", str(word_llama_dir), "--config", str(cfg), "-o", str(out)])
    assert "release config" in line and needle in line, line
    assert not out.exists()


def test_bad_traffic_and_output(tmp_path: Path, invoke: Invoke, word_llama_dir: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n")
    garbled = tmp_path / "garbled.txt"
    garbled.write_bytes(b"caf\xe9 \xff\xfe traffic\n")
    cases = [
        (empty, "is empty"),
        (garbled, "is not UTF-8"),
        (tmp_path / "missing.jsonl", "does not exist"),
    ]
    for traffic, needle in cases:
        cfg = _config(tmp_path, drift={"dataset": str(traffic)})
        out = tmp_path / f"out-{traffic.stem}"
        line = _one_error(invoke, ["release", str(word_llama_dir), "--config", str(cfg), "-o", str(out)])
        assert line.startswith("Error: drift.dataset") and needle in line, line
        assert not list(out.rglob("*")) if out.exists() else True
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    cfg = _config(tmp_path)
    line = _one_error(
        invoke, ["release", str(word_llama_dir), "--config", str(cfg), "-o", str(blocker / "out")]
    )
    assert "cannot write to -o" in line and "pass a writable folder" in line
    line = _one_error(
        invoke, ["release", str(word_llama_dir), "--config", str(tmp_path / "nope.yaml"), "-o", "x"]
    )
    assert "does not exist" in line
    # a block format whose block does not divide the model's head_dim (16)
    cfg = _config(tmp_path, evaluate={"candidates": [{"kv_format": "mxfp4"}]})
    line = _one_error(
        invoke, ["release", str(word_llama_dir), "--config", str(cfg), "-o", str(tmp_path / "o1")]
    )
    assert "evaluate.candidates[1].kv_format: mxfp4 needs head_dim divisible by its 32-element block" in line
    assert not (tmp_path / "o1" / "release.json").exists()
    # a configured scale file that is not there
    cfg = _config(tmp_path, scales=str(tmp_path / "gone.safetensors"))
    line = _one_error(
        invoke, ["release", str(word_llama_dir), "--config", str(cfg), "-o", str(tmp_path / "o2")]
    )
    assert "gone.safetensors" in line and "does not exist" in line
    assert not (tmp_path / "o2" / "release.json").exists()


def test_shipped_configs_parse() -> None:
    from kvcal.pipeline.release_config import load_release_config

    root = Path(__file__).resolve().parents[2] / "configs"
    paths = sorted(root.glob("release-*.yaml"))
    assert paths
    for p in paths:
        cfg = load_release_config(p)
        assert cfg.ship.kv_format == "fp8_e4m3" and "vllm" in cfg.export.engines
