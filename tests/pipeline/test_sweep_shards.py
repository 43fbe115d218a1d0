"""kvcal sweep --shard I/N and --report-only: disjoint slices, a lock per cell and scale file on one shared run
store (no cell twice, none lost when a process dies), and the report of a sharded sweep equal to one process's."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from kvcal.cli import app
from kvcal.errors import UsageError
from kvcal.io import file_lock
from kvcal.pipeline import sweep
from kvcal.rundir import COMPLETE, CONFIG, RunConfig

ROOT = Path(__file__).resolve().parents[2]
STUDY = {
    "model": "/models/gemma-3-270m",
    "tasks": ["wikitext", "gsm8k"],
    "formats": ["fp8", "nvfp4", "fp4_e2m1", "int8_per_token_head"],
    "scales": ["uncalibrated", "tensor"],
    "skip_layers": ["none", "sliding_window"],
    "limit": 8,
}
CORPUS = [
    "the cat sat on the mat and the dog sat on the log",
    "one two three four five six seven eight nine ten",
    "a quick brown fox jumps over the lazy dog near the river bank",
    "paris is the capital of france and rome is the capital of italy",
]


def _mark(cell: sweep.Cell, cfg: sweep.SweepConfig) -> None:
    """What `kvcal eval` leaves in a finished run directory of an uncalibrated cell: config.yaml, COMPLETE."""
    assert cell.calibration is None
    rc = RunConfig(
        model=cfg.model, model_dir="/cache/models/x", kv_format=cell.kv_format, tasks=[cell.task],
        skip_layers="" if cell.skip == "none" else cell.skip, limit=cfg.limit_for(cell.task),
        num_fewshot=cfg.num_fewshot, impl=cfg.impl, dtype=cfg.dtype, device=cfg.device,
        batch_size=cfg.batch_size, seed=cfg.seed, kl_seq_len=cfg.kl_seq_len,
        kv_input_dtype=None if cell.kv_format in ("auto", "bf16") else cfg.kv_input_dtype,
    )  # fmt: skip
    cell.path.mkdir(parents=True, exist_ok=True)
    (cell.path / CONFIG).write_text(yaml.safe_dump(rc.to_dict()))
    (cell.path / COMPLETE).write_text("{}")


def _uncalibrated(plan: sweep.SweepPlan) -> list[sweep.Cell]:
    return [c for c in plan.cells if c.calibration is None]


def test_parse_shard() -> None:
    assert sweep.parse_shard("1/1") == (1, 1)
    assert sweep.parse_shard(" 3/4 ") == (3, 4)
    for bad, says in [("3/2", "slice 3 does not exist in 2"), ("0/2", "slice 0"), ("2", "I/N"), ("a/b", "I/N"),
                      ("1/0", "N >= 1")]:  # fmt: skip
        with pytest.raises(UsageError, match=says):
            sweep.parse_shard(bad)


def test_slices_are_disjoint_and_cover_the_matrix(tmp_path: Path) -> None:
    plan = sweep.plan_sweep(sweep.parse_sweep_config(STUDY), tmp_path / "runs")
    for n in (1, 2, 3, 7, 50):
        slices = [sweep.shard_plan(plan, (i, n)) for i in range(1, n + 1)]
        keys = [(c.task, c.name) for s in slices for c in s.cells]
        assert sorted(keys) == sorted((c.task, c.name) for c in plan.cells)  # every cell once
        for s in slices:  # each slice calibrates exactly the scale files its cells need
            need = {c.calibration.path for c in s.cells if c.calibration is not None}
            assert {c.path for c in s.calibrations} == need
    # the same slice in every process: planning is deterministic
    again = sweep.plan_sweep(sweep.parse_sweep_config(STUDY), tmp_path / "runs")
    assert [c.name for c in sweep.shard_plan(again, (2, 3)).cells] == [
        c.name for c in sweep.shard_plan(plan, (2, 3)).cells
    ]


def test_bad_shard_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    conf = tmp_path / "s.yaml"
    conf.write_text(yaml.safe_dump(STUDY))
    for args, says in [
        (["--shard", "3/2"], "--shard 3/2"),
        (["--shard", "1/2", "--report-only"], "drop --shard"),
    ]:
        with pytest.raises(SystemExit) as exc:
            app(["sweep", str(conf), "-o", str(tmp_path / "runs"), *args], prog_name="kvcal")
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("Error: ") and says in err[0], err
    assert not (tmp_path / "runs").exists()  # nothing written


def test_dry_run_shows_the_slice(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    conf = tmp_path / "s.yaml"
    conf.write_text(yaml.safe_dump(STUDY))
    plan = sweep.plan_sweep(sweep.parse_sweep_config(STUDY), tmp_path / "runs")
    mine = sweep.shard_plan(plan, (2, 3))
    with pytest.raises(SystemExit) as exc:
        app(["sweep", str(conf), "-o", str(tmp_path / "runs"), "--shard", "2/3", "--dry-run", "--json"],
            prog_name="kvcal")  # fmt: skip
    assert exc.value.code in (0, None)
    out = json.loads(capsys.readouterr().out)
    assert [c["name"] + "/" + c["task"] for c in out["cells"]] == [c.name + "/" + c.task for c in mine.cells]
    assert out["summary"]["to_calibrate"] == len(mine.calibrations)  # only the scale files its cells need
    assert not (tmp_path / "runs").exists()


def test_report_only_refuses_an_unfinished_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    conf = tmp_path / "s.yaml"
    conf.write_text(yaml.safe_dump(STUDY))
    cfg = sweep.parse_sweep_config(STUDY)
    plan = sweep.plan_sweep(cfg, tmp_path / "runs")
    done = _uncalibrated(plan)
    for c in done:
        _mark(c, cfg)
    keys = {(c.task, c.name) for c in done}
    replan = sweep.plan_sweep(cfg, tmp_path / "runs").cells
    assert {c.status for c in replan if (c.task, c.name) in keys} == {"complete"}  # marked as eval would
    with pytest.raises(SystemExit) as exc:
        app(["sweep", str(conf), "-o", str(tmp_path / "runs"), "--report-only"], prog_name="kvcal")
    assert exc.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    missing = len(plan.cells) - len(done)
    assert len(err) == 1 and f"{missing} of {len(plan.cells)} cells are not complete" in err[0], err
    assert not (tmp_path / "runs" / "report.md").exists()


def test_a_locked_cell_is_left_to_its_holder_and_a_finished_one_is_not_rerun(tmp_path: Path) -> None:
    """run_cells under contention, without a model: the cells it would run are held by another open file
    (flock conflicts between open files, as between processes) or were completed after the plan was made."""
    cfg = sweep.parse_sweep_config(STUDY)
    root = tmp_path / "runs"
    plan = sweep.plan_sweep(cfg, root)
    todo = [
        c
        for c in sorted(plan.todo, key=lambda c: (not c.is_baseline, c.name, c.task))
        if c.calibration is None
    ]
    plan = sweep.SweepPlan(plan.runs_dir, todo, [])
    held, finished = todo[:3], todo[3:]
    for c in finished:  # another process completed these after our plan said 'todo'
        _mark(c, cfg)
    with file_lock(sweep.lock_path(root, held[0])), file_lock(sweep.lock_path(root, held[1])), \
            file_lock(sweep.lock_path(root, held[2])):  # fmt: skip
        work = sweep.run_cells(cfg, plan, {}, lambda _m, _a: None, None)
    assert work.ran == [] and work.failed == []
    assert work.busy == [f"{c.task}/{c.name}" for c in held]
    assert sorted(work.found_complete) == sorted(f"{c.task}/{c.name}" for c in finished)
    # a held lock is free again once its holder is gone
    with file_lock(sweep.lock_path(root, held[0]), blocking=False) as got:
        assert got


def test_lock_is_released_when_the_holder_is_killed(tmp_path: Path) -> None:
    lock = tmp_path / ".locks" / "t" / "c.lock"
    code = "import sys, time; from kvcal.io import file_lock\nwith file_lock(sys.argv[1]):\n print('held', flush=True); time.sleep(60)"
    p = subprocess.Popen([sys.executable, "-c", code, str(lock)], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "held"
        with file_lock(lock, blocking=False) as got:
            assert not got
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
        with file_lock(lock, blocking=False) as got:
            assert got
    finally:
        p.kill()


# ---- real shards on a tiny random model -----------------------------------------------------------------------


def _config(tmp_path: Path, tiny_lm_dir: Callable[..., Path], lm_eval_task: Callable[..., None]) -> Path:
    model = tmp_path / "model"
    shutil.copytree(tiny_lm_dir("gemma3", CORPUS, vocab_size=300, k_gain=8.0), model)
    tasks = tmp_path / "tasks"
    lm_eval_task(
        tasks, "tiny_roll", "loglikelihood_rolling", [{"text": t} for t in CORPUS],
        ["word_perplexity", "byte_perplexity", "bits_per_byte"],
    )  # fmt: skip
    # 5 cells (bf16; fp8 and nvfp4 calibrated, with and without the sliding layers) and 2 scale files, each
    # needed by two of three slices: the calibration lock is contended too
    conf = {
        "model": str(model), "tasks": ["tiny_roll"], "include_path": str(tasks), "formats": ["fp8_e4m3", "nvfp4"],
        "scales": ["tensor"], "skip_layers": ["none", "sliding_window"],
        "calibration": {"num_samples": 4, "seq_len": 32},
    }  # fmt: skip
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(conf))
    return path


def _shard_cmd(conf: Path, runs: Path, shard: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "kvcal.cli",
        "sweep",
        str(conf),
        "-o",
        str(runs),
        "--shard",
        shard,
        "--json",
    ]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip


def _measured(cmp_dict: dict) -> list[dict]:
    """The comparison's results without anything that depends on where or when the runs ran."""
    return sorted(
        ({k: v for k, v in r.items() if k not in ("run", "path")} for r in cmp_dict["results"]),
        key=lambda r: json.dumps(r, sort_keys=True, default=str),
    )


