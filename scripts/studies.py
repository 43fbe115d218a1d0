#!/usr/bin/env python3
"""Regenerate docs/studies/<study>.md from run directories, so no study table is ever copied by hand.

A study manifest (docs/studies/manifest.yaml) names each study's run directories by the `kvcal eval` command
that made each one (its `-o` is the run directory) — or, for a real engine's run, the `kvcal-lm-eval --model vllm`
command kvcal prints (its `--output_path` is lm-eval's output folder) — the commands run before them (a
calibration, an export), and the
`kvcal compare` options. This script loads the runs with kvcal's own comparison (kvcal.report.compare.
compare_runs, the function `kvcal compare RUNS --json` calls, with the same options) and writes the tables with,
for every row, the command that produced it.

    python scripts/studies.py                        # every study of the manifest whose runs are there
    python scripts/studies.py demo --root demo=/work/baseline/before/demo
    python scripts/studies.py demo --make            # first run the commands of missing or incomplete runs
    python scripts/studies.py --check                # exit 1 when a written study differs from its runs

`make studies` runs the first form. Exit codes: 0 written (or up to date), 1 a run is missing / incomplete or a
study is out of date, 2 a bad manifest or option — each with one `Error: ...` line.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python scripts/studies.py` from a checkout imports that checkout's kvcal
    sys.path.insert(0, str(REPO))

from kvcal.errors import KvcalError, UsageError  # noqa: E402
from kvcal.report import numbers as fmt  # noqa: E402
from kvcal.report.compare import Comparison, compare_runs  # noqa: E402
from kvcal.report.conformance import add_conformance  # noqa: E402
from kvcal.report.lmeval_runs import pick_results, results_folder  # noqa: E402
from kvcal.report.markdown import (  # noqa: E402
    CONFORMANCE_INTRO,
    DECODE_INTRO,
    agreement_table,
    by_task,
    conformance_table,
    conformance_verdict,
    decode_table,
    gate_summary,
    length_intro,
    length_table,
    passkey_table,
    passkey_tasks,
    position_intro,
    position_table,
)
from kvcal.rundir import COMPLETE, CONFIG  # noqa: E402

MANIFEST = REPO / "docs" / "studies" / "manifest.yaml"
OUT_DIR = REPO / "docs" / "studies"
LM_EVAL = "kvcal-lm-eval"  # kvcal's lm-eval launcher: an engine run's command (kvcal/evaluate/engine_lm_eval.py)
ROOT = "{root}"  # placeholder in the manifest's commands: the study's folder (its `root`, or --root)
_STUDY_KEYS = {"title", "about", "root", "setup", "runs", "compare", "notes"}
_RUN_KEYS = {"name", "command"}
_COMPARE_KEYS = {
    "baseline", "max_drop", "context", "min_samples", "alpha", "bootstrap", "seed", "gate", "conformance",
    "conformance_bf16", "conformance_noise", "margin",
}  # fmt: skip


class MissingRunsError(KvcalError):
    """A study's run directory is missing or incomplete (exit 1; skipped when every study is regenerated)."""


@dataclass(frozen=True)
class RunSpec:
    name: str  # the configuration's label in the report: the run directory's name
    command: str  # `kvcal eval ... -o {root}/...` (or `kvcal-lm-eval ... --output_path {root}/...`), as typed

    @property
    def engine(self) -> bool:
        """A real engine's run through lm-eval (`kvcal-lm-eval --model vllm`): an lm-eval output folder."""
        return self.command.split(maxsplit=1)[0] == LM_EVAL


@dataclass(frozen=True)
class Study:
    name: str
    title: str
    about: str
    root: str  # where the commands write, as the manifest states it (relative to where they are run)
    setup: list[str]  # commands run before the runs (e.g. `kvcal calibrate ... -o {root}/scales.safetensors`)
    runs: list[RunSpec]
    compare: dict[str, Any]  # compare_runs / `kvcal compare` options: baseline, max_drop, context, ...
    notes: str = ""  # what the tables show, written once the numbers are in (kept beside the generated part)


