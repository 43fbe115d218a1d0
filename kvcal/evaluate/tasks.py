"""Task resolution: lm-eval's own task configs, pointed at local files when `--data-dir` is given.

Prompts, few-shot, filters and metrics stay exactly lm-eval's: we load the task YAML that ships inside lm-eval
(includes resolved, `!function` hooks imported by lm-eval's own loader) and change only where the data comes from:

- `openai/gsm8k`, `math-ai/aime25`  -> `dataset_path: json` + `dataset_kwargs.data_files` (local JSON Lines).
- `EleutherAI/wikitext_document_level` -> the same documents rebuilt in memory from the local HF-row copy
  (`custom_dataset`, see `wikitext_documents`).
- `Idavidrein/gpqa` -> the official password-protected zip, read in memory (`custom_dataset`); the CSV never
  touches the disk.

The resulting dicts go to lm-eval's TaskManager as inline configs (a dict with an `include:` key is rejected by
lm-eval, so includes are resolved here). Every lm-eval task is loaded straight from its YAML file (names come from
a cached line scan, `lm_eval_task_index`), so no run pays ~30 s for lm-eval's TaskManager to parse its ~14k task
files; only groups and tags (which lm-eval expands itself) use lm-eval's full index.
"""

from __future__ import annotations

import csv
import difflib
import io
import json
import os
import re
import zipfile
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from kvcal.errors import KvcalError, UsageError
from kvcal.io import jsonl_lines
from kvcal.tasknames import DIVERGENCE_TASKS, KL_TASK, OWN_TASKS, PASSKEY_TASKS  # the registry, re-exported

# kl's held-out text inside --data-dir (kvcal.evaluate.kl reads it; checked here with the other data files).
KL_TEXT_FILE = Path("wikitext2") / "wiki.test.joined.txt"
GPQA_PASSWORD_ENV = "KVCAL_GPQA_PASSWORD"

# Task names kvcal knows without indexing lm-eval: name -> YAML path relative to lm_eval/tasks.
BUILTIN_YAML: dict[str, str] = {
    "gsm8k": "gsm8k/gsm8k.yaml",
    "gsm8k_cot": "gsm8k/gsm8k-cot.yaml",
    "aime25": "aime/aime25.yaml",
    "gpqa_diamond_zeroshot": "gpqa/zeroshot/gpqa_diamond_zeroshot.yaml",
    "gpqa_diamond_n_shot": "gpqa/n_shot/gpqa_diamond_n_shot.yaml",
    "gpqa_diamond_cot_zeroshot": "gpqa/cot_zeroshot/gpqa_diamond_cot_zeroshot.yaml",
    "gpqa_diamond_cot_n_shot": "gpqa/cot_n_shot/gpqa_diamond_cot_n_shot.yaml",
    "gpqa_diamond_generative_n_shot": "gpqa/generative/gpqa_diamond_generative_n_shot.yaml",
    "wikitext": "wikitext/wikitext.yaml",
}
# Short names people type (the README says `gpqa_diamond`); lm-eval has no task of that name.
ALIASES: dict[str, str] = {
    "gpqa_diamond": "gpqa_diamond_zeroshot",
    "gpqa_diamond_cot": "gpqa_diamond_cot_zeroshot",
}

# Hub dataset id -> the folder of ../shared/data that stands in for it.
DATA_FOLDERS: dict[str, str] = {
    "openai/gsm8k": "gsm8k",
    "math-ai/aime25": "aime2025",
    "Idavidrein/gpqa": "gpqa",
    "EleutherAI/wikitext_document_level": "wikitext2",
}


@dataclass
class TaskPlan:
    """What a run evaluates: lm-eval specs (names or inline config dicts) and whether kvcal's `kl` runs."""

    names: list[str]  # canonical names in the user's order (incl. 'kl')
    lm_eval_specs: dict[str, str | dict[str, Any]] = field(default_factory=dict)  # name -> spec
    include_path: str | None = None
    private: set[str] = field(default_factory=set)  # tasks whose docs must never be written in plain text

    @property
    def has_kl(self) -> bool:
        return KL_TASK in self.names

    @property
    def has_passkey(self) -> bool:
        return any(name in PASSKEY_TASKS for name in self.names)


