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
        ("turboquant_k8v4", "TurboQuant preset"),
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
