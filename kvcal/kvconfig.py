"""The identity of one KV configuration: `KVConfig`, the key a sweep cell, a release candidate, a report's group
of runs and a conformance claim share.

A configuration is a format (or K/V pair), where its static scales come from, the layers kept at 16 bits, and the
plan file that chose those layers. Everything else a run records (model, tasks, dtype, limits) is the setting the
configurations are compared under, not a configuration. `KVConfig.of_run` reads the key from a run's config.yaml
(kvcal.rundir.RunConfig); a sweep cell (kvcal.pipeline.sweep.Cell) and a release candidate
(kvcal.pipeline.release.Configuration) hold it before the run exists. The run directory's name is the eval spec's
(kvcal.evaluate.spec.run_dir_name): it adds the model and the kv input dtype, attention and serde to this key.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcal.errors import KvcalError
from kvcal.formats import kv_pair
from kvcal.rundir import RunConfig

NONE = "none"  # no scales (16-bit), no skipped layers


@dataclass(frozen=True)
class KVConfig:
    """One KV configuration. `scales`: 'none' (16-bit) | 'uncalibrated' | 'dynamic' | 'per-sequence' |
    'first-batch' | 'calib-<granularity>[-<recipe>]'; `skip`: --skip-layers as given, or 'none'; `plan`: the plan
    that chose the 16-bit layers (a run records its label, `plan@3.0x`; a sweep cell or release candidate names
    its file), None for a format alone."""

    kv_format: str
    scales: str = NONE
    skip: str = NONE
    plan: str | None = None

    @classmethod
    def of_run(cls, cfg: RunConfig) -> KVConfig:
        """The configuration a run directory's config.yaml records."""
        return cls(cfg.kv_format, describe_scales(cfg), describe_skip(cfg), cfg.plan_label)

    @property
    def format_shown(self) -> str:
        """The kv format column: `plan@3.0x (nvfp4)` for a plan (its 16-bit layers are the skip column)."""
        return f"{self.plan} ({self.kv_format})" if self.plan else self.kv_format

    def without_plan(self) -> KVConfig:
        """The format, scales and 16-bit layers alone (what an engine run can claim: it records no plan)."""
        return KVConfig(self.kv_format, self.scales, self.skip)


def describe_scales(cfg: RunConfig) -> str:
    """'calib-<granularity>' | 'first-batch' (vLLM's calculate_kv_scales) | 'uncalibrated' (FP8, or nvfp4 with
    global 1.0: scale 1) | 'per-sequence' (nvfp4's dynamic global) | 'dynamic' (per token / block formats) |
    'none' (16-bit)."""
    if cfg.calibrated:
        return f"calib-{cfg.scales_granularity or 'tensor'}"
    if cfg.scale_source:  # "first-batch": vLLM's calculate_kv_scales
        return cfg.scale_source
    fmt = cfg.kv_format
    if fmt in ("nvfp4", "nvfp4_4over6"):
        # run_format 1 recorded no policy: kvcal 0.1's nvfp4 took a dynamic global scale
        return {"one": "uncalibrated", "per_sequence": "per-sequence"}.get(cfg.nvfp4_global or "", "dynamic")
    if fmt in ("auto", "bf16", "float16"):
        return NONE
    try:
        sides = kv_pair(fmt)
    except KvcalError:  # a name this kvcal does not know (a newer run): say nothing wrong about it
        return "dynamic"
    # a static-scale side without a file runs at scale 1.0 (FP8, TensorRT-LLM's INT8 per tensor)
    return "uncalibrated" if any(f.calibratable for f in sides) else "dynamic"


def describe_skip(cfg: RunConfig) -> str:
    return cfg.skip_layers or NONE