def lm_eval_tasks_dir() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent


def load_task_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A task YAML with its includes merged and `!function` hooks imported (lm-eval's own loader)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    return load_yaml(Path(path), resolve_func=True, recursive=True)


def parse_task_list(tasks: str | list[str]) -> list[str]:
    items = tasks.split(",") if isinstance(tasks, str) else [t for s in tasks for t in str(s).split(",")]
    names = [t.strip() for t in items if t.strip()]
    if not names:
        raise UsageError("--tasks is empty; name at least one task, e.g. --tasks wikitext,kl")
    seen: list[str] = []
    for name in names:
        canon = ALIASES.get(name, name)
        if canon not in seen:
            seen.append(canon)
    return seen


@lru_cache(maxsize=4)
def _task_manager(include_path: str | None, include_defaults: bool) -> Any:
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, include_defaults=include_defaults)


def task_manager_for(plan: TaskPlan) -> Any:
    """The TaskManager simple_evaluate should use: the full lm-eval index only when a task needs it."""
    user = _include_names(plan.include_path)
    needs_index = any(isinstance(spec, str) and spec not in user for spec in plan.lm_eval_specs.values())
    return _task_manager(plan.include_path, needs_index)


def _include_names(include_path: str | None) -> set[str]:
    if not include_path:
        return set()
    tm = _task_manager(include_path, False)
    return set(tm.all_tasks) | set(tm.all_groups) | set(tm.all_tags)


def resolve_tasks(
    tasks: str | list[str],
    *,
    include_path: str | os.PathLike[str] | None = None,
    data_dir: str | os.PathLike[str] | None = None,
    gpqa_password: str | None = None,
    own_prompts: bool = False,
) -> TaskPlan:
    """Turn `--tasks a,b` into lm-eval specs (`own_prompts`: a divergence task reads --prompts, not its lm-eval
    task). Unknown names -> UsageError with close matches; files missing
    from --data-dir or not UTF-8 -> UsageError naming the path; GPQA from --data-dir without a password ->
    UsageError."""
    names = parse_task_list(tasks)
    inc, ddir = _checked_folders(include_path, data_dir)
    user_names = _include_names(inc)
    plan = TaskPlan(names=names, include_path=inc)
    unknown: list[str] = []
    for name in names:
        if name == KL_TASK:
            if ddir is not None:
                read_text_file(_require(ddir / KL_TEXT_FILE, KL_TASK), f"task '{KL_TASK}'")
        elif name in PASSKEY_TASKS:  # its lm-eval config is built with the model's tokenizer (run_eval)
            if ddir is not None:
                read_text_file(_require(ddir / KL_TEXT_FILE, name), f"task '{name}'")
        elif name in DIVERGENCE_TASKS and own_prompts:  # --prompts: the user's file, checked by the spec
            continue
        elif name in DIVERGENCE_TASKS:  # its prompts are its source task's lm-eval requests
            _add_lm_eval_task(plan, DIVERGENCE_TASKS[name], ddir, gpqa_password)
            if DIVERGENCE_TASKS[name] in plan.private:
                plan.private.add(name)
        elif name in user_names:
            _check_user_data_files(inc, name)
            plan.lm_eval_specs[name] = name  # the user's YAML, exactly as lm_eval --include_path
        elif not _add_lm_eval_task(plan, name, ddir, gpqa_password):
            unknown.append(name)
    if unknown:
        raise UsageError(_unknown_tasks_message(unknown, user_names))
    return plan


def _checked_folders(
    include_path: str | os.PathLike[str] | None, data_dir: str | os.PathLike[str] | None
) -> tuple[str | None, Path | None]:
    """(--include-path resolved, --data-dir) after checking both are folders and the task YAMLs are UTF-8."""
    inc = None
    if include_path is not None:
        inc_p = Path(include_path)
        if not inc_p.is_dir():
            raise UsageError(
                f"--include-path '{include_path}' is not a folder; pass the folder of your task YAMLs"
            )
        inc = str(inc_p.resolve())
        for path in sorted(p for pattern in ("*.yaml", "*.yml") for p in inc_p.rglob(pattern)):
            read_text_file(path, "a task YAML of --include-path")
    ddir = Path(data_dir) if data_dir is not None else None
    if ddir is not None and not ddir.is_dir():
        raise UsageError(
            f"--data-dir '{data_dir}' is not a folder; pass the folder laid out like ../shared/data"
        )
    return inc, ddir


