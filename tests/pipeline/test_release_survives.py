"""A release folder's last decision survives every failing rerun (issue 43, item 2): `kvcal release` on a folder
that holds a finished release, rerun with a refused YAML setting, a missing model or scale file, or failing during
its work, exits 1 or 2 with one `Error:` line and leaves release.json and release.md byte for byte; a setting kvcal
eval would refuse is refused before any work, naming the YAML key (not kvcal eval's option), and before OUT is
created (issue 43, item 1)."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.usefixtures("one_thread")

Invoke = Callable[[list[str]], tuple[int, str, str]]

BASE: dict[str, Any] = {
    "ship": {"kv_format": "fp8_e4m3", "granularity": "tensor"},
    "calibration": {"num_samples": 4, "seq_len": 32},
    "evaluate": {"tasks": ["kl"], "limit": 12, "kl_seq_len": 32, "dtype": "float32", "impl": "torch"},
    "gate": {"min_samples": 5, "bootstrap": 400},
    "export": {"engines": ["vllm"]},
}


def _yaml(tmp: Path, name: str, **sections: dict[str, Any]) -> Path:
    raw = json.loads(json.dumps(BASE))
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    path = tmp / name
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Counts every model load (kvcal.models.loading.load_model, the real function underneath)."""
    from kvcal.calibrate import drift
    from kvcal.models import loading
    from kvcal.pipeline import sweep

    seen = {"load_model": 0}
    real = loading.load_model

    @functools.wraps(real)
    def counted(*args: Any, **kwargs: Any) -> Any:
        seen["load_model"] += 1
        return real(*args, **kwargs)

    for module in (loading, sweep, drift):
        monkeypatch.setattr(module, "load_model", counted)
    yield seen


@pytest.fixture(scope="module")
def released(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding one finished release of the tiny Llama."""
    from typer.testing import CliRunner

    from kvcal.cli import app

    tmp = tmp_path_factory.mktemp("released")
    out = tmp / "out"
    result = CliRunner().invoke(app, ["release", str(tiny_llama_dir), "-c", str(_yaml(tmp, "ok.yaml")), "-o", str(out)])
    assert result.exit_code == 0, result.output
    return out


def _files(out: Path) -> dict[str, bytes]:
    return {n: (out / n).read_bytes() for n in ("release.json", "release.md")}


# A setting kvcal eval refuses, in the release YAML: before today's fix each passed the YAML's own parse and was
# refused only after the release had deleted release.json / release.md and calibrated.
REFUSED = [
    ({"evaluate": {"batch_size": 0}}, "evaluate.batch_size must be at least 1"),
    ({"evaluate": {"repeats": 0}}, "evaluate.repeats must be at least 1"),
    ({"evaluate": {"max_gen_toks": 0}}, "evaluate.max_gen_toks must be at least 1"),
    ({"evaluate": {"kl_seq_len": 1}}, "evaluate.kl_seq_len must be at least 2"),
    ({"evaluate": {"impl": "cuda-graphs"}}, "evaluate.impl must be one of"),
    ({"evaluate": {"prefix_serde": "fp8"}}, "prefix"),
    ({"evaluate": {"num_fewshot": -1}}, "evaluate.num_fewshot must be 0 or more"),
]


@pytest.mark.parametrize(("section", "needle"), REFUSED, ids=[next(iter(s["evaluate"])) for s, _ in REFUSED])
def test_a_refused_evaluate_setting_leaves_the_last_release(
    section: dict[str, Any], needle: str, released: Path, tiny_llama_dir: Path, tmp_path: Path, invoke: Invoke,
    loads: dict[str, int],
) -> None:  # fmt: skip
    before = _files(released)
    code, _, err = invoke(["release", str(tiny_llama_dir), "-c", str(_yaml(tmp_path, "bad.yaml", **section)),
                           "-o", str(released)])  # fmt: skip
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("Error: "), err
    assert needle in lines[0] and "--" not in lines[0], lines[0]  # the YAML key, not kvcal eval's option
    assert _files(released) == before  # the last decision, byte for byte
    assert loads["load_model"] == 0  # refused before any work


def test_a_refused_release_creates_no_folder(tiny_llama_dir: Path, tmp_path: Path, invoke: Invoke) -> None:
    """Every input is checked before OUT is created: a refused release leaves nothing behind."""
    out = tmp_path / "new" / "out"
    for args in (
        [str(tiny_llama_dir), "-c", str(_yaml(tmp_path, "b.yaml", evaluate={"batch_size": 0}))],
        [str(tmp_path / "no-such-model"), "-c", str(_yaml(tmp_path, "ok.yaml"))],
        [str(tiny_llama_dir), "-c", str(_yaml(tmp_path, "s.yaml")), "--context", "0"],
    ):
        code, _, err = invoke(["release", *args, "-o", str(out)])
        assert code == 2 and err.count("Error:") == 1, err
        assert not (tmp_path / "new").exists(), args


def test_a_release_failing_mid_work_leaves_the_last_release(
    released: Path, tiny_llama_dir: Path, tmp_path: Path, invoke: Invoke, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rerun that fails during its work (a changed recipe makes it calibrate again; the calibration fails) is
    exit 1 with one `Error:` line; release.json and release.md are the last release's."""
    from kvcal.pipeline import sweep

    def failing(*_args: Any, **_kwargs: Any) -> Any:
        raise sweep.KvcalError("the calibration's machine went away")

    monkeypatch.setattr(sweep, "load_model", failing)
    before = _files(released)
    cfg = _yaml(tmp_path, "recipe.yaml", calibration={"num_samples": 5})
    code, _, err = invoke(["release", str(tiny_llama_dir), "-c", str(cfg), "-o", str(released)])
    assert code == 1 and err.count("Error:") == 1, err
    assert _files(released) == before
    assert not list(released.rglob("*.tmp"))