@pytest.mark.slow
def test_three_shards_at_once_then_report_equals_one_process(
    tmp_path: Path,
    tiny_lm_dir: Callable[..., Path],
    lm_eval_task: Callable[..., None],
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("kvcal.calibrate.run")
    conf = _config(tmp_path, tiny_lm_dir, lm_eval_task)
    cfg = sweep.load_sweep_config(conf)
    one = tmp_path / "one"
    res = sweep.execute_sweep(cfg, one)
    assert res["failed"] == [] and res["ran"] == 5 and res["calibrated"] == 2

    shared = tmp_path / "shared"
    procs = [subprocess.Popen(_shard_cmd(conf, shared, f"{i}/3"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=_env()) for i in (1, 2, 3)]  # fmt: skip
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-2000:]
    summaries = [json.loads((shared / f"sweep.shard-{i}-of-3.json").read_text()) for i in (1, 2, 3)]
    ran = [c for s in summaries for c in s["ran_cells"]]
    all_cells = sorted(f"{c.task}/{c.name}" for c in sweep.plan_sweep(cfg, shared).cells)
    assert sorted(ran) == all_cells  # every cell exactly once
    assert sum(s["calibrated"] for s in summaries) == 2  # each shared scale file once
    assert all(s["busy"] == [] and s["failed"] == [] for s in summaries)

    app_exit = None
    try:
        app(["sweep", str(conf), "-o", str(shared), "--report-only", "--json"], prog_name="kvcal")
    except SystemExit as exc:
        app_exit = exc.code
    assert app_exit in (0, None)
    sharded = json.loads(capsys.readouterr().out)
    assert (shared / "report.md").is_file()
    assembled = json.loads((shared / "sweep.json").read_text())
    assert sorted(assembled["shards"]) == [f"sweep.shard-{i}-of-3.json" for i in (1, 2, 3)]
    assert "vllm" in assembled["engine_commands"]["model__fp8_e4m3__calib-tensor__skip-none"]
    from kvcal.report.compare import compare_runs

    reference = compare_runs([one], context=cfg.context).to_dict()
    assert _measured(sharded) == _measured(reference)
    assert [c["label"] for c in sharded["configurations"]] == [
        c["label"] for c in reference["configurations"]
    ]
    # the scale files hold the same scales as one process's (their headers record when and where they were made)
    from safetensors.torch import load_file

    for f in (one / "scales").glob("*.safetensors"):
        mine, ref = load_file(str(shared / "scales" / f.name)), load_file(str(f))
        assert mine.keys() == ref.keys() and all(mine[k].equal(ref[k]) for k in ref)


@pytest.mark.slow
def test_a_killed_shard_is_redone_by_a_rerun_and_nothing_else(
    tmp_path: Path, tiny_lm_dir: Callable[..., Path], lm_eval_task: Callable[..., None]
) -> None:
    pytest.importorskip("kvcal.calibrate.run")
    conf = _config(tmp_path, tiny_lm_dir, lm_eval_task)
    cfg = sweep.load_sweep_config(conf)
    runs = tmp_path / "runs"
    for i in (1, 3):
        assert sweep.execute_sweep(cfg, runs, shard=(i, 3))["failed"] == []
    mine = sweep.shard_plan(sweep.plan_sweep(cfg, runs), (2, 3))
    assert len(mine.cells) == 2
    before = {p: p.stat().st_mtime_ns for p in runs.rglob("COMPLETE")}
    assert len(before) == 3
    p = subprocess.Popen(_shard_cmd(conf, runs, "2/3"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         text=True, env=_env())  # fmt: skip
    first = (
        sorted(mine.cells, key=lambda c: c.name)[0].path / "config.yaml"
    )  # run_cells' order (no baseline here)
    deadline = time.monotonic() + 300
    while not first.is_file() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    p.send_signal(signal.SIGKILL)  # mid-cell: its run directory is open, not complete
    p.wait(timeout=60)
    left = [c for c in sweep.shard_plan(sweep.plan_sweep(cfg, runs), (2, 3)).cells if c.status != "complete"]
    assert left, "the shard finished before it could be killed; nothing was tested"
    after_kill = {q: q.stat().st_mtime_ns for q in runs.rglob("COMPLETE")}
    res = sweep.execute_sweep(cfg, runs, shard=(2, 3))
    assert res["failed"] == [] and res["busy"] == []
    assert sorted(res["ran_cells"]) == sorted(
        f"{c.task}/{c.name}" for c in left
    )  # the killed cells, nothing else
    for q, t in after_kill.items():
        assert q.stat().st_mtime_ns == t  # no finished cell rerun (other shards' or this one's)
    assert all(c.status == "complete" for c in sweep.plan_sweep(cfg, runs).cells)
