"""The YAML keys kvcal's pipelines share: how a field of a sweep or release YAML is read (`yaml_field`,
`read_fields`, the `read_*` parsers), the calibration `Recipe`, and `EvalSettings`, the evaluation keys a sweep
config and a release config's `evaluate` section share.

`EvalSettings` field names are `kvcal eval`'s option names (kvcal.evaluate.spec.EvalConfig): `eval_options` hands
the set ones to the spec builder by name, so a sweep cell and a release candidate are built like `kvcal eval`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcal.errors import UsageError
from kvcal.evaluate.kl import check_kl_subsample
from kvcal.evaluate.passkey import parse_depths, parse_lengths
from kvcal.evaluate.spec import PIPELINE_DTYPE, slug
from kvcal.evaluate.tasks import parse_task_list
from kvcal.formats import DEFAULT_KV_INPUT_DTYPE, parse_kv_input_dtype
from kvcal.models.loading import resolve_dtype

# ---- the sweep YAML: every key is one dataclass field, read by the parser in its metadata ---------------------

Parser = Callable[[Any, str, Path | None], Any]  # (YAML value, key, folder of the YAML) -> field value


def yaml_field(parse: Parser, default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING,
         yaml_key: str | None = None) -> Any:  # fmt: skip
    """A field of the sweep YAML: how its value is read, its default (absent or null -> default), its YAML name."""
    meta = {"parse": parse, "yaml": yaml_key}
    return field(default=default, default_factory=factory, metadata=meta)


def yaml_key(f: dataclasses.Field[Any]) -> str:
    return f.metadata.get("yaml") or f.name


def as_list(value: Any, key: str) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()] if key != "skip_layers" else [value]
    if isinstance(value, list):
        return value
    raise UsageError(f"sweep config: '{key}' must be a list, got {type(value).__name__}")


def read_text(value: Any, key: str, base: Path | None) -> str:
    return str(value)


def read_raw(value: Any, key: str, base: Path | None) -> Any:
    return value


def read_int(value: Any, key: str, base: Path | None) -> int:
    if isinstance(value, bool):
        raise UsageError(f"sweep config: '{key}' must be an integer, got {value!r}")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise UsageError(f"sweep config: '{key}' must be an integer, got {value!r}") from None


def read_gen_kwargs(value: Any, key: str, base: Path | None) -> str:
    """`gen_kwargs: {temperature: 0.6, top_p: 0.95}` or lm-eval's string form; kvcal eval's --gen-kwargs text
    (checked here: kvcal.evaluate.spec.parse_gen_kwargs)."""
    from kvcal.engines import gen_kwargs_text
    from kvcal.evaluate.spec import parse_gen_kwargs

    if isinstance(value, dict):
        value = gen_kwargs_text(value.items())
    text = str(value)
    parse_gen_kwargs(text)
    return text


def read_tokens(value: Any, key: str, base: Path | None) -> int:
    n = read_int(value, key, base)
    if n < 1:
        raise UsageError(f"sweep config: '{key}' must be a positive number of tokens (e.g. 8192), got {n}")
    return n


def read_subsample(value: Any, key: str, base: Path | None) -> int:
    n = read_int(value, key, base)
    try:
        return check_kl_subsample(n)
    except UsageError as exc:
        raise UsageError(f"sweep config: '{key}': {exc}") from None


def read_passkey_spec(parse: Callable[[str], list[Any]]) -> Parser:
    """A passkey list ('1k,2k,4k' or a YAML list [1k, 2k]) checked by `parse` now, kept as kvcal eval's text."""

    def read(value: Any, key: str, base: Path | None) -> str:
        text = ",".join(str(v) for v in value) if isinstance(value, list) else str(value)
        try:
            parse(text)
        except UsageError as exc:
            raise UsageError("sweep config: " + str(exc).replace(f"--{key.replace('_', '-')}", key)) from None
        return text

    return read


