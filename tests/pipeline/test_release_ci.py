"""examples/ci: each CI file parses, defines the variables its commands read, installs kvcal from its repository
at a pinned revision, caches $KVCAL_CACHE and the release folder, uploads the report; and its exact `pip install`
and `kvcal` lines run (through bash, as the CI runner does): the install into a fresh virtual environment from
this checkout's git repository at its HEAD commit (KVCAL_REPO=file://..., KVCAL_REV=HEAD's sha; offline, the
pinned set visible through a .pth file), then `kvcal release` from that environment on a tiny model with MODEL /
RELEASE_CONFIG / OUT / KVCAL_CACHE pointed at it. The second file runs against the first one's OUT and cache, as a
restored CI cache would: it reuses everything."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CI = REPO / "examples" / "ci"
VARIABLES = ("KVCAL_REPO", "KVCAL_REV", "MODEL", "RELEASE_CONFIG", "OUT", "KVCAL_CACHE")
INSTALL = (
    'pip install --extra-index-url https://download.pytorch.org/whl/cpu "git+${KVCAL_REPO}@${KVCAL_REV}"'
)


def _github(doc: dict[str, Any]) -> tuple[dict[str, str], list[str], list[str], list[str]]:
    """(env, shell lines, cached paths, uploaded paths) of a GitHub Actions workflow."""
    steps = [s for job in doc["jobs"].values() for s in job["steps"]]
    lines = [ln for s in steps if "run" in s for ln in s["run"].splitlines()]
    env = {k: str(v) for k, v in doc["env"].items()}

    def paths(uses: str) -> list[str]:
        found = [s["with"]["path"] for s in steps if str(s.get("uses", "")).startswith(uses)]
        return [p.strip() for block in found for p in block.splitlines() if p.strip()]

    return env, lines, paths("actions/cache"), paths("actions/upload-artifact")


def _gitlab(doc: dict[str, Any]) -> tuple[dict[str, str], list[str], list[str], list[str]]:
    job = next(v for k, v in doc.items() if isinstance(v, dict) and "script" in v)
    env = {k: str(v) for k, v in job["variables"].items()}
    lines = [*job.get("before_script", []), *job["script"]]  # the runner runs before_script first
    return env, lines, job["cache"]["paths"], job["artifacts"]["paths"]


FILES = {"github-actions-release.yml": _github, "gitlab-ci-release.yml": _gitlab}


def _expand(path: str, env: dict[str, str]) -> str:
    """GitHub's ${{ env.X }} and the shell's $X / ${X}, for checking what a path names."""
    for k, v in env.items():
        for form in ("${{ env." + k + " }}", "${" + k + "}", "$" + k):
            path = path.replace(form, v)
    return path.rstrip("/")


def test_ci_files_define_cache_and_upload() -> None:
    assert sorted(p.name for p in CI.glob("*.yml")) == sorted(FILES)
    for name, read in FILES.items():
        env, lines, cached, uploaded = read(yaml.safe_load((CI / name).read_text()))
        assert all(v in env for v in VARIABLES), (name, env)
        commands = [ln.strip() for ln in lines if ln.strip().startswith("kvcal ")]
        assert commands == ['kvcal release "$MODEL" --config "$RELEASE_CONFIG" -o "$OUT"'], (name, commands)
        installs = [ln.strip() for ln in lines if ln.strip().startswith("pip ")]
        assert installs == [INSTALL], (name, installs)  # from the repository, pinned: kvcal is not on PyPI
        assert len(env["KVCAL_REV"]) == 40, "pin a full commit sha"
        cached = {_expand(p, env) for p in cached}
        assert {env["KVCAL_CACHE"], env["OUT"]} <= cached, (name, cached)
        uploaded = {_expand(p, env) for p in uploaded}
        assert {f"{env['OUT']}/release.json", f"{env['OUT']}/release.md"} <= uploaded, (name, uploaded)


def _fresh_venv(root: Path) -> Path:
    """A virtual environment with pip whose own site-packages is empty but for pip; the pinned set of the
    running one is visible through a .pth file (so `pip install` resolves it offline). Its bundled setuptools
    is removed: the build uses the pinned set's (>=68, as pyproject.toml asks)."""
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, capture_output=True, timeout=600)
    site = next((root / "lib").glob("python3*/site-packages"))
    (site / "_pinned_set.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(root / "bin" / "python"), "-m", "pip", "uninstall", "-q", "-y", "setuptools"],
                   check=False, capture_output=True, timeout=300)  # fmt: skip
    return root


@pytest.mark.slow
def test_ci_commands_run_on_a_tiny_model(tiny_llama_dir: Path, tmp_path: Path) -> None:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("the CI install line clones kvcal's git repository: needs git and a git checkout")
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip
    venv = _fresh_venv(tmp_path / "venv")
    config = tmp_path / "release.yaml"
    config.write_text(
        yaml.safe_dump({
            "ship": {"kv_format": "fp8_e4m3"},
            "calibration": {"num_samples": 2, "seq_len": 16},
            "evaluate": {"tasks": ["kl"], "limit": 6, "kl_seq_len": 16, "impl": "torch"},
            "gate": {"min_samples": 3, "bootstrap": 200},
            "export": {"engines": ["sglang"]},
        })
    )  # fmt: skip
    records = []
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}  # no other kvcal
    for name, read in FILES.items():
        env, lines, _, _ = read(yaml.safe_load((CI / name).read_text()))
        run_env = {**base, **env, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}"}
        run_env.update(KVCAL_REPO=f"file://{REPO}", KVCAL_REV=head, PIP_NO_INDEX="1", PIP_NO_BUILD_ISOLATION="0",
                       PIP_DISABLE_PIP_VERSION_CHECK="1")  # fmt: skip
        run_env.update(MODEL=str(tiny_llama_dir), RELEASE_CONFIG=str(config), OUT=str(tmp_path / "out"),
                       KVCAL_CACHE=str(tmp_path / "cache"), TOKENIZERS_PARALLELISM="false")  # fmt: skip
        for line in (ln for ln in lines if ln.strip().startswith(("pip ", "kvcal "))):
            proc = subprocess.run(["bash", "-c", line], env=run_env, cwd=tmp_path, capture_output=True, text=True,
                                  timeout=900, check=False)  # fmt: skip
            assert proc.returncode == 0, (name, line, proc.stderr[-2000:])
            if line.strip().startswith("kvcal "):
                assert "serve (sglang): python -m sglang.launch_server" in proc.stdout
        records.append(json.loads((tmp_path / "out" / "release.json").read_text()))
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import kvcal; print(kvcal.__file__)"],
                           cwd=tmp_path, env=base, capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert Path(where.strip()).is_relative_to(venv)  # `kvcal` was the one the install line put there
    assert records[0]["decision"] == "ship" and records[0]["work"]["calibrations_run"] == 1
    assert records[1]["work"]["reused_everything"] is True  # the second CI file found the first one's OUT
    assert records[1]["scales_sha256"] == records[0]["scales_sha256"]