# ---- the manifest ---------------------------------------------------------------------------------------------


def _unknown(keys: set[str], allowed: set[str], where: str) -> None:
    extra = sorted(keys - allowed)
    if extra:
        raise UsageError(
            f"{where}: unknown key(s) {', '.join(extra)} (allowed: {', '.join(sorted(allowed))})"
        )


def output_of(command: str) -> str:
    """The `-o` / `--output` value of a kvcal command line (its run directory or output file), or lm-eval's
    `--output_path` of a `kvcal-lm-eval` one."""
    argv = shlex.split(command)
    for i, a in enumerate(argv):
        if a in ("-o", "--output", "--output_path") and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(("--output=", "--output_path=")):
            return a.split("=", 1)[1]
    raise UsageError(f"command has no -o/--output/--output_path: {command}")


def _study(name: str, raw: Any) -> Study:
    where = f"study {name!r}"
    if not isinstance(raw, dict):
        raise UsageError(f"{where}: expected a mapping")
    _unknown(set(raw), _STUDY_KEYS, where)
    for key in ("title", "root", "runs"):
        if key not in raw:
            raise UsageError(f"{where}: missing {key!r}")
    runs = []
    for i, r in enumerate(raw["runs"] or []):
        if not isinstance(r, dict) or "name" not in r or "command" not in r:
            raise UsageError(f"{where}, run {i}: needs name and command")
        _unknown(set(r), _RUN_KEYS, f"{where}, run {r['name']!r}")
        cmd = " ".join(str(r["command"]).split())  # YAML folded lines -> one command line
        argv = shlex.split(cmd)
        if argv[:2] != ["kvcal", "eval"] and argv[:1] != [LM_EVAL]:
            raise UsageError(
                f"{where}, run {r['name']!r}: the command must be `kvcal eval ...` or `{LM_EVAL} ...`, got {cmd!r}"
            )
        if Path(output_of(cmd)).name != r["name"]:
            raise UsageError(f"{where}, run {r['name']!r}: its -o must be a directory named {r['name']!r}")
        runs.append(RunSpec(str(r["name"]), cmd))
    if not runs:
        raise UsageError(f"{where}: no runs")
    compare = dict(raw.get("compare") or {})
    _unknown(set(compare), _COMPARE_KEYS, f"{where}, compare")
    return Study(
        name=name, title=str(raw["title"]), about=str(raw.get("about") or "").strip(), root=str(raw["root"]),
        setup=[" ".join(str(c).split()) for c in raw.get("setup") or []], runs=runs, compare=compare,
        notes=str(raw.get("notes") or "").strip(),
    )  # fmt: skip


def load_manifest(path: Path) -> dict[str, Study]:
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as e:
        raise UsageError(f"cannot read the study manifest {path}: {e}") from e
    if not isinstance(raw, dict) or not isinstance(raw.get("studies"), dict):
        raise UsageError(f"{path}: expected a mapping with `studies:`")
    return {name: _study(name, s) for name, s in raw["studies"].items()}


# ---- commands and run directories -------------------------------------------------------------------------------


def with_root(command: str, root: str) -> str:
    return command.replace(ROOT, root)


MODEL_FOLDER = re.compile(r"\{model:([A-Za-z0-9_.-]+)\}")  # a real model's local folder (`kvcal models path NAME`)


def with_models(command: str) -> str:
    """`{model:NAME}` -> the folder `kvcal models path NAME` prints (an engine run on the unexported model: its
    path differs per machine, so the page shows the placeholder and the run resolves it)."""
    from kvcal.models.real import real_model
    from kvcal.models.resolve import resolve_model

    return MODEL_FOLDER.sub(lambda m: str(resolve_model(real_model(m.group(1)))), command)


