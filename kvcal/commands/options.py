"""The arguments and options kvcal's commands share, declared once, and the mapping from a command's options to
the library's config objects and keyword arguments.

A command declares a shared option by its type alias and gives only the default, which stays per command:

    def calibrate_cmd(model: ModelArg, json_out: JsonOpt = False, seq_len: SeqLenOpt = 512) -> None: ...

The option's flags and help text live here, so `--json` or MODEL read the same in every command's --help.
Where the meaning of a flag depends on the command (what -o/--output writes, what --scales defaults to), the
flags are shared and the help is given per command: `Annotated[Path, output_option("Scale file to write.")]`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, fields
from typing import Annotated, Any, TypeVar

import typer
from typer.models import OptionInfo

from kvcal.formats import FORMATS

MODEL_HELP = "HF model folder, hub id, .gguf file, or an installed real model (smollm2, gemma3-270m)."
JSON_HELP = "Machine-readable output on stdout."
KV_FORMAT_HELP = (
    f"KV cache format: {', '.join(FORMATS)}; vLLM/SGLang names (fp8, bfloat16, ...) work too; or a plan "
    "file from `kvcal plan` (plan.json; eval runs one format plus 16-bit layers)."
)

# ---- model and output ----------------------------------------------------------------------------------------

ModelArg = Annotated[str, typer.Argument(help=MODEL_HELP, show_default=False)]
JsonOpt = Annotated[bool, typer.Option("--json", help=JSON_HELP)]
DtypeOpt = Annotated[
    str,
    typer.Option(
        "--dtype",
        help="Model dtype: float32, bfloat16 or float16; eval also takes auto (the checkpoint's own).",
    ),
]
# drift reads what calibration did from the scale file: --dtype and --seq-len default to the manifest's
ManifestDtypeOpt = Annotated[
    str | None,
    typer.Option(
        "--dtype",
        help="Model dtype (float32, bfloat16, float16, auto); default: the one the scales were calibrated "
        "in (manifest calibration.dtype). Another one warns: K/V differ even on the calibration text.",
    ),
]
ManifestSeqLenOpt = Annotated[
    int | None,
    typer.Option("--seq-len", help="Tokens per sequence (at most); default: the scale file's calibration.seq_len."),
]
DeviceOpt = Annotated[str, typer.Option("--device", help="cpu, cuda, cuda:N or mps.")]
# accelerate's big-model dispatch (kvcal.placement): calibrate, eval, sensitivity
DeviceMapOpt = Annotated[
    str | None,
    typer.Option(
        "--device-map",
        help="Spread the model over devices (accelerate): auto, balanced, sequential, or a JSON file "
        '{"module": device} (GPU index, cpu, disk). Replaces --device.',
    ),
]
MaxMemoryOpt = Annotated[
    str | None,
    typer.Option("--max-memory", help="Budget per device for --device-map, e.g. 0=20GiB,cpu=64GiB."),
]
OffloadFolderOpt = Annotated[
    str | None,
    typer.Option("--offload-folder", help="Folder for the weights --device-map puts on 'disk'."),
]
ObserveBatchOpt = Annotated[
    int,
    typer.Option(
        "--batch-size",
        help="Samples per forward (right-padded; padding never reaches the statistics, scales equal batch 1).",
    ),
]
NumProcessesOpt = Annotated[
    int,
    typer.Option(
        "--num-processes",
        help="Split the work over N processes (torchrun; gloo on CPU, nccl on CUDA: one GPU each); the "
        "results equal one process's. Under torchrun / accelerate launch, leave it at 1.",
    ),
]


def output_option(help: str) -> OptionInfo:
    """-o/--output with the command's own help: what gets written there differs per command."""
    return typer.Option("--output", "-o", help=help)


# ---- KV cache configuration ----------------------------------------------------------------------------------

