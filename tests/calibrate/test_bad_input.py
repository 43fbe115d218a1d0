"""Bad input to `kvcal calibrate` and `kvcal sensitivity` ends in one `Error:` line that names the problem and the
fix — never a traceback — and leaves nothing behind: datasets that are not UTF-8 or hold nothing, output paths that
cannot be created, a --seq-len beyond the model's positions, a device this machine lacks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

Invoke = Callable[[list[str]], tuple[int, str, str]]  # the `invoke` fixture of tests/conftest.py

pytestmark = pytest.mark.usefixtures("one_thread")

LATIN1 = "café au lait, crème brûlée\n".encode("latin-1")  # 0xe9 at offset 3: not UTF-8
SMALL = ["--num-samples", "2", "--seq-len", "8"]


def _error_line(invoke: Invoke, args: list[str]) -> tuple[int, str]:
    code, _out, err = invoke(args)
    lines = [ln for ln in err.splitlines() if ln.startswith("Error: ")]
    assert "Traceback" not in err and len(lines) == 1, err
    return code, lines[0]


def _latin1_parquet(path: Path) -> Path:
    # pyarrow refuses to build a string column from non-UTF-8 bytes, so the bytes of a binary column are
    # re-labelled as strings: what a file written by a careless tool holds
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    raw = pa.array([LATIN1, b"plain ascii text"], type=pa.binary())
    strings = pa.Array.from_buffers(pa.string(), len(raw), raw.buffers())
    pq.write_table(pa.table({"text": strings}), path)
    return path


def _non_utf8_datasets(tmp_path: Path) -> dict[str, Path]:
    """name -> a dataset path whose bad file is the one the error must name."""
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "good.jsonl").write_text('{"text": "fine"}\n', encoding="utf-8")
    (folder / "part.jsonl").write_bytes(b'{"text": "' + LATIN1.strip() + b'"}\n')
    files = {
        "rows.jsonl": b'{"text": "ok"}\n{"text": "' + LATIN1.strip() + b'"}\n',
        "rows.json": b'[{"text": "' + LATIN1.strip() + b'"}]',
        "rows.txt": LATIN1 + b"\nsecond paragraph\n",
    }
    out = {}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        out[name] = tmp_path / name
    out["rows.parquet"] = _latin1_parquet(tmp_path / "rows.parquet")
    out["folder"] = folder
    return out


def test_non_utf8_dataset_names_the_file(invoke: Invoke, tiny_llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "s.safetensors"
    for name, path in _non_utf8_datasets(tmp_path).items():
        bad = path / "part.jsonl" if name == "folder" else path
        code, msg = _error_line(
            invoke,
            ["calibrate", str(tiny_llama_dir), "-f", "fp8", "--dataset", str(path), *SMALL, "-o", str(out)],
        )
        assert (
            code == 1
            and f"'{bad}'" in msg
            and "not UTF-8" in msg
            and "as UTF-8" in msg
            and "pass the converted file" in msg
        ), (name, msg)
        if name != "rows.parquet":  # the byte and where it is
            assert "0xe9" in msg, msg
    assert not out.exists()
    code, msg = _error_line(
        invoke,
        ["sensitivity", str(tiny_llama_dir), "-f", "fp8", "--dataset", str(tmp_path / "rows.jsonl"), *SMALL],
    )
    assert code == 1 and "rows.jsonl' is not UTF-8" in msg


def test_empty_dataset_names_the_file(invoke: Invoke, tiny_llama_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("\n\n")
    (tmp_path / "empty.json").write_text("[]")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "nulls.json").write_text("[null, null]")
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "a.jsonl").write_text("")
    out = tmp_path / "s.safetensors"
    for name in ("empty.jsonl", "empty.json", "empty.txt", "nulls.json", "folder"):
        path = tmp_path / name
        code, msg = _error_line(
            invoke,
            ["calibrate", str(tiny_llama_dir), "-f", "fp8", "--dataset", str(path), *SMALL, "-o", str(out)],
        )
        assert (
            code == 1 and f"'{path}'" in msg and "holds no records" in msg and "at least one text" in msg
        ), msg
    assert not out.exists()
    code, msg = _error_line(
        invoke, ["sensitivity", str(tiny_llama_dir), "-f", "fp4_e2m1", "--dataset", str(folder), *SMALL]
    )
    assert code == 1 and f"'{folder}' (a.jsonl) holds no records" in msg


def test_output_that_cannot_be_created(invoke: Invoke, tiny_llama_dir: Path, tmp_path: Path) -> None:
    too_long = tmp_path / ("x" * 300) / "s.safetensors"  # a folder name over the file system's 255 bytes
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for command, name in (("calibrate", "s.safetensors"), ("sensitivity", "s.json")):
        for target in (too_long.parent / name, blocker / "sub" / name):
            code, msg = _error_line(
                invoke, [command, str(tiny_llama_dir), "-f", "fp8", *SMALL, "-o", str(target)]
            )
            assert code == 2 and f"cannot write '{target}'" in msg and "choose another -o path" in msg, msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # no folder left behind


def test_output_folder_is_created_only_by_a_finished_run(
    invoke: Invoke, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "new" / "deeper" / "s.json"
    code, msg = _error_line(
        invoke, ["sensitivity", str(tiny_llama_dir), "-f", "fp8", "--seq-len", "65", "-o", str(out)]
    )
    assert code == 2 and not (tmp_path / "new").exists()  # the write probe cleaned up after itself
    code, _stdout, err = invoke(
        ["sensitivity", str(tiny_llama_dir), "-f", "fp4_e2m1", *SMALL, "-o", str(out), "--json"]
    )
    assert code == 0 and out.is_file(), err


def test_seq_len_beyond_the_model_names_the_limit(
    invoke: Invoke, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    for command in ("calibrate", "sensitivity"):
        code, msg = _error_line(
            invoke,
            [command, str(tiny_llama_dir), "-f", "fp8", "--num-samples", "2", "--seq-len", "65",
             "-o", str(tmp_path / f"{command}.out")],
        )  # fmt: skip
        assert code == 2 and "--seq-len 65" in msg and "maximum of 64" in msg, msg
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda(invoke: Invoke, tiny_llama_dir: Path, tmp_path: Path) -> None:
    for command in ("calibrate", "sensitivity"):
        code, msg = _error_line(
            invoke,
            [
                command,
                str(tiny_llama_dir),
                "-f",
                "fp8",
                *SMALL,
                "--device",
                "cuda",
                "-o",
                str(tmp_path / "o"),
            ],
        )
        assert code == 2 and "--device cuda" in msg and "--device cpu" in msg, msg
    assert not list(tmp_path.iterdir())