def run_dir(spec: RunSpec, root: Path) -> Path:
    return Path(output_of(with_root(spec.command, str(root))))


def compare_command(study: Study, root: str) -> str:
    """The `kvcal compare` command line whose --json holds every difference of the study."""
    dirs = [output_of(with_root(r.command, root)) for r in study.runs]
    opts: list[str] = []
    for key, value in study.compare.items():
        if value is None:
            continue
        for v in value if isinstance(value, list) else [value]:
            opts += [f"--{key.replace('_', '-')}", str(v)]
    return shlex.join(["kvcal", "compare", *dirs, *opts, "--json"])


def _kvcal_argv(command: str) -> list[str]:
    """A manifest command as an argument list, `kvcal` (or `kvcal-lm-eval`) being this Python's console script
    (never a shell)."""
    argv = shlex.split(command)
    exe = Path(sys.executable).with_name(argv[0])
    return [str(exe) if exe.exists() else argv[0], *argv[1:]]


def _complete(spec: RunSpec, d: Path) -> bool:
    """A kvcal run directory with its COMPLETE marker, or an engine's lm-eval output folder with its results."""
    return results_folder(d) is not None if spec.engine else (d / COMPLETE).exists()


def make_runs(study: Study, root: Path) -> None:
    """Run the setup commands whose output is missing, then every run that is not COMPLETE (kvcal eval resumes)."""
    for cmd in study.setup:
        cmd = with_root(cmd, str(root))
        if not Path(output_of(cmd)).exists():
            print(f"+ {cmd}", file=sys.stderr)
            subprocess.run(_kvcal_argv(cmd), check=True)
    for spec in study.runs:
        if not _complete(spec, run_dir(spec, root)):
            cmd = with_models(with_root(spec.command, str(root)))
            print(f"+ {cmd}", file=sys.stderr)
            subprocess.run(_kvcal_argv(cmd), check=True)


# Options whose value config.yaml records as given (after parsing): a run directory must match its command.
_RECORDED = {
    "--limit": ("limit", int),
    "--kl-seq-len": ("kl_seq_len", int),
    "--skip-layers": ("skip_layers", str),
    "--tq-boundary-layers": ("tq_boundary_layers", int),
}


def _disagreements(command: str, recorded: dict[str, Any]) -> list[str]:
    """Where a run directory's config.yaml contradicts the command the manifest says made it."""
    from kvcal.formats import parse_kv_format

    argv = shlex.split(command)
    given = {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("-")}
    out = []
    fmt_opt = given.get("-f", given.get("--kv-format"))
    if fmt_opt is not None and recorded.get("kv_format") != parse_kv_format(fmt_opt):
        out.append(f"kv_format {recorded.get('kv_format')!r} (command: {fmt_opt!r})")
    for opt, (key, cast) in _RECORDED.items():
        if opt in given and recorded.get(key) != cast(given[opt]):
            out.append(f"{key} {recorded.get(key)!r} (command: {given[opt]!r})")
    return out


def check_runs(study: Study, root: Path) -> list[Path]:
    """Every run directory, COMPLETE, and recording what its command asked for (format, tasks, limit, ...)."""
    dirs, missing = [], []
    for spec in study.runs:
        d = run_dir(spec, root)
        if not _complete(spec, d):
            missing.append(str(d))
            continue
        if spec.engine:  # lm-eval's own output: what ran is in its results file (compare pairs like with like)
            dirs.append(d)
            continue
        recorded = yaml.safe_load((d / CONFIG).read_text(encoding="utf-8")) or {}
        wrong = _disagreements(spec.command, recorded)
        if wrong:
            raise KvcalError(
                f"study {study.name}: {d} records {'; '.join(wrong)}: the manifest's command did not make it"
            )
        dirs.append(d)
    if missing:
        raise MissingRunsError(
            f"study {study.name}: run directories missing or incomplete: {', '.join(missing)}; make them with "
            f"`python scripts/studies.py {study.name} --make` (or the commands in docs/studies/manifest.yaml)"
        )
    return dirs