def _add_lm_eval_task(plan: TaskPlan, name: str, ddir: Path | None, gpqa_password: str | None) -> bool:
    """Add lm-eval's task (or group / tag) `name` to the plan, its data pointed at --data-dir; False if unknown."""
    if name in BUILTIN_YAML:
        yaml_path = lm_eval_tasks_dir() / BUILTIN_YAML[name]
    else:
        entry = lm_eval_task_index().get(name)
        if entry is None:
            return False
        kind, rel = entry
        if kind != "task":  # a group or tag: lm-eval builds it by name from its full index
            plan.lm_eval_specs[name] = name
            return True
        yaml_path = lm_eval_tasks_dir() / rel
    cfg = load_task_yaml(yaml_path)
    if cfg.get("dataset_path") == "Idavidrein/gpqa":
        plan.private.add(name)
    if ddir is not None:
        cfg = offline_config(cfg, ddir, gpqa_password=gpqa_password)
    plan.lm_eval_specs[name] = cfg
    return True


def _unknown_tasks_message(unknown: list[str], user_names: set[str]) -> str:
    known = sorted(
        set(BUILTIN_YAML)
        | set(ALIASES)
        | OWN_TASKS
        | user_names
        | set(lm_eval_task_index())
    )
    parts = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=4, cutoff=0.6)
        parts.append(f"'{name}'" + (f" (did you mean {', '.join(close)}?)" if close else ""))
    return f"unknown task {'; '.join(parts)}; use an lm-eval task name, kl, passkey, passkey_mc, or a task of --include-path"


_NAME_LINE = re.compile(r"^(task|group|tag):[ \t]*([^#\n]*)$", re.M)
_LIST_ITEM = re.compile(r"^[ \t]+-[ \t]*([^#\n\s]+)")


@lru_cache(maxsize=1)
def lm_eval_task_index() -> dict[str, tuple[str, str]]:
    """name -> (kind 'task'|'group'|'tag', YAML path relative to lm_eval/tasks) for every task lm-eval ships.

    A line scan of the YAML files (lm-eval's TaskManager parses all ~14k of them, which costs ~30 s on a small
    machine); cached per lm-eval version under kvcal's cache folder. Only names come from the scan: a task is
    still loaded by lm-eval's own YAML loader."""
    import importlib.metadata as md

    version = md.version("lm-eval")
    cache = _cache_dir() / f"lm_eval_tasks-{version}.json"
    try:
        cached = json.loads(cache.read_text()) if cache.is_file() else None
        if isinstance(cached, dict):
            return {k: (v[0], v[1]) for k, v in cached.items()}
    except (OSError, ValueError, IndexError):
        pass
    root = lm_eval_tasks_dir()
    index: dict[str, tuple[str, str]] = {}
    for path in sorted(root.rglob("*.yaml")):
        try:
            text = path.read_text(encoding="utf-8", errors="ignore")
        except OSError:
            continue
        rel = str(path.relative_to(root))
        lines = text.splitlines()
        for m in _NAME_LINE.finditer(text):
            kind, value = m.group(1), m.group(2).strip().strip("'\"")
            values = [value] if value and not value.startswith("[") else []
            if value.startswith("["):
                values = [v.strip().strip("'\"") for v in value.strip("[]").split(",") if v.strip()]
            if not value and kind == "tag":  # a YAML list on the following lines
                start = text.count("\n", 0, m.start()) + 1
                for line in lines[start:]:
                    item = _LIST_ITEM.match(line)
                    if not item:
                        break
                    values.append(item.group(1).strip("'\""))
            for v in values:
                if v and "{" not in v:
                    index.setdefault(v, (kind if kind != "tag" else "tag", rel))
    try:
        from kvcal.io import atomic_write_json

        atomic_write_json(cache, {k: list(v) for k, v in index.items()}, indent=None)
    except OSError:
        pass
    return index


