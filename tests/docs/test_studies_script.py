"""scripts/studies.py (`make studies`) on tiny run directories written in the run-directory contract: the page
holds compare's numbers, each row names the command of its run, and a run that is missing, incomplete or made by
another command is one `Error:` line."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import yaml

from kvcal.report.compare import compare_runs
from kvcal.rundir import COMPLETE, CONFIG, METRICS, RESULTS, RunConfig, samples_file

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def studies() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvcal_scripts_studies", REPO / "scripts" / "studies.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _kl_run(d: Path, kv_format: str, kl: np.ndarray, limit: int = 12, seq_len: int = 64) -> None:
    """A complete kl run directory as `kvcal eval` writes it (12 windows; samples: {doc_id, kl, top1_agree, ...})."""
    d.mkdir(parents=True)
    cfg = RunConfig(model="tiny", model_dir="/nonexistent/tiny", kv_format=kv_format, tasks=["kl"], limit=limit,
                    kl_seq_len=seq_len)  # fmt: skip
    (d / CONFIG).write_text(yaml.safe_dump(cfg.to_dict()))
    recs = [
        {"doc_id": i, "kl": float(k), "top1_agree": 1.0, "nll": 3.0, "n_tokens": seq_len}
        for i, k in enumerate(kl)
    ]
    (d / samples_file("kl")).write_text("".join(json.dumps(r) + "\n" for r in recs))
    (d / RESULTS).write_text(json.dumps({"results": {"kl": {"alias": "kl"}}, "configs": {}, "n-shot": {},
                                         "versions": {}, "n-samples": {}, "max_length": 2048}))  # fmt: skip
    (d / METRICS).write_text(json.dumps({"tokens_per_s": 1.0, "capacity_multiplier_vs_bf16": 1.0}))
    (d / "env.json").write_text(json.dumps({"kvcal_version": "0.1.0", "kvcal_git_revision": "abcdef0123",
                                            "device": "cpu", "processor": "x86_64", "torch_threads": 2,
                                            "versions": {"torch": "2.13.0+cpu"}}))  # fmt: skip
    (d / COMPLETE).write_text("{}")


CMD = "kvcal eval tiny --kv-format {fmt} --tasks kl --limit 12 --kl-seq-len 64 -o {{root}}/runs/{name}"


def _manifest(tmp_path: Path, root: Path, extra: dict | None = None) -> Path:
    study = {
        "title": "Tiny study",
        "about": "Two configurations.",
        "root": str(root),
        "runs": [
            {"name": "bf16", "command": CMD.format(fmt="bf16", name="bf16")},
            {"name": "fp8", "command": CMD.format(fmt="fp8", name="fp8")},
        ],  # fmt: skip
        "compare": {"baseline": "bf16"},
        **(extra or {}),
    }
    m = tmp_path / "manifest.yaml"
    m.write_text(yaml.safe_dump({"studies": {"tiny": study}}))
    return m


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    root = tmp_path / "study"
    _kl_run(root / "runs" / "bf16", "bf16", np.zeros(12))
    _kl_run(root / "runs" / "fp8", "fp8_e4m3", rng.uniform(0.004, 0.006, 12))
    return root


def test_page_holds_compares_numbers_and_each_rows_command(studies: ModuleType, runs: Path, tmp_path: Path):
    out = tmp_path / "pages"
    assert studies.main(["tiny", "--manifest", str(_manifest(tmp_path, runs)), "--out", str(out)]) == 0
    page = (out / "tiny.md").read_text()
    cmp = compare_runs([runs / "runs" / "bf16", runs / "runs" / "fp8"], baseline="bf16")
    kl = next(r for r in cmp.results if r.label == "kl")
    # the score and the interval, exactly as kvcal compare's numbers format them, on the row of run R2
    row = next(line for line in page.splitlines() if line.startswith("| `fp8` | R2 | ") and "±" in line)
    assert f"{kl.score:.4g} ± {kl.score_se:.2g}" in row and f"{kl.ci_low:+.4g}, {kl.ci_high:+.4g}" in row
    # R2's command, with the study's root, and the compare command of every difference
    assert (
        f"| R2 | `fp8` | `kvcal eval tiny --kv-format fp8 --tasks kl --limit 12 --kl-seq-len 64 -o {runs}/runs/fp8` |"
        in page
    )
    assert f"`kvcal compare {runs}/runs/bf16 {runs}/runs/fp8 --baseline bf16 --json`" in page
    assert "commit `abcdef0`" in page
    # regenerated from the same runs: up to date
    assert studies.main(["--manifest", str(_manifest(tmp_path, runs)), "--out", str(out), "--check"]) == 0
    (out / "tiny.md").write_text(page.replace("R2", "R9"))
    assert studies.main(["--manifest", str(_manifest(tmp_path, runs)), "--out", str(out), "--check"]) == 1


def test_root_override_keeps_the_manifests_commands(studies: ModuleType, runs: Path, tmp_path: Path):
    out = tmp_path / "pages"
    m = _manifest(tmp_path, Path("somewhere-else"))
    assert studies.main(["--manifest", str(m), "--out", str(out), "--root", f"tiny={runs}"]) == 0
    assert "-o somewhere-else/runs/fp8`" in (out / "tiny.md").read_text()


def test_missing_or_foreign_runs_are_one_error_line(studies: ModuleType, runs: Path, tmp_path: Path, capsys):
    m = _manifest(tmp_path, runs)
    (runs / "runs" / "fp8" / COMPLETE).unlink()
    assert studies.main(["tiny", "--manifest", str(m), "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("Error: study tiny: run directories missing or incomplete") and "\n" not in err
    # every study (make studies): the ones whose runs are not here are skipped, said on stderr
    assert studies.main(["--manifest", str(m), "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().err.startswith("skipped: study tiny: run directories missing")
    assert not (tmp_path / "tiny.md").exists()
    (runs / "runs" / "fp8" / COMPLETE).write_text("{}")
    cfg = yaml.safe_load((runs / "runs" / "fp8" / CONFIG).read_text())
    (runs / "runs" / "fp8" / CONFIG).write_text(yaml.safe_dump({**cfg, "limit": 4}))
    assert studies.main(["--manifest", str(m), "--out", str(tmp_path)]) == 1
    assert "records limit 4 (command: '12')" in capsys.readouterr().err


def test_bad_manifest_is_a_usage_error(studies: ModuleType, runs: Path, tmp_path: Path, capsys):
    assert studies.main(["--manifest", str(_manifest(tmp_path, runs, {"colour": "red"}))]) == 2
    assert "unknown key(s) colour" in capsys.readouterr().err
    assert studies.main(["--manifest", str(_manifest(tmp_path, runs)), "--root", "other=/x"]) == 2


def test_the_repositorys_manifest_loads(studies: ModuleType):
    manifest = studies.load_manifest(studies.MANIFEST)
    assert "demo" in manifest
    for study in manifest.values():  # every run directory is named after its run
        assert all(Path(studies.output_of(r.command)).name == r.name for r in study.runs)


def test_conformance_and_gate_keys(studies: ModuleType, runs: Path, tmp_path: Path):
    """`compare: {gate: noninferiority, conformance: [ENGINE=EMULATION], conformance_bf16: [...]}`: the page has
    compare's engine-vs-emulation rows (naming both runs) and verdicts, and the gate's mode; the compare command
    carries them."""
    rng = np.random.default_rng(1)
    emu = rng.uniform(0.004, 0.006, 12)
    _kl_run(runs / "runs" / "emu", "fp8_e4m3", emu)
    _kl_run(runs / "runs" / "engine", "fp8_e4m3", emu * 1.5)
    _kl_run(runs / "runs" / "engine_bf16", "bf16", np.zeros(12))
    extra_runs = [{"name": n, "command": CMD.format(fmt="fp8", name=n)} for n in ("emu", "engine")]
    extra_runs.append({"name": "engine_bf16", "command": CMD.format(fmt="bf16", name="engine_bf16")})
    m = _manifest(tmp_path, runs, {"compare": {"baseline": "bf16", "gate": "noninferiority",
                                               "conformance": ["engine=emu"],
                                               "conformance_bf16": ["engine_bf16=bf16"], "margin": 0.0001}})  # fmt: skip
    raw = yaml.safe_load(m.read_text())
    raw["studies"]["tiny"]["runs"] += extra_runs
    m.write_text(yaml.safe_dump(raw))
    out = tmp_path / "pages"
    assert studies.main(["tiny", "--manifest", str(m), "--out", str(out)]) == 0
    page = (out / "tiny.md").read_text()
    # the manifest's keys, as YAML wrote them
    assert "--conformance engine=emu --conformance-bf16 engine_bf16=bf16 --gate noninferiority --margin 0.0001 --json`" in page
    assert "gate noninferiority: FAILED (" in page and "1 engine run(s) not equivalent to their emulation" in page
    assert "## Engine vs emulation" in page
    row = next(line for line in page.splitlines() if line.startswith("| `engine` | R4 vs R3 | `emu` |"))
    assert "| kl | kl | 12 | 0.0% |" in row and row.endswith("| not equivalent |")
    assert "- `engine` (NOT EQUIVALENT): not equivalent" in page


def test_an_engine_run_is_its_printed_lm_eval_command(studies: ModuleType, runs: Path, tmp_path: Path, capsys):
    """A run made by the engine command kvcal prints (`kvcal-lm-eval --model vllm ... --output_path DIR`): the
    manifest takes it, its folder counts as made once lm-eval's results file is there (P/<model>/results_*.json),
    and it is run with this environment's `kvcal-lm-eval` console script, never a shell."""
    cmd = ("kvcal-lm-eval --model vllm --model_args '{\"pretrained\":\"{root}/ckpt\",\"kv_cache_dtype\":\"fp8\"}' "
           "--tasks wikitext --log_samples --output_path {root}/runs/engine-fp8")  # fmt: skip
    m = _manifest(tmp_path, runs)
    raw = yaml.safe_load(m.read_text())
    raw["studies"]["tiny"]["runs"].append({"name": "engine-fp8", "command": cmd})
    m.write_text(yaml.safe_dump(raw))
    study = studies.load_manifest(m)["tiny"]
    spec = study.runs[-1]
    assert spec.engine and not study.runs[0].engine
    assert studies.run_dir(spec, runs) == runs / "runs" / "engine-fp8"
    argv = studies._kvcal_argv(studies.with_root(cmd, str(runs)))
    assert Path(argv[0]).name == "kvcal-lm-eval" and argv[4] == f'{{"pretrained":"{runs}/ckpt","kv_cache_dtype":"fp8"}}'
    assert studies.main(["tiny", "--manifest", str(m), "--out", str(tmp_path)]) == 1
    assert "run directories missing or incomplete: " + str(runs / "runs" / "engine-fp8") in capsys.readouterr().err
    model = runs / "runs" / "engine-fp8" / "ckpt"
    model.mkdir(parents=True)
    assert not studies._complete(spec, runs / "runs" / "engine-fp8")  # lm-eval has not written its results
    (model / "results_2026-12-07T14-46-51.739186.json").write_text("{}")
    assert studies._complete(spec, runs / "runs" / "engine-fp8")
    assert studies.check_runs(study, runs)[-1] == runs / "runs" / "engine-fp8"
    bad = dict(raw)
    bad["studies"]["tiny"]["runs"][-1] = {"name": "engine-fp8", "command": "lm_eval --model vllm --output_path x/engine-fp8"}
    m.write_text(yaml.safe_dump(bad))
    assert studies.main(["tiny", "--manifest", str(m), "--out", str(tmp_path)]) == 2
    assert "must be `kvcal eval ...` or `kvcal-lm-eval ...`" in capsys.readouterr().err


def test_a_model_placeholder_is_resolved_where_the_command_runs(studies: ModuleType, real_model_path) -> None:
    """`{model:NAME}` in a manifest command (an engine run on the unexported model, whose folder differs per
    machine) becomes `kvcal models path NAME`'s folder when the command runs; the page keeps the placeholder."""
    from kvcal.errors import UsageError
    from kvcal.models.resolve import resolve_model

    folder = str(resolve_model(real_model_path("smollm2")))
    cmd = 'kvcal-lm-eval --model vllm --model_args \'{"pretrained":"{model:smollm2}"}\' --output_path {root}/runs/e'
    ran = studies.with_models(studies.with_root(cmd, "/r"))
    assert ran == f'kvcal-lm-eval --model vllm --model_args \'{{"pretrained":"{folder}"}}\' --output_path /r/runs/e'
    assert "{model:smollm2}" in studies.with_root(cmd, "/r")  # what the page shows
    with pytest.raises(UsageError, match="unknown real model 'nope'"):
        studies.with_models("{model:nope}")