def _lm_eval_environment(folder: Path) -> str:
    """An lm-eval output folder's environment from the results file the comparison reads (its newest): lm-eval
    and transformers versions, the model backend, the CPU (pretty_env_info's "Model name") and the git commit
    lm-eval was run from."""
    res = json.loads(pick_results(folder, None).read_text(encoding="utf-8"))
    cpu = next((ln.split(":", 1)[1].strip() for ln in str(res.get("pretty_env_info") or "").splitlines()
                if ln.strip().startswith("Model name:")), "?")  # fmt: skip
    return (f"lm-eval {res.get('lm_eval_version', '?')} `--model {res.get('model_source', '?')}` (transformers "
            f"{res.get('transformers_version', '?')}) run from commit `{res.get('git_hash') or '?'}` on {cpu}")


def _environment(dirs: Sequence[Path]) -> str:
    """Where the runs were made, from their env.json: kvcal commit, device, torch threads."""
    seen: dict[str, None] = {}
    for d in dirs:
        lm = results_folder(d) if not (d / "env.json").exists() else None
        if lm is not None:  # an engine's lm-eval output folder: what lm-eval recorded of its environment
            seen[_lm_eval_environment(lm)] = None
            continue
        try:
            env = json.loads((d / "env.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            seen["(no env.json)"] = None
            continue
        rev = str(env.get("kvcal_git_revision") or "unknown")[:7] + (
            " (dirty)" if env.get("kvcal_git_dirty") else ""
        )
        device = env.get("gpu") or f"{env.get('device', '?')} ({env.get('processor', '?')})"
        seen[f"kvcal {env.get('kvcal_version', '?')} at commit `{rev}` on {device}, torch "
             f"{(env.get('versions') or {}).get('torch', '?')}, {env.get('torch_threads', '?')} threads"] = None  # fmt: skip
    return "; ".join(seen)


# ---- the page ---------------------------------------------------------------------------------------------------


def _esc(s: str) -> str:
    return s.replace("|", "\\|")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(_esc(c) for c in row) + " |" for row in rows),
    ]