def _cache_dir() -> Path:
    from kvcal.filecache import cache_root

    return cache_root()


# ---- offline overrides --------------------------------------------------------------------------------------


def _require(path: Path, task: str) -> Path:
    if not path.is_file():
        raise UsageError(
            f"task '{task}' needs '{path}', which is missing from --data-dir; "
            "lay the folder out like ../shared/data (see its README)"
        )
    return path


def _require_jsonl(path: Path, task: str, field: str | None = None) -> Path:
    check_jsonl_file(_require(path, task), f"task '{task}'", field)
    return path


def read_text_file(path: Path, what: str) -> str:
    """The text of a file eval reads; UsageError naming the file when it cannot be read or is not UTF-8 (lm-eval
    and datasets would otherwise fail deep inside, after the model has loaded)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read '{path}' ({what}): {exc.strerror or exc}") from exc
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(
            f"'{path}' ({what}) is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
            "convert it to UTF-8, e.g. iconv -f latin1 -t utf-8 IN > OUT"
        ) from exc


def check_jsonl_file(path: Path, what: str, field: str | None = None) -> None:
    """UsageError unless every non-blank line of `path` is a UTF-8 JSON object (holding `field` when given)."""
    for n, line in enumerate(jsonl_lines(read_text_file(path, what)), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise UsageError(
                f"line {n} of '{path}' ({what}) is not JSON ({exc}); JSON Lines files hold one object per line"
            ) from exc
        if not isinstance(record, dict) or (field is not None and field not in record):
            need = f" with a '{field}' field" if field else ""
            raise UsageError(f"line {n} of '{path}' ({what}) is not a JSON object{need}")


def _check_user_data_files(include_path: str | None, name: str) -> None:
    """The local data files a task of --include-path names (dataset_kwargs.data_files) are readable UTF-8."""
    entry = _task_manager(include_path, False).task_index.get(name)
    if entry is None or entry.yaml_path is None:
        return
    cfg = load_task_yaml(entry.yaml_path)
    files = (cfg.get("dataset_kwargs") or {}).get("data_files") if isinstance(cfg, dict) else None
    values = files.values() if isinstance(files, dict) else [files]
    for value in values:
        for item in value if isinstance(value, list) else [value]:
            path = Path(str(item))
            if item and path.is_file():
                what = f"data of task '{name}'"
                if path.suffix == ".jsonl":
                    check_jsonl_file(path, what)
                elif path.suffix in (".json", ".csv", ".txt", ".tsv"):
                    read_text_file(path, what)


def offline_config(cfg: dict[str, Any], data_dir: Path, gpqa_password: str | None = None) -> dict[str, Any]:
    """A copy of a task config whose data comes from `data_dir` instead of the hub (everything else untouched)."""
    cfg = dict(cfg)
    task = str(cfg.get("task"))
    hub = cfg.get("dataset_path")
    folder = DATA_FOLDERS.get(str(hub))
    if folder is None:
        return cfg  # not a dataset ../shared/data stands in for: lm-eval's normal loading
    root = data_dir / folder
    if hub == "openai/gsm8k":
        files = {
            "train": str(_require_jsonl(root / "train.jsonl", task)),
            "test": str(_require_jsonl(root / "test.jsonl", task)),
        }
        cfg.update(dataset_path="json", dataset_name=None, dataset_kwargs={"data_files": files})
    elif hub == "math-ai/aime25":
        cfg.update(
            dataset_path="json",
            dataset_name=None,
            dataset_kwargs={"data_files": {"test": str(_require_jsonl(root / "test.jsonl", task))}},
        )
    elif hub == "EleutherAI/wikitext_document_level":
        path = _require_jsonl(root / "test.jsonl", task, field="text")
        # Only the test split exists locally; lm-eval's wikitext evaluates the test split.
        cfg.update(
            dataset_path="json",
            dataset_name=None,
            dataset_kwargs={"wikitext_rows": str(path)},
            custom_dataset=_wikitext_dataset,
            training_split=None,
            validation_split=None,
            test_split="test",
        )
    elif hub == "Idavidrein/gpqa":
        zpath = _require(root / "dataset.zip", task)
        password = gpqa_password or os.environ.get(GPQA_PASSWORD_ENV)
        if not password:
            raise UsageError(
                f"task '{task}' reads the password-protected GPQA archive '{zpath}'; pass --gpqa-password or set "
                f"{GPQA_PASSWORD_ENV} (the password is published in the official GPQA README)"
            )
        subset = str(cfg.get("dataset_name") or "gpqa_diamond")
        member = f"dataset/{subset}.csv"
        # Check the password now (one clear error) rather than deep inside lm-eval.
        read_gpqa_rows(zpath, member, password)
        cfg.update(
            dataset_path="json",
            dataset_name=None,
            dataset_kwargs={"gpqa_zip": str(zpath), "gpqa_member": member},
            custom_dataset=_GpqaLoader(password),
        )
    return cfg


def wikitext_documents(rows: list[str]) -> list[str]:
    """EleutherAI/wikitext_document_level pages from the rows of HF `wikitext` (`wikitext-2-raw-v1`).

    HF `wikitext` yields each line of `wiki.test.raw` as a row ('' for blank lines, which are ' \\n' in the raw
    file); `wikitext_document_level` splits that raw text on '\\n' and starts a page at every level-1 heading
    (' = Title = '). We rebuild the raw text from the rows and split it the same way."""
    raw = "".join(row if row else " \n" for row in rows)
    pages: list[str] = []
    current: list[str] = []
    for line in raw.split("\n"):
        rline = line.replace("= = =", "===").replace("= =", "==").strip()
        if rline.startswith("= ") and rline.endswith(" ="):
            page = "\n".join(current)
            if page.strip():
                pages.append(page)
            current = []
        current.append(line)
    pages.append("\n".join(current))
    return pages


def _wikitext_dataset(wikitext_rows: str, **_: Any) -> Any:
    import datasets

    with open(wikitext_rows, encoding="utf-8") as fh:
        rows = [json.loads(line)["text"] for line in fh if line.strip()]
    return datasets.DatasetDict(
        {"test": datasets.Dataset.from_list([{"page": p} for p in wikitext_documents(rows)])}
    )


def read_gpqa_rows(zip_path: str | os.PathLike[str], member: str, password: str) -> list[dict[str, Any]]:
    """Rows of one GPQA CSV, decrypted in memory. Empty cells become None (what HF's CSV loader gives)."""
    try:
        with zipfile.ZipFile(zip_path) as zf:
            if member not in zf.namelist():
                raise KvcalError(
                    f"'{zip_path}' has no member '{member}'; is it the official GPQA dataset.zip?"
                )
            raw = zf.read(member, pwd=password.encode())
    except RuntimeError as exc:  # zipfile: "Bad password for file"
        raise UsageError(
            f"wrong GPQA password for '{zip_path}' ({exc}); use the password of the official GPQA README"
        ) from exc
    except zipfile.BadZipFile as exc:
        raise KvcalError(f"'{zip_path}' is not a readable zip archive ({exc})") from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise KvcalError(
            f"'{member}' in '{zip_path}' is not UTF-8 CSV; is it the official GPQA dataset.zip?"
        ) from exc
    return [
        {k: (v if v != "" else None) for k, v in row.items()} for row in csv.DictReader(io.StringIO(text))
    ]


class _GpqaLoader:
    """`custom_dataset` hook for GPQA: builds an in-memory datasets.DatasetDict (split 'train', as on the hub).
    The password lives only in this object (never in the task config lm-eval writes to results.json)."""

    def __init__(self, password: str) -> None:
        self._password = password

    def __repr__(self) -> str:  # results.json stores a repr of the config: keep the password out of it
        return "kvcal.evaluate.tasks.gpqa_in_memory"

    def __call__(self, gpqa_zip: str, gpqa_member: str, **_: Any) -> Any:
        import datasets

        rows = read_gpqa_rows(gpqa_zip, gpqa_member, self._password)
        return datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)})
