"""Engine cache dtypes kvcal cannot evaluate, as a user meets them on `kvcal capacity`: one `Error:` line naming the
reason (and the fix), exit 2, in a real process (the console-script path renders the error itself)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvcal.cli import app
from kvcal.errors import UsageError

runner = CliRunner()


def _config_dir(tmp_path: Path, head_dim: int) -> Path:
    d = tmp_path / f"llama-hd{head_dim}"
    d.mkdir()
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4 * head_dim,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": head_dim, "num_hidden_layers": 2,
        "intermediate_size": 64, "vocab_size": 320, "max_position_embeddings": 64,
    }  # fmt: skip
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _capacity(model: Path, fmt: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "from kvcal.cli import app; app()", "capacity", str(model), "-f", fmt],
        capture_output=True,
        text=True,
    )


def test_int4_on_a_non_power_of_two_head_dim_is_one_error_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "from kvcal.cli import app; app()", "capacity", str(_config_dir(tmp_path, 24)), "-f",
         "int4_per_token_head"],
        capture_output=True,
        text=True,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "power-of-two head_dim" in lines[0], proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize(
    ("fmt", "fragment"),
    [
        ("fp8_inc", "Intel Neural Compressor"),
        ("fp8_ds_mla", "DeepSeek MLA"),
    ],
)
def test_refused_format_names_the_reason(tmp_path: Path, fmt: str, fragment: str) -> None:
    result = runner.invoke(app, ["capacity", str(_config_dir(tmp_path, 64)), "-f", fmt])
    assert isinstance(result.exception, UsageError), result.output
    msg = str(result.exception)
    assert fragment in msg and "\n" not in msg


def test_new_formats_count_their_scale_bytes(tmp_path: Path) -> None:
    """vLLM's per-token-head page: data + one fp32 scale per (token, head) for K and V (head_dim 64, 2 KV heads,
    2 layers): fp8 2 x 2 x 2 x (64 + 4) = 544 bytes per token, int4 2 x 2 x 2 x (32 + 4) = 288, float16 1,024."""
    model = _config_dir(tmp_path, 64)
    for fmt, want in (("fp8_per_token_head", "544"), ("int4_per_token_head", "288"), ("float16", "1,024")):
        result = runner.invoke(app, ["capacity", str(model), "-f", fmt])
        assert result.exit_code == 0, result.output
        assert f" {want} " in result.output, result.output


def test_turboquant_capacity_and_its_refusals(tmp_path: Path) -> None:
    """`kvcal capacity -f turboquant_*`: vLLM's TurboQuant slot per KV head (head_dim 64, 2 KV heads, 2 layers,
    both boundary layers by vLLM's default: BF16, 1,024 bytes; --tq-boundary-layers 0: 2 x 2 x 70 = 280); a
    head_dim vLLM cannot rotate is one Error line naming the constraint (on a layer TurboQuant holds)."""
    model = _config_dir(tmp_path, 64)
    for extra, want in (([], "1,024"), (["--tq-boundary-layers", "0"], "280")):
        result = runner.invoke(app, ["capacity", str(model), "-f", "turboquant_4bit_nc", *extra])
        assert result.exit_code == 0, result.output
        assert f" {want} " in result.output, result.output
    result = runner.invoke(app, ["capacity", str(_config_dir(tmp_path, 96)), "-f", "turboquant_k8v4", "--tq-boundary-layers", "0"])
    assert isinstance(result.exception, UsageError), result.output
    msg = str(result.exception)
    assert "power-of-two head_dim" in msg and "\n" not in msg


def test_turboquant_has_nothing_to_calibrate(tmp_path: Path) -> None:
    result = runner.invoke(
        app, ["calibrate", str(_config_dir(tmp_path, 64)), "-f", "turboquant_k3v4_nc", "-o", str(tmp_path / "s")]
    )
    assert isinstance(result.exception, UsageError), result.output
    assert "nothing to calibrate" in str(result.exception) and "\n" not in str(result.exception)