def read_path(value: Any, key: str, base: Path | None) -> str | None:
    """Relative paths are taken relative to the YAML's folder when they exist there, else to the current one."""
    if value in (None, ""):
        return None
    cand = Path(str(value)).expanduser()
    if not cand.is_absolute() and base is not None and (base / cand).exists():
        return str((base / cand).resolve())
    return str(cand)


def read_dtype(value: Any, key: str, base: Path | None) -> str:
    name = str(value)
    # a named dtype needs no checkpoint to resolve (aliases -> the name `kvcal eval` records); 'auto' does
    return name if name == "auto" else resolve_dtype(name, model_dir=".")


def read_granularities(value: Any, key: str, base: Path | None) -> tuple[str, ...] | None:
    grans = tuple(str(g) for g in as_list(value, key))
    if any(g not in ("tensor", "head") for g in grans):
        raise UsageError(f"sweep config: recipe granularity must be tensor or head, got {list(grans)}")
    return grans or None


def read_recipe_name(value: Any, key: str, base: Path | None) -> str:
    return slug(str(value))


@dataclass(frozen=True)
class Recipe:
    """One calibration recipe (the arguments of kvcal.calibrate.run.calibrate)."""

    name: str = yaml_field(read_recipe_name, "default")
    observer: str = yaml_field(read_text, "minmax")
    granularity: tuple[str, ...] | None = yaml_field(
        read_granularities, None
    )  # only these granularities; None = all asked
    dataset: str | None = yaml_field(read_path, None)  # None = kvcal's built-in generated corpus
    num_samples: int = yaml_field(read_int, 128)
    seq_len: int = yaml_field(read_int, 512)
    seed: int = yaml_field(read_int, 0)
    engine: str = yaml_field(read_text, "native")
    observer_params: dict[str, Any] | None = yaml_field(read_raw, None)
    text_field: str | None = yaml_field(read_raw, None)


def read_kv_input_dtype(value: Any, key: str, base: Path | None) -> str:
    return parse_kv_input_dtype(str(value))


def read_tasks(value: Any, key: str, base: Path | None) -> list[str]:
    return parse_task_list([str(t) for t in as_list(value, key)])


def read_limit(value: Any, key: str, base: Path | None) -> int | dict[str, int]:
    if isinstance(value, dict):
        value = {("default" if k == "default" else parse_task_list([str(k)])[0]): v for k, v in value.items()}
        values = list(value.values())
    else:
        values = [value]
    if any(v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0) for v in values):
        raise UsageError(
            f"sweep config: limit must be a positive integer or a mapping task: integer, got {value!r}"
        )
    return value


def read_recipes(value: Any, key: str, base: Path | None) -> list[Recipe]:
    raw = [value] if isinstance(value, dict) else value
    if not isinstance(raw, list):
        raise UsageError("sweep config: 'calibration' must be a recipe mapping or a list of them")
    recipes: list[Recipe] = []
    for i, r in enumerate(raw or [{}]):
        if not isinstance(r, dict):
            raise UsageError(f"sweep config: calibration recipe {i + 1} must be a mapping")
        r = dict(r)
        if not r.get("name"):
            r["name"] = "default" if len(raw) <= 1 else f"recipe{i + 1}"
        recipes.append(Recipe(**read_fields(Recipe, r, base, "calibration key")))
    names = [r.name for r in recipes]
    if len(set(names)) != len(names):
        raise UsageError(f"sweep config: calibration recipe names must be unique, got {names}")
    return recipes


