"""Calibration data: texts from a file, a folder, a hub dataset or kvcal's generated corpus -> seeded token samples.

Sources (`--dataset`):
- a `.jsonl`, `.json`, `.txt` or `.parquet` file; `.txt` holds one document per blank-line-separated paragraph
  (or per line when it has no blank lines);
- a folder of such files (e.g. ../shared/data/c4_calib, which holds the same rows as .parquet and .jsonl: one file
  per stem is read, preferring .jsonl, then .parquet, .json, .txt);
- a hub dataset id (where a hub is reachable; HF_DATASETS_OFFLINE is honoured), split `train`, `ID@SPLIT` picks
  another split;
- nothing / `builtin`: kvcal's generated corpus (`default_corpus`), no network.
Records: the text field is `--text-field` or the first of text/content/question/prompt holding strings; a chat
record (`messages`: [{role, content}, ...]) is rendered with the tokenizer's chat template when it has one.

Sampling: the texts are shuffled with `random.Random(seed)`; each of the first `num_samples` non-empty texts
becomes one sample, tokenized with the model's special tokens and truncated to `seq_len` tokens (llm-compressor's
recipe). `token_sha256` hashes the samples (per sample: length then ids, little-endian int64), so two runs on the
same token sequences can be recognised from their manifests.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvcal.errors import KvcalError, UsageError

if TYPE_CHECKING:
    from kvcal.models.loading import LoadedModel

TEXT_FIELDS = ("text", "content", "question", "prompt")
DATA_SUFFIXES = (".jsonl", ".parquet", ".json", ".txt")  # preference order inside a folder
BUILTIN = "builtin"


@dataclass
class TextSource:
    records: list[Any]  # str or dict
    description: str  # for the manifest: path / hub id / builtin


@dataclass
class CalibrationSamples:
    """Token sequences to calibrate on: each 1-D int64 [T <= seq_len]."""

    samples: list[torch.Tensor]
    source: str
    text_field: str | None
    seq_len: int
    seed: int
    requested: int
    available_texts: int
    warnings: list[str] = field(default_factory=list)

    @property
    def num_samples(self) -> int:
        return len(self.samples)

    @property
    def num_tokens(self) -> int:
        return int(sum(s.numel() for s in self.samples))

    @property
    def token_sha256(self) -> str:
        return token_sha256(self.samples)

    def manifest(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "text_field": self.text_field,
            "num_samples": self.num_samples,
            "requested_samples": self.requested,
            "seq_len": self.seq_len,
            "seed": self.seed,
            "num_tokens": self.num_tokens,
            "token_ids_sha256": self.token_sha256,
        }


def token_sha256(samples: Sequence[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for s in samples:
        ids = s.detach().cpu().to(torch.int64).flatten()
        h.update(int(ids.numel()).to_bytes(8, "little"))
        h.update(ids.numpy().astype("<i8").tobytes())
    return h.hexdigest()


# ----- reading records -----


def _read_jsonl(path: Path) -> list[Any]:
    out = []
    # decoded whole: a UnicodeDecodeError then carries the byte offset in the file
    for n, line in enumerate(path.read_text(encoding="utf-8-sig").split("\n"), 1):
        line = line.strip()
        if not line:
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise KvcalError(f"{path}:{n} is not valid JSON ({exc.msg}); fix or remove that line") from exc
    return out


def _read_json(path: Path) -> list[Any]:
    try:
        obj = json.loads(path.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as exc:
        raise KvcalError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno})") from exc
    if isinstance(obj, list):
        return obj
    if isinstance(obj, dict):
        # {"data": [...]} / {"rows": [...]}: the first list of records; or a column dict {"text": [...]}
        for value in obj.values():
            if isinstance(value, list) and value and isinstance(value[0], dict | str):
                return value
        cols = {k: v for k, v in obj.items() if isinstance(v, list)}
        if cols:
            n = min(len(v) for v in cols.values())
            return [{k: v[i] for k, v in cols.items()} for i in range(n)]
    raise KvcalError(f'{path} holds no list of records; expected [{{...}}, ...] or {{"data": [...]}}')


def _read_txt(path: Path) -> list[Any]:
    text = path.read_text(encoding="utf-8-sig")
    paras = [p.strip() for p in text.split("\n\n") if p.strip()]
    if len(paras) <= 1:
        paras = [line.strip() for line in text.splitlines() if line.strip()]
    return paras


def _read_parquet(path: Path) -> list[Any]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise UsageError(
            "reading .parquet needs pyarrow (pip install pyarrow), or pass a .jsonl copy"
        ) from exc
    try:
        return pq.read_table(path).to_pylist()
    except UnicodeDecodeError:
        raise  # a string column that is not UTF-8: _read names the file and the fix
    except Exception as exc:  # pyarrow raises its own ArrowInvalid / OSError family
        raise KvcalError(f"cannot read parquet file {path}: {str(exc).splitlines()[0]}") from exc


_READERS = {".jsonl": _read_jsonl, ".json": _read_json, ".txt": _read_txt, ".parquet": _read_parquet}


def _read(path: Path) -> list[Any]:
    """The records of one dataset file; KvcalError naming the file when its text is not UTF-8."""
    try:
        return _READERS[path.suffix.lower()](path)
    except UnicodeDecodeError as exc:
        if path.suffix.lower() == ".parquet":
            where, fix = "a string column holds bytes that are not UTF-8", "rewrite its text columns as UTF-8"
        else:
            where = f"byte 0x{exc.object[exc.start]:02x} at offset {exc.start} is not UTF-8"
            fix = "re-encode it as UTF-8 (e.g. iconv -f <its encoding> -t utf-8)"
        raise KvcalError(
            f"dataset file '{path}' is not UTF-8 text ({where}); {fix} and pass the converted file"
        ) from None


def _check_not_empty(records: list[Any], what: str) -> None:
    if not any(r is not None for r in records):
        raise KvcalError(
            f"{what} holds no records; give it at least one text, or drop --dataset for the built-in corpus"
        )


def _folder_files(folder: Path) -> list[Path]:
    by_stem: dict[str, Path] = {}
    for path in sorted(folder.iterdir()):
        if path.suffix.lower() not in _READERS or path.name.startswith(".") or path.stem.upper() == "README":
            continue
        best = by_stem.get(path.stem)
        if best is None or DATA_SUFFIXES.index(path.suffix.lower()) < DATA_SUFFIXES.index(
            best.suffix.lower()
        ):
            by_stem[path.stem] = path
    return [by_stem[k] for k in sorted(by_stem)]


def load_texts(dataset: str | Path | None, default_docs: int = 512) -> TextSource:
    """Raw records (str or dict) from a file, folder, hub id, or the built-in generated corpus (seed 0). A file that
    is not UTF-8 or holds no records is a KvcalError naming it."""
    if dataset is None or str(dataset) == BUILTIN:
        from kvcal.calibrate.default_corpus import generate_corpus

        return TextSource(
            generate_corpus(default_docs, seed=0), f"{BUILTIN} (kvcal generated corpus, seed 0)"
        )
    ds = str(dataset)
    path = Path(ds).expanduser()
    if path.is_file():
        reader = _READERS.get(path.suffix.lower())
        if reader is None:
            raise UsageError(
                f"dataset file '{ds}' has an unsupported extension; use .jsonl, .json, .txt or .parquet"
            )
        records = _read(path)
        _check_not_empty(records, f"dataset file '{path}'")
        return TextSource(records, str(path))
    if path.is_dir():
        files = _folder_files(path)
        if not files:
            raise UsageError(f"dataset folder '{ds}' holds no .jsonl/.json/.txt/.parquet files")
        records: list[Any] = []
        for f in files:
            records.extend(_read(f))
        names = ", ".join(f.name for f in files)
        _check_not_empty(records, f"dataset folder '{path}' ({names})")
        return TextSource(records, f"{path} ({names})")
    if ds.startswith((".", "/", "~")) or Path(ds).suffix.lower() in _READERS or ds.count("/") > 1:
        raise UsageError(f"dataset path '{ds}' does not exist")
    return _load_hub(ds)


def _load_hub(ds: str) -> TextSource:
    repo, _, split = ds.partition("@")
    try:
        import datasets

        data = datasets.load_dataset(repo, split=split or "train")
    except Exception as exc:  # offline / unknown id / gated: the datasets library raises many classes
        raise UsageError(
            f"dataset '{ds}' is not a local file or folder and cannot be loaded from the hub "
            f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); pass a local .jsonl/.parquet/.txt"
        ) from exc
    return TextSource(list(data), f"hub:{repo}@{split or 'train'}")


# ----- records -> texts -----


def _is_chat(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
    )


def _render_chat(messages: list[dict[str, Any]], tokenizer: Any) -> str:
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return str(tokenizer.apply_chat_template(messages, tokenize=False))
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


def choose_field(records: Sequence[Any], text_field: str | None) -> str | None:
    """The field holding the text (None for plain-string records); UsageError naming the fields found."""
    sample = [r for r in records[:100] if r is not None]
    if not sample:
        raise KvcalError("the dataset is empty")
    if all(isinstance(r, str) for r in sample):
        if text_field:
            raise UsageError(
                f"--text-field '{text_field}' given but the dataset holds plain strings, not records"
            )
        return None
    dicts = [r for r in sample if isinstance(r, dict)]
    if not dicts:
        raise KvcalError(f"dataset records are {type(sample[0]).__name__}, expected objects or strings")
    fields: list[str] = []
    for r in dicts:
        fields.extend(k for k in r if k not in fields)
    if text_field:
        if text_field not in fields:
            raise UsageError(
                f"text field '{text_field}' not in the dataset; fields found: {', '.join(fields)}"
            )
        return text_field
    if "messages" in fields and any(_is_chat(r.get("messages")) for r in dicts):
        return "messages"
    for name in TEXT_FIELDS:
        if name in fields and any(isinstance(r.get(name), str) and r.get(name).strip() for r in dicts):
            return name
    raise UsageError(
        f"no usable text field in the dataset (looked for {', '.join(TEXT_FIELDS)} or chat 'messages'); "
        f"fields found: {', '.join(fields) or 'none'}; pass --text-field NAME"
    )


def record_text(record: Any, text_field: str | None, tokenizer: Any) -> str:
    if text_field is None:
        return record if isinstance(record, str) else ""
    if not isinstance(record, dict):
        return ""
    value = record.get(text_field)
    if _is_chat(value):
        return _render_chat(value, tokenizer)
    return value if isinstance(value, str) else ""


# ----- sampling -----


def max_model_len(config: Any) -> int | None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "max_position_embeddings", None)


def check_sampling(num_samples: int, seq_len: int) -> None:
    """UsageError for a sample count or length that cannot sample anything (the model's limit is checked with it)."""
    if num_samples < 1:
        raise UsageError(f"--num-samples must be at least 1, got {num_samples}")
    if seq_len < 1:
        raise UsageError(f"--seq-len must be at least 1, got {seq_len}")


def build_samples(
    source: TextSource,
    tokenizer: Any,
    num_samples: int,
    seq_len: int,
    seed: int = 0,
    text_field: str | None = None,
    max_len: int | None = None,
) -> CalibrationSamples:
    """Seeded sampling of `num_samples` token sequences of up to `seq_len` tokens, one text each."""
    check_sampling(num_samples, seq_len)
    if max_len is not None and seq_len > max_len:
        raise UsageError(f"--seq-len {seq_len} exceeds the model's maximum of {max_len} positions; lower it")
    fld = choose_field(source.records, text_field)
    order = list(range(len(source.records)))
    random.Random(seed).shuffle(order)
    samples: list[torch.Tensor] = []
    usable = 0
    chat = fld == "messages" or (fld is not None and _is_chat_field(source.records, fld))
    for i in order:
        text = record_text(source.records[i], fld, tokenizer)
        if not text.strip():
            continue
        usable += 1
        # a rendered chat template already carries the BOS token
        enc = tokenizer(text, add_special_tokens=not chat, truncation=True, max_length=seq_len)
        ids = torch.tensor(enc["input_ids"][:seq_len], dtype=torch.int64)
        if ids.numel() == 0:
            continue
        samples.append(ids)
        if len(samples) == num_samples:
            break
    if not samples:
        raise KvcalError(f"dataset {source.description} has no non-empty text in field '{fld}'")
    warnings = []
    if len(samples) < num_samples:
        warnings.append(
            f"the dataset has only {len(samples)} usable texts; calibrating on {len(samples)} samples "
            f"instead of {num_samples}"
        )
    return CalibrationSamples(
        samples=samples,
        source=source.description,
        text_field=fld,
        seq_len=seq_len,
        seed=seed,
        requested=num_samples,
        available_texts=usable,
        warnings=warnings,
    )


def samples_for_model(
    source: TextSource,
    lm: LoadedModel,
    num_samples: int,
    seq_len: int,
    seed: int = 0,
    text_field: str | None = None,
) -> CalibrationSamples:
    """`build_samples` with the model's tokenizer and its position limit (--seq-len beyond it is refused)."""
    return build_samples(
        source, lm.tokenizer, num_samples, seq_len, seed=seed, text_field=text_field,
        max_len=max_model_len(lm.model.config),
    )  # fmt: skip


def _is_chat_field(records: Sequence[Any], fld: str) -> bool:
    return any(isinstance(r, dict) and _is_chat(r.get(fld)) for r in records[:100])
