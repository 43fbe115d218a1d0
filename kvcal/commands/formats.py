"""`kvcal formats [--engine-release V] [--check-engine]`: the KV formats, the vLLM release(s) each matches bit for
bit (kvcal.releases), and what the installed engine release has that kvcal has no verified match for."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from kvcal.commands.options import JsonOpt
from kvcal.commands.output import console, print_json
from kvcal.errors import KvcalError

EngineReleaseOpt = Annotated[
    str | None,
    typer.Option(
        "--engine-release", help="vLLM release whose table to show (default: the newest kvcal knows)."
    ),
]
CheckEngineOpt = Annotated[
    bool,
    typer.Option(
        "--check-engine",
        help="List every --kv-cache-dtype value and KV store kernel of the installed vLLM (<repo>/.venv-vllm or "
        "$KVCAL_VLLM_VENV) that kvcal has no verified match for; exit 1 if there is any.",
    ),
]


def _rows(version: str | None) -> list[dict[str, Any]]:
    from kvcal import formats, releases

    release = releases.parse_release("vllm", version)
    rows = []
    for name in release.kv_cache_dtypes:
        row: dict[str, Any] = {"kv_cache_dtype": name, "release": release.version}
        kv = formats.FORMATS.get(name) or formats.FORMATS.get(
            {"bfloat16": "bf16", "fp8": "fp8_e4m3"}.get(name, "")
        )
        key = kv.name if kv is not None else name
        if key in release.matches:
            row.update(kvcal_format=key, matched_by=release.matches[key].to_dict(),
                       releases=releases.releases_of(key))  # fmt: skip
        elif name in release.mismatched:
            row.update(kvcal_format=name, mismatch=release.mismatched[name])
        elif name in release.refused:
            row["refused"] = release.refused[name]
        elif name == "auto":
            row["kvcal_format"] = "auto"
        else:
            row["unverified"] = True
        rows.append(row)
    return rows


def formats_cmd(engine_release: EngineReleaseOpt = None, check_engine: CheckEngineOpt = False,
                json_out: JsonOpt = False) -> None:  # fmt: skip
    """vLLM's --kv-cache-dtype values of a release: the kvcal format matching each bit for bit, or why not."""
    from kvcal import releases

    if check_engine:
        pkg = releases.engine_package("vllm")
        if pkg is None:
            raise KvcalError(
                "no installed engine to check: <repo>/.venv-vllm holds no vllm package (run `make engine`) and "
                f"${releases.VENV_ENV} is unset"
            )
        found = releases.unverified(pkg)
        if json_out:
            print_json({"package": str(pkg), **found})
        else:
            console.print(f"vLLM {found['version'][0]} at {pkg}")
            for key in ("kv_cache_dtypes", "store_kernels"):
                console.print(f"{key} without a verified match: {', '.join(found[key]) or 'none'}")
            release = releases.RELEASES["vllm"].get(found["version"][0])
            for name in found["kv_cache_dtypes"]:
                if release is not None and name in release.mismatched:
                    console.print(f"  {name}: {release.mismatched[name]}")
        if found["kv_cache_dtypes"] or found["store_kernels"]:
            raise typer.Exit(1)
        return
    rows = _rows(engine_release)
    if json_out:
        print_json(rows)
        return
    table = Table(title=f"vLLM {rows[0]['release']} --kv-cache-dtype")
    for col in ("--kv-cache-dtype", "kvcal", "matches releases / why not"):
        table.add_column(col)
    for r in rows:
        how = r.get("matched_by", {})
        verdict = r.get("refused") or (f"MISMATCH: {r['mismatch']}" if r.get("mismatch") else None) or ("UNVERIFIED" if r.get("unverified") else
                                       f"{', '.join(r.get('releases', []))} ({how.get('how', 'model dtype')})")  # fmt: skip
        table.add_row(r["kv_cache_dtype"], r.get("kvcal_format", "-"), verdict)
    console.print(table)