KvFormatOpt = Annotated[str, typer.Option("--kv-format", "-f", help=KV_FORMAT_HELP)]
KvFormatsOpt = Annotated[
    list[str] | None,
    typer.Option("--kv-format", "-f", help=f"{KV_FORMAT_HELP} Repeatable or comma-separated; default: all."),
]
SkipLayersOpt = Annotated[
    str | None,
    typer.Option(
        "--skip-layers", help="Layers kept at 16 bits: sliding_window, full_attention, or indices 0,3,17."
    ),
]
# compare / sweep / release: the context the reported capacity assumes (kvcal capacity's --context is its own)
CapacityContextOpt = Annotated[
    int | None,
    typer.Option(
        "--context",
        help="Tokens of context for the 'tokens vs BF16' capacity: sliding-window layers hold min(context, "
        "window) tokens. Default: the longest context the runs evaluated (kl windows, passkey lengths).",
    ),
]


def scales_option(help: str = "Scale file (.safetensors) from `kvcal calibrate`.") -> OptionInfo:
    """--scales; a command whose default (no scale file) needs saying passes its own help."""
    return typer.Option("--scales", help=help)


ScalesOpt = Annotated[str | None, scales_option()]
KvInputDtypeOpt = Annotated[
    str,
    typer.Option(
        "--kv-input-dtype",
        help="Dtype K/V have when they reach the quantizer: bfloat16 (an engine serving a bf16 model; default), "
        "float16, or float32 (as the model computes them, kvcal before this option).",
    ),
]

# ---- calibration text (calibrate, sensitivity) ---------------------------------------------------------------

DatasetOpt = Annotated[
    str | None,
    typer.Option(
        "--dataset",
        help=".jsonl/.json/.txt/.parquet file, a folder of them, or a hub dataset id (ID@SPLIT); "
        "default: kvcal's generated corpus (no network).",
    ),
]
TextFieldOpt = Annotated[str | None, typer.Option("--text-field", help="Record field holding the text.")]
NumSamplesOpt = Annotated[int, typer.Option("--num-samples", help="Sequences of text to measure on.")]
SeqLenOpt = Annotated[int, typer.Option("--seq-len", help="Tokens per sequence (at most).")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed of the text sampling.")]

# ---- options -> library ---------------------------------------------------------------------------------------

T = TypeVar("T")


def _check_names(target: str, accepted: Iterable[str], options: Mapping[str, Any], cli_only: Iterable[str]):
    """TypeError (a programming error, caught by tests/commands) when an option has no counterpart."""
    unknown = sorted(set(options) - set(accepted) - set(cli_only))
    if unknown:
        raise TypeError(
            f"option(s) {unknown} match nothing of {target}; rename them or list them as CLI-only"
        )


def config_from_options(
    cls: type[T],
    options: Mapping[str, Any],
    cli_only: Iterable[str] = (),
    no_option: Iterable[str] = (),
) -> T:
    """The dataclass `cls` built from a command's options (`locals()` at its top): field NAME takes option NAME.

    Every init field needs an option of its name except those in `no_option` (they keep their defaults); every
    option needs a field except those in `cli_only` (--json, ...). Either mismatch is a TypeError, so adding a
    field to the config means declaring one option of the same name, nothing else."""
    names = [f.name for f in fields(cls) if f.init]  # type: ignore[arg-type]
    missing = sorted(set(names) - set(options) - set(no_option))
    if missing:
        raise TypeError(f"{cls.__name__} field(s) {missing} have no CLI option; declare one or list them")
    _check_names(cls.__name__, names, options, cli_only)
    return cls(**{n: options[n] for n in names if n in options})


def library_kwargs(fn: Callable[..., Any], options: Mapping[str, Any], cli_only: Iterable[str] = ()) -> dict:
    """The keyword arguments of library function `fn` taken from a command's options by name (all options but
    `cli_only`; an option that `fn` does not take is a TypeError)."""
    _check_names(f"{fn.__module__}.{fn.__name__}()", inspect.signature(fn).parameters, options, cli_only)
    skip = set(cli_only)
    return {k: v for k, v in options.items() if k not in skip}


def config_defaults(cls: type) -> dict[str, Any]:
    """Field name -> default of dataclass `cls` (fields with a default value), for options' defaults."""
    return {f.name: f.default for f in fields(cls) if f.default is not MISSING}
