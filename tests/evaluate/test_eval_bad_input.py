"""Bad input a new user runs into, through the `kvcal eval` command line: each one is a single `Error:` line
(exit 2) before a model loads or the run directory is written, never a traceback or a silently wrong run.

Files eval reads (--data-dir, --include-path YAMLs and their data), paths it writes (-o), the device, lengths the
model's config bounds, and checkpoints kvcal will not load (pickled weights only; code of their own).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

Invoke = Callable[[list[str]], tuple[int, str, str]]
CORPUS = ["the cat sat on the mat and the dog sat on the log", "one two three four five six seven eight"]
LATIN1 = "caf\u00e9 cr\u00e8me br\u00fbl\u00e9e\n".encode(
    "latin-1"
)  # not UTF-8: 0xe9 starts a 3-byte sequence


@pytest.fixture(scope="module")
def model(tiny_lm_dir: Callable[..., Path]) -> Path:
    return tiny_lm_dir("llama", CORPUS)  # max_position_embeddings 256


def _eval(invoke: Invoke, model: Path | str, out: Path, *extra: str) -> tuple[int, str]:
    code, _stdout, err = invoke(["eval", str(model), "--kv-format", "auto", "-o", str(out), *extra])
    return code, err


def _refused(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), err
    for needle in needles:
        assert needle in lines[0], err


# ---- files eval reads ------------------------------------------------------------------------------------


def test_non_utf8_data_dir_files(invoke: Invoke, model: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "wikitext2").mkdir(parents=True)
    (data / "wikitext2" / "wiki.test.joined.txt").write_bytes(LATIN1 * 50)
    code, err = _eval(invoke, model, tmp_path / "run", "--tasks", "kl", "--data-dir", str(data))
    _refused(code, err, "wiki.test.joined.txt", "not UTF-8", "offset 3")
    (data / "wikitext2" / "test.jsonl").write_bytes(b'{"text": "' + LATIN1.strip() + b'"}\n')
    code, err = _eval(invoke, model, tmp_path / "run", "--tasks", "wikitext", "--data-dir", str(data))
    _refused(code, err, "test.jsonl", "not UTF-8")
    (data / "wikitext2" / "test.jsonl").write_text('{"text": "fine"}\n{"title": "no text field"}\n')
    code, err = _eval(invoke, model, tmp_path / "run", "--tasks", "wikitext", "--data-dir", str(data))
    _refused(code, err, "line 2", "'text'")
    (data / "gsm8k").mkdir()
    (data / "gsm8k" / "train.jsonl").write_text('{"question": "q", "answer": "a"}\n')
    (data / "gsm8k" / "test.jsonl").write_text('{"question": "q", "answer": "a"}\nnot json\n')
    code, err = _eval(invoke, model, tmp_path / "run", "--tasks", "gsm8k", "--data-dir", str(data))
    _refused(code, err, "line 2", "gsm8k", "not JSON")
    assert not (tmp_path / "run").exists()


def test_non_utf8_include_path_files(invoke: Invoke, model: Path, tmp_path: Path) -> None:
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "mine.yaml").write_bytes(b"task: mine\n# " + LATIN1)
    code, err = _eval(invoke, model, tmp_path / "run", "--tasks", "mine", "--include-path", str(tasks))
    _refused(code, err, "mine.yaml", "not UTF-8")
    (tasks / "data.jsonl").write_bytes(b'{"text": "' + LATIN1.strip() + b'"}\n')
    (tasks / "mine.yaml").write_text(
        f"task: mine\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tasks / 'data.jsonl'}\n"
        'test_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n"
    )
    code, err = _eval(invoke, model, tmp_path / "run", "--tasks", "mine", "--include-path", str(tasks))
    _refused(code, err, "data.jsonl", "data of task 'mine'", "not UTF-8")
    assert not (tmp_path / "run").exists()


# ---- paths eval writes -----------------------------------------------------------------------------------


def test_output_that_cannot_be_created(invoke: Invoke, model: Path, tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("x")
    code, err = _eval(invoke, model, tmp_path / "a-file" / "run", "--tasks", "kl")
    _refused(code, err, "cannot create the run directory", "a-file")
    code, err = _eval(invoke, model, Path("/proc/kvcal-no-such-dir/run"), "--tasks", "kl")
    _refused(code, err, "cannot create the run directory")


# ---- the device and the lengths the model bounds ------------------------------------------------------------


def test_devices_this_machine_lacks(invoke: Invoke, model: Path, tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        for device in ("cuda", "cuda:7"):
            code, err = _eval(invoke, model, tmp_path / "run", "--tasks", "kl", "--device", device)
            _refused(code, err, f"--device {device}", "no usable CUDA GPU", "--device cpu")
    else:
        count = torch.cuda.device_count()
        code, err = _eval(invoke, model, tmp_path / "run", "--tasks", "kl", "--device", f"cuda:{count}")
        _refused(code, err, f"has {count} CUDA GPU(s)")
    if not torch.backends.mps.is_available():
        code, err = _eval(invoke, model, tmp_path / "run", "--tasks", "kl", "--device", "mps")
        _refused(code, err, "Metal", "--device cpu")
    code, err = _eval(invoke, model, tmp_path / "run", "--tasks", "kl", "--device", "gpu0")
    _refused(code, err, "unknown --device 'gpu0'", "cuda:N")
    assert not (tmp_path / "run").exists()


def test_lengths_beyond_the_models_positions(invoke: Invoke, model: Path, tmp_path: Path) -> None:
    code, err = _eval(invoke, model, tmp_path / "run", "--tasks", "kl", "--kl-seq-len", "1000")
    _refused(code, err, "--kl-seq-len 1000", "256 positions", "max_position_embeddings")
    code, err = _eval(invoke, model, tmp_path / "run", "--tasks", "kl", "--kl-seq-len", "1")
    _refused(code, err, "--kl-seq-len", "at least 2")
    code, err = _eval(invoke, model, tmp_path / "run", "--tasks", "divergence", "--max-gen-toks", "256")
    _refused(code, err, "--max-gen-toks 256", "256 positions")
    code, err = _eval(invoke, model, tmp_path / "run", "--tasks", "kl", "--max-gen-toks", "8")
    _refused(code, err, "--max-gen-toks", "kl generates nothing")  # an option no task asked for uses
    assert not (tmp_path / "run").exists()


# ---- checkpoints kvcal will not load as they are ------------------------------------------------------------


def test_checkpoint_with_pickled_weights_only(invoke: Invoke, model: Path, tmp_path: Path) -> None:
    folder = tmp_path / "bin-only"
    shutil.copytree(model, folder)
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"not loaded: kvcal never unpickles")
    code, err = _eval(invoke, folder, tmp_path / "run", "--tasks", "kl")
    _refused(code, err, "pytorch_model.bin", "pickled", "safetensors")
    assert not (tmp_path / "run").exists()


def test_checkpoint_with_code_of_its_own(invoke: Invoke, model: Path, tmp_path: Path) -> None:
    from kvcal.models.config import check_remote_code

    folder = tmp_path / "custom"
    shutil.copytree(model, folder)
    cfg = json.loads((folder / "config.json").read_text())
    auto_map = {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    (folder / "config.json").write_text(
        json.dumps({**cfg, "model_type": "kvcal_custom", "auto_map": auto_map})
    )
    code, err = _eval(invoke, folder, tmp_path / "run", "--tasks", "kl")
    _refused(code, err, "its own Python code", "configuration_x.XConfig", "--trust-remote-code")
    assert not (tmp_path / "run").exists()
    check_remote_code(folder / "config.json", str(folder), trust_remote_code=True)  # asked for: no objection
    # a type transformers ships keeps its auto_map for older versions; transformers' own code loads it
    (folder / "config.json").write_text(json.dumps({**cfg, "auto_map": auto_map}))
    check_remote_code(folder / "config.json", str(folder), trust_remote_code=False)
