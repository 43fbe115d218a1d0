"""The CLI edges a newcomer trips on (issue 27): click's own usage errors (a missing option, an unknown option,
a bad value) are one `Error:` line with exit 2, KVCAL_DEBUG=1 keeps the exit code, and a table piped to another
program keeps every number whole (a real process and a real pipe)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvcal.models.config import load_config
from kvcal.models.geometry import kv_spec
from kvcal.scales import compute_binding, make_scale_set, save_scale_file

REPO = Path(__file__).resolve().parents[2]
Invoke = Callable[[list[str]], tuple[int, str, str]]


def _kvcal(*args: str) -> subprocess.CompletedProcess[str]:
    """`kvcal ARGS` in a fresh process with stdout and stderr piped (not a terminal)."""
    return subprocess.run(
        [sys.executable, "-m", "kvcal.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
        check=False,
    )


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), err
    assert "Usage:" not in err and "╭" not in err  # not Typer's boxed usage text
    return lines[0]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["eval", "smollm2", "--kv-format", "bf16", "--tasks", "kl"], "Missing option '--output' / '-o'"),
        (["calibrate", "smollm2", "--kv-format", "fp8"], "Missing option '--output' / '-o'"),
        (["eval", "smollm2", "--kv-formt", "bf16", "--tasks", "kl", "-o", "x"], "No such option: --kv-formt"),
        (["eval", "smollm2", "-f", "bf16", "--tasks", "kl", "--limit", "many", "-o", "x"], "'--limit'"),
        (["show"], "Missing argument 'scales'"),
        (["no-such-command"], "No such command 'no-such-command'"),
    ],
    ids=["eval-no-o", "calibrate-no-o", "unknown-option", "bad-int", "show-no-arg", "no-command"],
)
def test_click_usage_errors_are_one_error_line_exit_2(
    args: list[str], says: str, invoke: Invoke, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = invoke(args)
    assert code == 2, err
    line = _one_error_line(err)
    assert says in line, line
    cmd = "kvcal" if args[0] == "no-such-command" else f"kvcal {args[0]}"
    assert line.endswith(f"See `{cmd} --help`.")  # where to read the options
    assert out == "" and list(tmp_path.iterdir()) == []  # nothing written


def test_no_arguments_still_prints_the_help(invoke: Invoke) -> None:
    code, out, err = invoke([])
    assert code == 2 and "Usage:" in out + err and "calibrate" in out + err


def test_kvcal_debug_keeps_the_exit_code(
    invoke: Invoke, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = str(tmp_path / "no-such-model")
    code, _, plain = invoke(["capacity", missing])
    monkeypatch.setenv("KVCAL_DEBUG", "1")
    debug_code, _, debug = invoke(["capacity", missing])
    assert code == debug_code == 2
    assert "Traceback" in debug and debug.strip().splitlines()[-1] == _one_error_line(plain)
    code, _, err = invoke(["eval", "smollm2", "-f", "bf16", "--tasks", "kl"])
    assert code == 2 and "Missing option" in err


def test_piped_show_table_has_every_number_whole(
    word_llama_dir: Path, tmp_path: Path, invoke: Invoke
) -> None:
    """Per-head scales with a q_scale make the table wider than 80 columns: piped, rich would have cut it
    ("0.04…"); every scale prints whole, Q included, and --json lists the q_scales."""
    kv = kv_spec(load_config(word_llama_dir))
    g = torch.Generator().manual_seed(0)
    ks = [torch.rand((kv.layers[0].kv_heads,), generator=g) * 0.1 + 0.01 for _ in range(kv.num_layers)]
    vs = [torch.rand((kv.layers[0].kv_heads,), generator=g) * 0.1 + 0.01 for _ in range(kv.num_layers)]
    qs = [torch.tensor([0.0123456 * (i + 1)]) for i in range(kv.num_layers)]
    stats = [
        {"layer": i, "k_amax": float(ks[i].max() * 448), "v_amax": float(vs[i].max() * 448),
         "k_clipped_fraction": 0.000123, "v_clipped_fraction": 0.001234, "k_sqnr_db": 31.5, "v_sqnr_db": 30.25}
        for i in range(kv.num_layers)
    ]  # fmt: skip
    ss = make_scale_set(
        "fp8_e4m3", "head", ks, vs, observer="minmax", binding=compute_binding(str(word_llama_dir), word_llama_dir, kv),
        layer_stats=stats, q_scales=qs,
    )  # fmt: skip
    path = save_scale_file(tmp_path / "s.safetensors", ss)

    proc = _kvcal("show", str(path))  # stdout is a pipe
    assert proc.returncode == 0, proc.stderr
    assert "…" not in proc.stdout
    header = next(ln for ln in proc.stdout.splitlines() if "K scale" in ln)
    assert len(header) > 80 and "Q scale" in header
    for i in range(kv.num_layers):
        k = ks[i].tolist()
        assert f"{min(k):.4g}–{max(k):.4g}" in proc.stdout
        assert f"{qs[i].item():.4g}" in proc.stdout

    code, out, _ = invoke(["show", str(path), "--json"])
    doc = json.loads(out)
    assert doc["q_scales"] == [q.tolist() for q in qs]


def test_a_skip_selector_that_selects_nothing_warns(tiny_llama_dir: Path, invoke: Invoke) -> None:
    """A Llama has no sliding-window layers: `--skip-layers sliding_window` is accepted (one selector serves many
    models) but says, once, that it keeps nothing in 16 bits; a selector that matches says nothing."""
    code, out, err = invoke(["capacity", str(tiny_llama_dir), "-f", "fp8", "--skip-layers", "sliding_window"])
    assert code == 0, err
    warnings = [ln for ln in err.splitlines() if ln.startswith("Warning: ")]
    assert warnings == [
        "Warning: --skip-layers 'sliding_window' selects no layer: this llama model has no sliding-attention "
        "layers, so that item keeps none in 16 bits"
    ], err
    code, _, err = invoke(["capacity", str(tiny_llama_dir), "-f", "fp8", "--skip-layers", "full_attention,0"])
    assert code == 0 and "Warning" not in err, err
