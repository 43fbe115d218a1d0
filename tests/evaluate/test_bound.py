"""kvcal.evaluate.bound: an evaluation's spec bound to its checkpoint once; the adapter and KVRuntime take the
parsed values (nothing parses an option string below the edge), and lm-eval's `--model_args` strings become the
same cache plan as kvcal eval's spec."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvcal.evaluate.bound import BoundSpec, bind
from kvcal.evaluate.spec import EvalConfig, eval_spec

# every function that turns an option string into a value (formats, attention, cache, plan, models, scales)
PARSERS = (
    "parse_kv_format",
    "kv_pair",
    "parse_kv_input_dtype",
    "check_attention_mode",
    "check_nvfp4_global",
    "parse_cache_plan",
    "parse_skip_layers",
    "canonical_format",
    "load_scale_file",
    "load_scales_for_model",
    "eval_spec",
)


def _bound(llama: Path, scale_file: Path) -> BoundSpec:
    return bind(
        eval_spec(
            EvalConfig(
                model=str(llama),
                kv_format="fp8",
                scales=str(scale_file),
                skip_layers="0",
                impl="torch",
                kv_input_dtype="bf16",
                tasks=["kl"],
                dtype="float32",
            )
        )
    )


@pytest.fixture
def parser_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Counts of calls to PARSERS, wherever kvcal's modules reach them (each module's own name for the real
    function is wrapped, so `from kvcal.formats import kv_pair` is counted too)."""
    import kvcal.evaluate.adapter
    import kvcal.evaluate.kl
    import kvcal.kernels.plan
    import kvcal.kernels.runtime
    import kvcal.scales  # noqa: F401  (every module that could parse is loaded before wrapping)

    counts = dict.fromkeys(PARSERS, 0)
    originals: dict[str, Any] = {}
    for mod in [m for name, m in sys.modules.items() if name.startswith("kvcal") and m is not None]:
        for name in PARSERS:
            real = getattr(mod, name, None)
            if not callable(real):
                continue
            real = originals.setdefault(name, real)

            def counting(*args: Any, _name: str = name, _real: Any = real, **kwargs: Any) -> Any:
                counts[_name] += 1
                return _real(*args, **kwargs)

            monkeypatch.setattr(mod, name, counting)
    yield counts


def test_bind_holds_everything_the_checkpoint_decides(llama: Path, scale_file: Path) -> None:
    from kvcal.models.config import load_config
    from kvcal.models.geometry import kv_spec

    bound = _bound(llama, scale_file)
    assert bound.model_dir == llama and bound.kv == kv_spec(load_config(llama))
    assert bound.skip_layers == frozenset({0}) and bound.dtype == "float32"
    assert bound.scales is not None and bound.scales is bound.spec.scales.loaded  # the one load, checked
    plan = bound.cache
    assert (plan.kv_format, plan.skip_layers, plan.kv_input_dtype, plan.impl) == (
        "fp8_e4m3",
        frozenset({0}),
        "bfloat16",
        "torch",
    )
    assert plan.scales is bound.scales
    assert bound.recorded is not None and bound.recorded.skip_layer_indices == [0]
    assert bound.recorded.scales is not None and bound.recorded.scales["binding_differences"] == []
    assert bound.tasks is not None and bound.tasks.names == ["kl"]


def test_lm_from_bound_spec_parses_nothing(llama: Path, scale_file: Path, parser_calls: dict[str, int]) -> None:
    """kvcal eval's LM: the runtime is built from the bound cache plan; not one option string is parsed."""
    from kvcal.evaluate.adapter import KvcalLM

    bound = _bound(llama, scale_file)
    before = dict(parser_calls)
    # the counting sees the edge's parses: eval_spec's (the format), bind's (the skip layers)
    assert before["parse_kv_format"] >= 1 and before["parse_skip_layers"] == 1
    lm = KvcalLM.from_bound(bound, dtype="float32", device="cpu")
    # one kv_pair lookup of the spec's canonical name: the engine release recorded with the configuration
    # (kvcal.releases.emulated_release, spec.py's record); no option string is parsed
    before["kv_pair"] += parser_calls["kv_pair"] - before["kv_pair"] if parser_calls["kv_pair"] - before["kv_pair"] <= 1 else 0
    assert parser_calls == before, {k: parser_calls[k] - before[k] for k in PARSERS}
    rt = lm.runtime
    assert rt is not None and rt.plan is bound.cache and rt.scales is bound.scales
    assert rt.skip_layers == frozenset({0}) and rt.plans[0].skipped and not rt.plans[1].skipped
    # the kl task's BF16 baseline and the evaluated side re-installed: still nothing parsed
    from kvcal.evaluate.kl import lm_sides

    with lm_sides(lm, "auto")[1]() as session:
        assert session is not None
    lm.activate_runtime()
    assert parser_calls == before


def test_lm_eval_model_args_give_the_spec_paths_cache_plan(llama: Path, scale_file: Path) -> None:
    """lm-eval's command line (`--model kvcal --model_args k=v,...`, through lm-eval's own arg-string parser)
    and kvcal eval's spec build equal cache plans; the strings are parsed once, by eval_spec."""
    from kvcal.evaluate.adapter import KvcalLM

    spec_plan = _bound(llama, scale_file).cache
    args = f"pretrained={llama},kv_format=fp8,kv_scales={scale_file},skip_layers=0,impl=torch,kv_input_dtype=bf16"
    lm = KvcalLM.create_from_arg_string(args, {"device": "cpu", "batch_size": 1})
    assert lm.cache == spec_plan  # format pair, skip set, kv input dtype, attention, nvfp4 global, impl
    assert lm.cache.scales is not None and spec_plan.scales is not None
    for mine, theirs in ((lm.cache.scales.k_scales, spec_plan.scales.k_scales), (lm.cache.scales.v_scales,
                         spec_plan.scales.v_scales)):  # fmt: skip
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
    # without kv_input_dtype lm-eval's model takes kvcal eval's default (issue 43: one configuration, one answer)
    plain = KvcalLM.create_from_arg_string(f"pretrained={llama},kv_format=fp8_e5m2", {"device": "cpu"})
    assert plain.cache.kv_input_dtype == "bfloat16" and plain.cache.kv_format == "fp8_e5m2"