def render(study: Study, cmp: Comparison, dirs: Sequence[Path], shown_root: str) -> str:
    """The study page: how the runs were made, then compare's tables, each row naming its run's command."""
    ref = {spec.name: f"R{i + 1}" for i, spec in enumerate(study.runs)}
    compare_cmd = compare_command(study, shown_root)
    lines = [
        f"# {study.title}",
        "",
        f"<!-- Generated by scripts/studies.py from docs/studies/manifest.yaml (study `{study.name}`); do not "
        "edit: `make studies` regenerates it from the run directories. -->",
        "",
    ]
    if study.about:
        lines += [study.about, ""]
    lines += ["## How the numbers were made", "", f"Runs made with {_environment(dirs)}.", ""]
    if study.setup:
        lines += ["First:", ""] + [f"- `{with_root(c, shown_root)}`" for c in study.setup] + [""]
    lines += ["Each row below names the run (R1, R2, ...) whose command produced its score:", ""]
    lines += _table(
        ["run", "configuration", "command"],
        [[ref[s.name], f"`{s.name}`", f"`{with_root(s.command, shown_root)}`"] for s in study.runs],
    )
    lines += [
        "",
        f"Every difference, interval, p-value and gate verdict is `kvcal compare`'s: `{compare_cmd}` (the "
        f"script calls the function that command calls, with the same options; intervals "
        f"{1 - cmp.alpha:.0%}, {fmt.correction_words(cmp.multiple_testing, cmp.alpha)}; gate "
        f"{'' if cmp.settings.gate == 'regression' else f'{cmp.settings.gate}: '}{gate_summary(cmp)}).",
        "",
        "## Summary",
        "",
    ]
    rows = []
    for c in cmp.configs:
        verdict = "baseline" if c.label == cmp.baseline else cmp.config_verdict(c.label)
        rows.append([f"`{c.label}`", ref.get(c.label, "?"), c.kv_format, c.scales, c.skip or "none",
                     fmt.mult(c.capacity), cmp.config_gate(c.label), verdict])  # fmt: skip
    lines += _table(["configuration", "run", "kv format", "scales", "skip layers",
                     fmt.capacity_heading(cmp.context), "gate", "verdict"], rows)  # fmt: skip
    lines.append("")
    for task, groups in by_task(cmp):
        for label, results in groups:
            shown = [r for r in results if r.key or r.gated]
            if not shown:
                continue
            r0 = shown[0]
            direction = "higher is better" if r0.higher_is_better else "lower is better"
            lines += [f"## {task} · `{label}` ({direction}; {fmt.role(r0)})", ""]
            body = [[f"`{cmp.baseline}` (baseline)", ref.get(cmp.baseline, "?"), fmt.score(r0, base=True),
                     "—", "—", "—", str(r0.n_base_total), "baseline"]]  # fmt: skip
            for r in shown:
                body.append([f"`{r.config}`", ref.get(r.config, "?"), fmt.score(r), fmt.diff(r), fmt.rel(r),
                             fmt.p_column(r), str(r.n), "**FAIL**" if r.status == "FAIL" else r.status])  # fmt: skip
            lines += _table(["configuration", "run", "score ± SE", f"difference [{1 - cmp.alpha:.0%} CI]",
                             "relative change [Fieller]", "p (Holm-adjusted)", "n", "status"], body)  # fmt: skip
            lines.append("")
    if any(len(c.buckets) > 1 for c in cmp.positions):  # one bucket per run says nothing about position
        header, prow = position_table(cmp)
        prow = [[r[0], ref.get(r[0].strip("`"), "?"), *r[1:]] for r in prow]
        lines += ["## KL by position", "", position_intro(cmp), ""]
        lines += _table([header[0], "run", *header[1:]], prow) + [""]
    for task in passkey_tasks(cmp):
        header, krow = passkey_table(cmp, task)
        krow = [[r[0], ref.get(r[0].strip("`"), "?"), *r[1:]] for r in krow]
        lines += [f"## {task} by length and depth", ""] + _table([header[0], "run", *header[1:]], krow) + [""]
    if cmp.agreement_rows:  # divergence tasks: agreement with the BF16 trajectory, survival, hazard, projection
        header, arow = agreement_table(cmp)
        arow = [[r[0], r[1], ref.get(r[1].strip("`"), "?"), *r[2:]] for r in arow]
        lines += ["## Output agreement with the BF16 trajectory", ""]
        lines += _table([*header[:2], "run", *header[2:]], arow) + [""]
    if cmp.length_rows:  # the paired change in generated length (kvcal.report.length)
        header, lrow = length_table(cmp)
        lrow = [[r[0], r[1], ref.get(r[1].strip("`"), "?"), *r[2:]] for r in lrow]
        lines += ["## Output length", "", length_intro(cmp), ""]
        lines += _table([*header[:2], "run", *header[2:]], lrow) + [""]
    lines += _conformance(cmp, ref)
    if study.notes:
        lines += ["## What it shows", "", study.notes, ""]
    return "\n".join(lines)