@dataclass(kw_only=True)
class EvalSettings:
    """How each evaluation runs: the keys a sweep config and a release config's `evaluate` section share."""

    limit: int | dict[str, int] | None = yaml_field(
        read_limit, None
    )  # samples per task; a mapping gives each task its own
    num_fewshot: int | None = yaml_field(read_int, None)
    data_dir: str | None = yaml_field(read_path, None)
    include_path: str | None = yaml_field(read_path, None)
    dtype: str = yaml_field(read_dtype, PIPELINE_DTYPE)  # stated in kvcal.evaluate.spec
    device: str = yaml_field(read_text, "cpu")
    impl: str = yaml_field(read_text, "auto")
    batch_size: int = yaml_field(read_int, 1)
    seed: int = yaml_field(read_int, 0)
    kl_seq_len: int | None = yaml_field(read_int, None)
    prefill_chunk: int | None = yaml_field(read_tokens, None)  # kl windows longer than this: chunked prefill
    # kl scores positions 0, N, 2N, ... (kvcal eval --kl-subsample)
    kl_subsample: int | None = yaml_field(read_subsample, None)
    max_gen_toks: int | None = yaml_field(read_int, None)  # cap on generated tokens (lm-eval's aime25 asks for 32768)
    # generative tasks: N samples per document, scored by their mean (kvcal eval --repeats / --gen-kwargs)
    repeats: int | None = yaml_field(read_int, None)
    gen_kwargs: str | None = yaml_field(read_gen_kwargs, None)
    passkey_lengths: str | None = yaml_field(read_passkey_spec(parse_lengths), None)  # e.g. [1k, 2k, 4k]
    passkey_depths: str | None = yaml_field(read_passkey_spec(parse_depths), None)  # e.g. [0, 0.5, 1]
    # K/V rounded to this dtype before quantization (kvcal eval --kv-input-dtype): the engine's serving dtype
    kv_input_dtype: str = yaml_field(read_kv_input_dtype, DEFAULT_KV_INPUT_DTYPE)
    # LMCache's storage tier (kvcal eval --prefix-serde / --prefix-tokens): both or neither, checked by eval_spec
    prefix_serde: str | None = yaml_field(read_text, None)
    prefix_tokens: int | None = yaml_field(read_int, None)


def eval_settings(settings: EvalSettings) -> dict[str, Any]:
    """The EvalSettings fields of `settings` as keyword arguments (to carry them into another config)."""
    return {f.name: getattr(settings, f.name) for f in dataclasses.fields(EvalSettings)}


def eval_options(settings: EvalSettings, task: str) -> dict[str, Any]:
    """`kvcal eval`'s options (EvalConfig keyword arguments, by name) that `settings` sets for one task: unset
    ones (None) keep kvcal eval's defaults; `limit` is the task's own."""
    out = {k: v for k, v in eval_settings(settings).items() if v is not None}
    limit = settings.limit.get(task, settings.limit.get("default")) if isinstance(settings.limit, dict) else settings.limit
    out["limit"] = limit
    return out


_FLAG = re.compile(r"--([a-z][a-z0-9]*(?:-[a-z0-9]+)*)")
# the options of one configuration (not the shared evaluation settings): named by the configuration's own keys
_CONFIG_KEYS = ("kv_format", "scales", "skip_layers")


def yaml_words(message: str, section: str | None, config: str | None = None) -> str:
    """`kvcal eval`'s option names in an eval_spec message as the YAML keys that set them: `--batch-size` ->
    `evaluate.batch_size` (`section` None: top-level keys, a sweep config's), `--kv-format` -> `<config>.kv_format`
    (the configuration's own key, when given). Other text is left as it is."""
    fields = {f.name for f in dataclasses.fields(EvalSettings)}

    def key(m: re.Match[str]) -> str:
        name = m.group(1).replace("-", "_")
        if name in fields:
            return f"{section}.{name}" if section else name
        if config is not None and name in _CONFIG_KEYS:
            return f"{config}.{name}"
        return m.group(0)

    return _FLAG.sub(key, message)


def read_fields(cls: type, raw: dict[str, Any], base: Path | None, what: str) -> dict[str, Any]:
    """Keyword arguments of dataclass `cls` from a YAML mapping, each value through its field's parser; absent and
    null keys keep their defaults. UsageError for unknown keys."""
    known = {yaml_key(f): f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise UsageError(
            f"sweep config: unknown {what}(s) {', '.join(unknown)}; valid: {', '.join(sorted(known))}"
        )
    return {
        f.name: f.metadata["parse"](raw[key], key, base)
        for key, f in known.items()
        if raw.get(key) is not None
    }
