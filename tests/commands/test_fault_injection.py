"""Nothing lost, nothing silent (issue 43, item 5): every command of `kvcal --help` fed generated malformations of
its inputs keeps the promise — exit 1 or 2, exactly one `Error:` line on stderr, no traceback, nothing left behind
in the working folder, and a previous output there byte for byte as it was.

Each case starts from VALID inputs made once per module by kvcal itself (a scale file, a plan and its damage
checkpoint, run directories, traffic, sweep and release YAMLs) and breaks one of them: missing, empty, truncated,
the wrong type at the top level, a NaN, an out-of-range number, an unknown key, an output folder that cannot be
written (a file stands where its parent should be; chmod is no barrier to root, which runs CI here), and for the
commands that write, a previous output in place. The model-free errors come first, so no case loads a model's
weights except where the error is found by looking at them. SIGINT mid-write: test_sigint_mid_write_leaves_no_part.

The count of commands x malformations is in docs/trustworthy-numbers.md (`test_the_count_in_the_docs` keeps it)."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[2]
Invoke = Callable[[list[str]], tuple[int, str, str]]
SMALL_PLAN = ["--num-samples", "2", "--seq-len", "16", "--heldout-windows", "1", "--heldout-seq-len", "16"]


@dataclass(frozen=True)
class Inputs:
    """Valid inputs, made once: the malformations are made from these."""

    model: Path
    scales: Path
    plan: Path
    damage: Path
    runs: Path  # runs/bf16, runs/fp8: kl run directories
    traffic: Path
    sweep: dict[str, Any]
    release: dict[str, Any]
    release_out: Path  # a finished release folder (release.json, release.md)


@pytest.fixture(scope="module")
def inputs(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Inputs:
    from kvcal.cli import app

    root = tmp_path_factory.mktemp("fault-inputs")

    def run(args: list[str]) -> None:
        from typer.testing import CliRunner

        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, (args, result.output)

    model = tiny_llama_dir
    scales = root / "s.safetensors"
    run(["calibrate", str(model), "-f", "fp8", "--num-samples", "2", "--seq-len", "16", "-o", str(scales)])
    plan, damage = root / "p.plan.json", root / "damage.json"
    run(["plan", str(model), "--candidates", "bf16,fp8_e4m3", "--capacity", "1.5x", *SMALL_PLAN,
         "--checkpoint", str(damage), "-o", str(plan)])  # fmt: skip
    for fmt in ("bf16", "fp8_e4m3"):
        run(["eval", str(model), "-f", fmt, "--tasks", "kl", "--limit", "2", "--kl-seq-len", "16",
             "-o", str(root / "runs" / fmt)])  # fmt: skip
    traffic = root / "traffic.txt"
    traffic.write_text("the cat sat on the mat\nthe dog sat on the log\n" * 8)
    sweep = {"model": str(model), "tasks": ["kl"], "formats": ["fp8_e4m3"], "scales": ["uncalibrated"],
             "limit": 2, "kl_seq_len": 16, "calibration": {"num_samples": 2, "seq_len": 16}}  # fmt: skip
    release = {
        "ship": {"kv_format": "fp8_e4m3", "granularity": "tensor"},
        "calibration": {"num_samples": 4, "seq_len": 32},
        "evaluate": {"tasks": ["kl"], "limit": 12, "kl_seq_len": 32, "dtype": "float32", "impl": "torch"},
        "gate": {"min_samples": 5, "bootstrap": 400},
        "export": {"engines": ["vllm"]},
    }
    release_out = root / "release"
    (root / "release.yaml").write_text(yaml.safe_dump(release))
    from typer.testing import CliRunner

    result = CliRunner().invoke(app, ["release", str(model), "-c", str(root / "release.yaml"), "-o", str(release_out)])
    assert result.exit_code in (0, 1) and (release_out / "release.json").is_file(), result.output
    return Inputs(model, scales, plan, damage, root / "runs", traffic, sweep, release, release_out)


# ---- malformations of one file ---------------------------------------------------------------------------------


def _first_number_to_nan(obj: Any) -> bool:
    """Replace the first number found (depth first) by NaN in place; False when there is none."""
    items = list(obj.items()) if isinstance(obj, dict) else list(enumerate(obj)) if isinstance(obj, list) else []
    for k, v in items:
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            obj[k] = math.nan
            return True
        if isinstance(v, (dict, list)) and _first_number_to_nan(v):
            return True
    return False


def malformed_bytes(kind: str, valid: bytes, fmt: str) -> bytes | None:
    """`valid` (a JSON, YAML or safetensors file's bytes) broken one way; None: the file is removed (missing)."""
    if kind == "missing":
        return None
    if kind == "empty":
        return b""
    if kind == "truncated":
        return valid[: max(1, len(valid) // 2)]
    if kind == "wrong_type":  # the top level a list (a list of the mapping's keys)
        return b"[1, 2, 3]\n" if fmt != "yaml" else b"- 1\n- 2\n"
    if kind == "binary":
        return bytes(range(256)) * 4
    raise AssertionError(kind)


def write_malformed(path: Path, kind: str, valid: bytes, fmt: str) -> None:
    data = malformed_bytes(kind, valid, fmt)
    if data is not None:
        path.write_bytes(data)


FILE_KINDS = ("missing", "empty", "truncated", "wrong_type", "binary")


def nan_scale_file(src: Path, dst: Path) -> None:
    """A scale file whose first K scale is NaN (the header and every other value as kvcal wrote them)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k).clone() for k in f.keys()}
    name = sorted(k for k in tensors if "k_scale" in k or k.startswith("k"))[0]
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, str(dst), metadata=meta)


# ---- the cases ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    command: str  # as in `kvcal --help` (models subcommands: "models path")
    kind: str  # the malformation
    build: Callable[[Inputs, Path], list[str]]  # (inputs, work folder) -> argv; writes its malformed files in work
    says: str = ""  # what the one Error: line must name (the option refused), where the cause is the point


def _scale_case(command: str, kind: str) -> Case:
    def build(i: Inputs, w: Path) -> list[str]:
        bad = w / "bad.safetensors"
        if kind == "nan":
            nan_scale_file(i.scales, bad)
        else:
            write_malformed(bad, kind, i.scales.read_bytes(), "safetensors")
        return {
            "show": ["show", str(bad)],
            "verify": ["verify", str(bad), str(i.model)],
            "export": ["export", str(bad), str(i.model), "--to", "vllm", "-o", str(w / "previous-export")],
            "drift": ["drift", str(bad), str(i.model), "--dataset", str(i.traffic), "--num-samples", "2"],
            "eval": ["eval", str(i.model), "-f", "fp8", "--scales", str(bad), "--tasks", "kl", "-o", str(w / "run")],
            "plan": ["plan", str(i.model), "--candidates", "bf16,fp8_e4m3", "--capacity", "1.5x", "--scales",
                     str(bad), *SMALL_PLAN, "-o", str(w / "previous.plan.json")],
            "probe": ["probe", str(bad), str(i.model), "--num-prompts", "1", "--seq-len", "16",
                      "-o", str(w / "previous.txt")],
        }[command]  # fmt: skip

    return Case(command, f"scales-{kind}", build)


def _json_case(command: str, what: str, kind: str) -> Case:
    def build(i: Inputs, w: Path) -> list[str]:
        src = {"plan": i.plan, "damage": i.damage}[what]
        bad = w / f"bad-{src.name}"
        if kind == "nan":
            doc = json.loads(src.read_text())
            assert _first_number_to_nan(doc["per_sample"] if what == "damage" else doc["layers"] or doc)
            bad.write_text(json.dumps(doc))
        elif kind == "shape":  # well-formed JSON, wrong contents: one layer too few / rows of another length
            doc = json.loads(src.read_text())
            if what == "damage":
                doc["per_sample"] = [s[:-1] for s in doc["per_sample"]]
            else:
                doc["layers"] = doc["layers"][:-1]
            bad.write_text(json.dumps(doc))
        elif kind == "wrong_contents":  # the right keys with values of the wrong type
            doc = json.loads(src.read_text())
            if what == "damage":
                doc["per_sample"] = [["x"]]
            else:
                doc["layers"] = [{"layer": "zero", "k": 1, "v": None}]
            bad.write_text(json.dumps(doc))
        else:
            write_malformed(bad, kind, src.read_bytes(), "json")
        if what == "damage":
            return ["plan", str(i.model), "--candidates", "bf16,fp8_e4m3", "--capacity", "1.5x", *SMALL_PLAN,
                    "--checkpoint", str(bad), "-o", str(w / "previous.plan.json")]  # fmt: skip
        return {
            "plan-export": ["plan-export", str(bad), "--engine", "vllm-modelopt", "-o", str(w / "previous.txt")],
            "eval": ["eval", str(i.model), "-f", str(bad), "--tasks", "kl", "-o", str(w / "run")],
            "capacity": ["capacity", str(i.model), "-f", str(bad)],
        }[command]

    return Case(command, f"{what}-{kind}", build)


def _yaml_case(command: str, kind: str) -> Case:
    def build(i: Inputs, w: Path) -> list[str]:
        raw = json.loads(json.dumps(i.release if command == "release" else i.sweep))
        bad = w / "bad.yaml"
        sect = raw["evaluate"] if command == "release" else raw
        if kind == "unknown_key":
            sect["batch_sise"] = 2
        elif kind == "nan":
            sect["limit"] = math.nan
        elif kind == "out_of_range":
            sect["batch_size"] = 0
        elif kind == "wrong_value_type":
            sect["kl_seq_len"] = "long"
        elif kind == "negative":
            sect["repeats"] = -1
        else:
            write_malformed(bad, kind, yaml.safe_dump(raw).encode(), "yaml")
        if not bad.exists() and kind not in FILE_KINDS:
            bad.write_text(yaml.safe_dump(raw))
        if command == "release":  # onto a finished release: it must survive
            out = w / "previous-release"
            shutil.copytree(i.release_out, out)
            return ["release", str(i.model), "-c", str(bad), "-o", str(out)]
        return ["sweep", str(bad), "-o", str(w / "sweep-runs")]

    return Case(command, f"yaml-{kind}", build)


def _run_dir_case(kind: str) -> Case:
    def build(i: Inputs, w: Path) -> list[str]:
        runs = w / "runs"
        shutil.copytree(i.runs, runs)
        target = {"config": runs / "fp8_e4m3" / "config.yaml",
                  "samples": runs / "fp8_e4m3" / "samples_kl.jsonl"}[kind.split("-")[0]]  # fmt: skip
        how = kind.split("-", 1)[1]
        if how == "nan" and target.suffix == ".yaml":
            doc = yaml.safe_load(target.read_text())
            doc["limit"] = math.nan
            target.write_text(yaml.safe_dump(doc))
        elif how == "nan":
            rows = [json.loads(x) for x in target.read_text().splitlines() if x.strip()]
            for r in rows:
                _first_number_to_nan(r)
            target.write_text("".join(json.dumps(r) + "\n" for r in rows))
        else:
            write_malformed(target, how, target.read_bytes(), "yaml" if target.suffix == ".yaml" else "json")
            if how == "missing":
                target.unlink()
        return ["compare", str(runs / "bf16"), str(runs / "fp8_e4m3"), "-o", str(w / "previous-report.md")]

    return Case("compare", f"run-{kind}", build)


def _option_case(command: str, kind: str, args: Callable[[Inputs, Path], list[str]], says: str = "") -> Case:
    return Case(command, kind, args, says)


def _ro_out(w: Path) -> Path:
    """An output path no one can write: a file stands where its folder should be."""
    blocker = w / "not-a-folder"
    blocker.write_text("x")
    return blocker / "out"


def _traffic_case(kind: str) -> Case:
    def build(i: Inputs, w: Path) -> list[str]:
        bad = w / "traffic.txt"
        write_malformed(bad, kind, i.traffic.read_bytes(), "text")
        return ["drift", str(i.scales), str(i.model), "--dataset", str(bad), "--num-samples", "2"]

    return Case("drift", f"traffic-{kind}", build)


def _model_case(command: str, kind: str) -> Case:
    """The model folder broken: missing, or its config.json truncated / the wrong type / NaN sizes."""

    def build(i: Inputs, w: Path) -> list[str]:
        m = w / "model"
        if kind != "missing":
            shutil.copytree(i.model, m)
            cfg = m / "config.json"
            if kind == "config-nan":
                doc = json.loads(cfg.read_text())
                doc["num_hidden_layers"] = math.nan
                cfg.write_text(json.dumps(doc))
            elif kind == "config-negative":
                doc = json.loads(cfg.read_text())
                doc["num_key_value_heads"] = -2
                cfg.write_text(json.dumps(doc))
            else:
                write_malformed(cfg, kind.split("-", 1)[1], cfg.read_bytes(), "json")
        out = w / "out"
        return {
            "capacity": ["capacity", str(m), "-f", "fp8"],
            "calibrate": ["calibrate", str(m), "-f", "fp8", "-o", str(out / "s.safetensors")],
            "sensitivity": ["sensitivity", str(m), "-f", "fp8", "--num-samples", "2", "--seq-len", "16"],
            "plan": ["plan", str(m), "--capacity", "1.5x", *SMALL_PLAN, "-o", str(out / "p.json")],
            "verify": ["verify", str(i.scales), str(m)],
            "export": ["export", str(i.scales), str(m), "--to", "sglang", "-o", str(out / "s.json")],
            "drift": ["drift", str(i.scales), str(m), "--dataset", str(i.traffic)],
            "eval": ["eval", str(m), "-f", "fp8", "--tasks", "kl", "-o", str(out / "run")],
            "release": ["release", str(m), "-c", str(_release_yaml(i, w)), "-o", str(out / "release")],
            "probe": ["probe", str(i.scales), str(m), "-o", str(out / "probe.json")],
        }[command]

    return Case(command, f"model-{kind}", build)


def _release_yaml(i: Inputs, w: Path) -> Path:
    p = w / "release.yaml"
    p.write_text(yaml.safe_dump(i.release))
    return p


MODEL_COMMANDS = ("capacity", "calibrate", "sensitivity", "plan", "verify", "export", "drift", "eval", "release",
                  "probe")
MODEL_KINDS = ("missing", "config-truncated", "config-wrong_type", "config-nan", "config-negative")

CASES: list[Case] = [
    *[_model_case(c, k) for c in MODEL_COMMANDS for k in MODEL_KINDS],
    *[_scale_case(c, k) for c in ("show", "verify", "export", "drift", "eval", "plan", "probe")
      for k in (*FILE_KINDS, "nan")],
    *[_json_case(c, "plan", k) for c in ("plan-export", "eval", "capacity")
      for k in (*FILE_KINDS, "nan", "shape", "wrong_contents")],
    *[_json_case("plan", "damage", k) for k in ("empty", "truncated", "wrong_type", "binary", "nan", "shape",
                                                 "wrong_contents")],
    *[_yaml_case(c, k) for c in ("release", "sweep")
      for k in (*FILE_KINDS, "unknown_key", "nan", "out_of_range", "wrong_value_type", "negative")],
    *[_run_dir_case(f"{f}-{k}") for f in ("config", "samples") for k in (*FILE_KINDS, "nan")],
    *[_traffic_case(k) for k in ("missing", "empty", "binary")],
    # out-of-range numbers and values one command took silently, on the command line
    _option_case("capacity", "option-context-0", lambda i, w: ["capacity", str(i.model), "--context", "0"]),
    _option_case("capacity", "option-gpu-mem-nan", lambda i, w: ["capacity", str(i.model), "--gpu-mem-gib", "nan"], says="--gpu-mem-gib"),
    _option_case("calibrate", "option-num-samples-0", lambda i, w: [
        "calibrate", str(i.model), "-f", "fp8", "--num-samples", "0", "-o", str(w / "s.safetensors")]),
    _option_case("calibrate", "option-percentile-nan", lambda i, w: [
        "calibrate", str(i.model), "-f", "fp8", "--observer", "percentile", "--percentile", "nan",
        "-o", str(w / "s.safetensors")], says="--percentile"),
    _option_case("calibrate", "option-percentile-unused", lambda i, w: [
        "calibrate", str(i.model), "-f", "fp8", "--percentile", "99", "--num-samples", "2", "--seq-len", "16",
        "-o", str(w / "s.safetensors")], says="--percentile"),
    _option_case("calibrate", "output-unwritable", lambda i, w: [
        "calibrate", str(i.model), "-f", "fp8", "-o", str(_ro_out(w))]),
    _option_case("sensitivity", "option-factor-nan", lambda i, w: [
        "sensitivity", str(i.model), "-f", "fp8", "--factor", "nan"], says="--factor"),
    _option_case("sensitivity", "option-seq-len-1", lambda i, w: [
        "sensitivity", str(i.model), "-f", "fp8", "--seq-len", "1"], says="--seq-len"),
    _option_case("plan", "option-frontier-step-nan", lambda i, w: [
        "plan", str(i.model), "--capacity", "1.5x", "--frontier", "--frontier-step", "nan"], says="--frontier-step"),
    _option_case("plan", "option-effective-bits-nan", lambda i, w: [
        "plan", str(i.model), "--effective-bits", "nan"], says="--effective-bits"),
    _option_case("plan", "output-unwritable", lambda i, w: [
        "plan", str(i.model), "--capacity", "1.5x", "-o", str(_ro_out(w))]),
    _option_case("plan-export", "option-engine-unknown", lambda i, w: [
        "plan-export", str(i.plan), "--engine", "tgi"]),
    _option_case("plan-export", "output-unwritable", lambda i, w: [
        "plan-export", str(i.plan), "--engine", "vllm-modelopt", "-o", str(_ro_out(w))]),
    _option_case("plan-export", "option-output-unused", lambda i, w: [
        "plan-export", str(i.plan), "--engine", "trtllm", "-o", str(w / "trtllm.txt")], says="-o"),
    _option_case("export", "option-tp-size-0", lambda i, w: [
        "export", str(i.scales), str(i.model), "--to", "sglang", "--tp-size", "0", "-o", str(w / "s.json")], says="--tp-size"),
    _option_case("export", "option-tp-size-unused", lambda i, w: [
        "export", str(i.scales), str(i.model), "--to", "vllm", "--tp-size", "2", "-o", str(w / "v")], says="--tp-size"),
    _option_case("export", "output-unwritable", lambda i, w: [
        "export", str(i.scales), str(i.model), "--to", "sglang", "-o", str(_ro_out(w))]),
    _option_case("drift", "option-max-clip-nan", lambda i, w: [
        "drift", str(i.scales), str(i.model), "--dataset", str(i.traffic), "--max-clip", "nan"], says="--max-clip"),
    _option_case("drift", "option-num-samples-0", lambda i, w: [
        "drift", str(i.scales), str(i.model), "--dataset", str(i.traffic), "--num-samples", "0"]),
    _option_case("eval", "option-limit-0", lambda i, w: [
        "eval", str(i.model), "-f", "fp8", "--tasks", "kl", "--limit", "0", "-o", str(w / "run")]),
    _option_case("eval", "option-gen-kwargs-nan", lambda i, w: [
        "eval", str(i.model), "-f", "fp8", "--tasks", "kl", "--gen-kwargs", "temperature=nan", "-o", str(w / "r")], says="temperature"),
    _option_case("eval", "option-repeats-on-kl", lambda i, w: [
        "eval", str(i.model), "-f", "fp8", "--tasks", "kl", "--repeats", "4", "-o", str(w / "run")], says="repeats"),
    _option_case("eval", "option-kl-seq-len-unused", lambda i, w: [
        "eval", str(i.model), "-f", "fp8", "--tasks", "wikitext", "--kl-seq-len", "64", "-o", str(w / "run")],
        says="--kl-seq-len"),
    _option_case("eval", "option-passkey-lengths-unused", lambda i, w: [
        "eval", str(i.model), "-f", "fp8", "--tasks", "kl", "--passkey-lengths", "1k", "-o", str(w / "run")],
        says="--passkey-lengths"),
    _option_case("eval", "option-tq-boundary-unused", lambda i, w: [
        "eval", str(i.model), "-f", "fp8", "--tasks", "kl", "--tq-boundary-layers", "0", "-o", str(w / "run")],
        says="--tq-boundary-layers"),
    _option_case("eval", "option-gen-kwargs-unused", lambda i, w: [
        "eval", str(i.model), "-f", "fp8", "--tasks", "kl", "--gen-kwargs", "temperature=0.5", "-o", str(w / "run")],
        says="--gen-kwargs"),
    _option_case("eval", "option-task-unknown", lambda i, w: [
        "eval", str(i.model), "-f", "fp8", "--tasks", "no_such_task", "-o", str(w / "run")]),
    _option_case("eval", "output-unwritable", lambda i, w: [
        "eval", str(i.model), "-f", "fp8", "--tasks", "kl", "-o", str(_ro_out(w))]),
    _option_case("sweep", "option-shard-0", lambda i, w: [
        "sweep", str(_yaml(w, i.sweep)), "--shard", "0/2", "-o", str(w / "runs")]),
    _option_case("sweep", "output-unwritable", lambda i, w: [
        "sweep", str(_yaml(w, i.sweep)), "-o", str(_ro_out(w))]),
    _option_case("compare", "option-gate-unknown", lambda i, w: [
        "compare", str(i.runs / "bf16"), str(i.runs / "fp8_e4m3"), "--gate", "lenient"]),
    _option_case("compare", "output-unwritable", lambda i, w: [
        "compare", str(i.runs / "bf16"), str(i.runs / "fp8_e4m3"), "-o", str(_ro_out(w))]),
    _option_case("release", "option-context-0", lambda i, w: [
        "release", str(i.model), "-c", str(_release_yaml(i, w)), "--context", "0", "-o", str(w / "rel")]),
    _option_case("release", "output-unwritable", lambda i, w: [
        "release", str(i.model), "-c", str(_release_yaml(i, w)), "-o", str(_ro_out(w))]),
    _option_case("probe", "option-factor-nan", lambda i, w: [
        "probe", str(i.scales), str(i.model), "--factor", "nan"], says="--factor"),
    _option_case("probe", "option-num-prompts-0", lambda i, w: [
        "probe", str(i.scales), str(i.model), "--num-prompts", "0"], says="--num-prompts"),
    _option_case("probe", "output-unwritable", lambda i, w: [
        "probe", str(i.scales), str(i.model), "-o", str(_ro_out(w))]),
    _option_case("formats", "release-unknown", lambda i, w: ["formats", "--engine-release", "0.31.0"],
                 says="0.31.0"),
    _option_case("formats", "release-empty", lambda i, w: ["formats", "--engine-release", ""]),
    _option_case("models list", "option-unknown", lambda i, w: ["models", "list", "--all"]),
    _option_case("models install", "name-unknown", lambda i, w: ["models", "install", "llama-70b"]),
    _option_case("models path", "name-unknown", lambda i, w: ["models", "path", "llama-70b"]),
    _option_case("show", "not-a-scale-file", lambda i, w: ["show", str(i.plan)]),
]


def _yaml(w: Path, raw: dict[str, Any]) -> Path:
    p = w / "config.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


def _snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every path under `folder` with its bytes (None: a folder)."""
    return {
        str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None)
        for p in sorted(folder.rglob("*"))
    }


def _previous_outputs(i: Inputs, w: Path) -> None:
    """Earlier outputs at the paths the cases write to: each must survive a failing run byte for byte."""
    (w / "previous.plan.json").write_bytes(i.plan.read_bytes())
    (w / "previous.txt").write_text("an earlier export\n")
    (w / "previous-report.md").write_text("# an earlier report\n")
    shutil.copytree(i.scales.parent / "runs" / "bf16", w / "previous-export")


def _invoke_any(invoke: Invoke, args: list[str]) -> tuple[int, str, str]:
    """`invoke`, with an exception escaping kvcal's app reported as the traceback a user would see."""
    import traceback

    try:
        return invoke(args)
    except BaseException as exc:  # noqa: BLE001 - any escape is the failure under test
        if isinstance(exc, KeyboardInterrupt):
            raise
        return 99, "", "Traceback (most recent call last):\n" + "".join(traceback.format_exception(exc))


def _keeps_the_promise(code: int, err: str) -> None:
    assert "Traceback" not in err, err[-3000:]
    assert code in (1, 2), (code, err[-2000:])
    errors = [ln for ln in err.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1, err[-2000:]


@pytest.mark.parametrize("case", CASES, ids=[f"{c.command.replace(' ', '-')}:{c.kind}" for c in CASES])
def test_every_malformation_keeps_the_promise(
    case: Case, inputs: Inputs, tmp_path: Path, invoke: Invoke, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    _previous_outputs(inputs, work)
    args = case.build(inputs, work)
    before = _snapshot(work)
    code, _, err = _invoke_any(invoke, args)
    _keeps_the_promise(code, err)
    assert case.says in next(ln for ln in err.splitlines() if ln.startswith("Error:")), err[-1000:]
    after = _snapshot(work)
    assert sorted(set(after) - set(before)) == [], "left behind"  # nothing new, no temporary file
    changed = sorted(k for k in before if after.get(k, b"gone") != before[k])
    assert changed == [], "a previous output changed or vanished"


def test_every_command_of_the_help_is_covered() -> None:
    """The suite covers every command `kvcal --help` lists (and the models group's subcommands)."""
    from kvcal.cli import app, models_app

    names = {c.name for c in app.registered_commands} | {f"models {c.name}" for c in models_app.registered_commands}
    assert names == {c.command for c in CASES}


def count() -> tuple[int, int, int]:
    """(commands, malformations, cases) of this suite: what docs/trustworthy-numbers.md states."""
    return len({c.command for c in CASES}), len({c.kind for c in CASES}), len(CASES)


def test_the_count_in_the_docs() -> None:
    commands, kinds, cases = count()
    doc = " ".join((REPO / "docs" / "trustworthy-numbers.md").read_text().split())
    assert f"{cases} cases ({commands} commands, {kinds} kinds of malformation" in doc, count()


# ---- SIGINT mid-write ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_sigint_mid_write_leaves_no_part(inputs: Inputs, tmp_path: Path) -> None:
    """Ctrl-C while `kvcal calibrate` runs (a real process, SIGINT at a random moment of its run): exit 1 or 2 or
    130 (or killed by the signal while the interpreter shuts down), at most one `Error:` line, no traceback; the output is the previous file byte for byte or a whole new
    one, and no temporary file is left beside it."""
    out = tmp_path / "s.safetensors"
    out.write_bytes(inputs.scales.read_bytes())
    previous = out.read_bytes()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("KVCAL_DEBUG", None)
    import threading

    for delay in (0.0, 0.5, 1.5):  # after kvcal has started its work (Python's own import is not kvcal's)
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvcal.cli", "calibrate", str(inputs.model), "-f", "fp8", "--num-samples", "64",
             "--seq-len", "64", "-o", str(out)],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        lines: list[str] = []
        reader = threading.Thread(target=lambda p=proc, got=lines: got.extend(iter(p.stderr.readline, "")), daemon=True)
        reader.start()
        deadline = time.monotonic() + 300
        while proc.poll() is None and not any("Loading weights" in ln for ln in lines) and time.monotonic() < deadline:
            time.sleep(0.05)  # the model is loading: kvcal's command runs
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=300)
        reader.join(timeout=10)
        err = "".join(lines)
        # after the command's work, SIGINT may land in a library's exit hook (torch's dump_compile_times): Python
        # reports that as "Exception ignored in atexit callback"; the command itself raised nothing
        ours = err.split("Exception ignored in atexit callback")[0]
        assert "Traceback" not in ours, err[-3000:]
        assert sum(ln.startswith("Error:") for ln in err.splitlines()) <= 1, err[-2000:]
        # 1: click's Abort; -SIGINT: the signal came after the command's work, while the interpreter shut down
        # (what a shell reports as 130), so the output may be whole and new then
        assert proc.returncode in (0, 1, 2, 130, -signal.SIGINT), (proc.returncode, err[-2000:])
        if out.read_bytes() != previous:  # a new file: the interrupt came after the atomic rename, or never
            from kvcal.scales import load_scale_file

            load_scale_file(out)  # a whole new file
            previous = out.read_bytes()
        assert [p.name for p in tmp_path.iterdir()] == [out.name], list(tmp_path.iterdir())