def _conformance(cmp: Comparison, ref: dict[str, str]) -> list[str]:
    """Engine vs emulation (the manifest's `conformance:` pairs): compare's table, each row naming its two runs,
    then each pair's verdict."""
    if not cmp.conformance:
        return []
    header, rows = conformance_table(cmp)
    rows = [[r[0], f"{ref.get(r[0].strip('`'), '?')} vs {ref.get(r[1].strip('`'), '?')}", *r[1:]] for r in rows]
    lines = ["## Engine vs emulation", "", CONFORMANCE_INTRO, ""]
    lines += _table([header[0], "runs", *header[1:]], rows) + [""]
    lines += [f"- `{c.engine}` ({conformance_verdict(c.conforms)}): {_esc(c.verdict)}" for c in cmp.conformance]
    if any(c.decode for c in cmp.conformance):  # generative tasks: each side's decode against its own BF16
        header, drows = decode_table(cmp)
        drows = [[r[0], f"{ref.get(r[0].strip('`'), '?')} vs {ref.get(r[1].strip('`'), '?')}", *r[1:]] for r in drows]
        lines += ["", "### Engine vs emulation: generated outputs", "", DECODE_INTRO, ""]
        lines += _table([header[0], "runs", *header[1:]], drows)
    return [*lines, ""]


def build(study: Study, root: Path, shown_root: str) -> str:
    dirs = check_runs(study, root)
    opts = dict(study.compare)
    cmp = compare_runs(
        dirs, baseline=opts.get("baseline", "bf16"), max_drop=opts.get("max_drop"), context=opts.get("context"),
        min_samples=opts.get("min_samples", 10), alpha=opts.get("alpha", 0.05), n_boot=opts.get("bootstrap", 2000),
        seed=opts.get("seed", 1234), gate=opts.get("gate", "regression"),
    )  # fmt: skip
    if opts.get("conformance"):  # `kvcal compare --conformance ENGINE=EMULATION`, each pair of the list
        refs = [str(p) for p in opts.get("conformance_bf16") or []]  # --conformance-bf16 ENGINE_BF16=EMU_BF16
        noise = [str(p) for p in opts.get("conformance_noise") or []]  # --conformance-noise PERT_Q=PERT_BF16
        add_conformance(cmp, [str(p) for p in opts["conformance"]], references=refs, margin=opts.get("margin"),
                        noise=noise)  # fmt: skip
    return render(study, cmp, dirs, shown_root)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("studies", nargs="*", help="studies of the manifest to regenerate (default: all)")
    ap.add_argument("--manifest", type=Path, default=MANIFEST)
    ap.add_argument("--out", type=Path, default=OUT_DIR, help="folder of the study pages")
    ap.add_argument("--root", action="append", default=[], metavar="STUDY=DIR",
                    help="where a study's runs are (default: its manifest `root`, relative to the current folder)")  # fmt: skip
    ap.add_argument(
        "--make", action="store_true", help="run the commands of missing or incomplete runs first"
    )
    ap.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 when a page differs from its runs"
    )
    args = ap.parse_args(argv)
    try:
        studies = load_manifest(args.manifest)
        roots = {}
        for item in args.root:
            name, sep, d = item.partition("=")
            if not sep or name not in studies:
                raise UsageError(f"--root takes STUDY=DIR with a study of the manifest, got {item!r}")
            roots[name] = d
        chosen = args.studies or list(studies)
        unknown = [s for s in chosen if s not in studies]
        if unknown:
            raise UsageError(f"unknown stud(ies) {', '.join(unknown)}; the manifest has {', '.join(studies)}")
        stale = []
        for name in chosen:
            study = studies[name]
            root = Path(roots.get(name, study.root))
            if args.make:
                make_runs(study, root)
            try:
                page = build(study, root, shown_root=study.root)
            except MissingRunsError as e:
                if args.studies:  # asked for by name: its runs must be there
                    raise
                print(f"skipped: {e}", file=sys.stderr)  # every study: regenerate those whose runs are here
                continue
            target = args.out / f"{name}.md"
            if args.check:
                if not target.exists() or target.read_text(encoding="utf-8") != page:
                    stale.append(str(target))
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(page, encoding="utf-8")
            print(f"wrote {target}", file=sys.stderr)
        if stale:
            raise KvcalError(f"out of date: {', '.join(stale)} (regenerate with `make studies`)")
    except UsageError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2
    except (KvcalError, subprocess.CalledProcessError) as e:
        print(f"Error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
