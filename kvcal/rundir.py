"""The run-directory format: file names and the one `RunConfig` that config.yaml holds (docs/run-directory.md).

`kvcal eval` writes it (kvcal.evaluate.run), the run store hashes it to recognise a rerun (kvcal.evaluate.runstore),
sweeps match cells against it (kvcal.pipeline.sweep) and reports read it back (kvcal.report.runs). Keeping the
fields in one dataclass is what stops the writer and the readers from drifting apart.

RUN_DIR/
  config.yaml            RunConfig.to_dict() (written first; its identity hash names the run)
  env.json               versions, device, kvcal git revision
  tasks/<task>.json      one finished task: lm-eval's results dict for that task alone (resume skips it)
  samples_<task>.jsonl   per-sample records (lm-eval's --log_samples records; kvcal's kl: one per window)
  results.json           lm-eval's results dict, merged over the tasks
  metrics.json           wall time, tokens/s, peak memory, cache bytes per token, capacity multiplier
  COMPLETE               written last: {"finished": ..., "config_hash": ...}
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# Version of the config.yaml schema. 1: kvcal 0.1 (no `run_format` key); 2: `run_format` recorded.
RUN_FORMAT = 2

CONFIG = "config.yaml"
ENV = "env.json"
RESULTS = "results.json"
METRICS = "metrics.json"
COMPLETE = "COMPLETE"
TASKS_DIR = "tasks"

# Fields that do not change what is measured (a rerun with another value is the same run). model_dir is where
# kvcal's cache happens to hold a converted GGUF (its name can change between kvcal versions); `model` names it.
NON_IDENTITY_KEYS = frozenset({"kvcal_version", "run_dir", "scales_path", "model_dir", "run_format"})
# ... and within `plan`: where the plan file is and which version of it (its layers are kv_format + skip_layers)
PLAN_NON_IDENTITY_KEYS = frozenset({"path", "sha256"})


def samples_file(task: str) -> str:
    return f"samples_{task}.jsonl"


# config.yaml's whole-number fields (None where not set)
_COUNTS = ("limit", "num_fewshot", "batch_size", "seed", "kl_seq_len", "prefill_chunk", "kl_subsample",
           "max_gen_toks", "repeats", "tq_boundary_layers", "prefix_tokens", "run_format")  # fmt: skip


@dataclass
class RunConfig:
    """What one run measured, as config.yaml records it. `scales` is None for an uncalibrated / dynamic run,
    else {"sha256", "granularity", "observer", "binding_differences"[, "WARNING"]}."""

    model: str
    model_dir: str
    kv_format: str
    tasks: list[str]
    scales_path: str | None = None
    scales: dict[str, Any] | None = None
    force_scales: bool = False
    skip_layers: str = ""
    skip_layer_indices: list[int] = field(default_factory=list)
    include_path: str | None = None
    limit: int | None = None
    num_fewshot: int | None = None
    data_dir: str | None = None
    impl: str = "auto"
    dtype: str = "float32"
    device: str = "cpu"
    batch_size: int = 1
    seed: int = 0
    kl_seq_len: int | None = None
    # kl's chunked-prefill chunk, only when the windows are chunked (kl_seq_len > prefill_chunk); written only
    # when set, so every other run keeps its identity hash.
    prefill_chunk: int | None = None
    # kl's `--kl-subsample` (positions 0, N, 2N, ... scored), only when N > 1; written only when set
    kl_subsample: int | None = None
    max_gen_toks: int | None = None
    # nvfp4 without a scale file: "one" | "per_sequence" (kvcal.kernels.cache.NVFP4_GLOBALS); None otherwise.
    # Written only when set, so runs of every other configuration keep their identity hash.
    nvfp4_global: str | None = None
    # K/V rounded to this dtype before quantization (`--kv-input-dtype`), recorded for every quantized format; a
    # run directory without it (kvcal before the option) quantized K/V as computed: `kv_input_dtype_or_legacy`.
    kv_input_dtype: str | None = None
    # "first-batch" (vLLM's calculate_kv_scales, `--scales first-batch`); None = a scale file or formats' defaults.
    # Both written only when set, so runs of every other configuration keep their identity hash.
    scale_source: str | None = None
    # "fp8" (`--attention fp8`: vLLM's FlashAttention-3 FP8 attention, Q and P in e4m3); None = attention in the
    # model's dtype. Written only when set, so runs of every other configuration keep their identity hash.
    attention: str | None = None
    # The passkey tasks' prompt lengths in tokens and key depths (`--passkey-lengths`, `--passkey-depths`), only
    # when a passkey task runs; written only when set, so every other run keeps its identity hash.
    passkey_lengths: list[int] | None = None
    passkey_depths: list[float] | None = None
    # "continuation" / "continuation-whole" (`--scoring`: loglikelihood requests scored on their continuation rows
    # only); None = lm-eval's own path. Written only when set, so every other run keeps its identity hash.
    scoring: str | None = None
    # Sampling for generative lm-eval tasks (`--repeats N`, `--gen-kwargs temperature=0.6,...`): each document
    # generated N times with a seed per (document, repeat), scored as the mean over its repeats. Written only
    # when set, so every other run keeps its identity hash.
    repeats: int | None = None
    gen_kwargs: dict[str, Any] | None = None
    # `--prompts FILE.jsonl` of a divergence task: {"path", "sha256"}; written only when set
    prompts: dict[str, str] | None = None
    # `-f plan.json` (a `kvcal plan` file, kvcal.planfile.PlanFile.run_record): {"label", "budget", "path",
    # "sha256"}; kv_format and skip_layers hold its layers. Its label and budget are identity, its path and
    # sha256 (which file, which version) are not. Written only when set, so every other run keeps its hash.
    plan: dict[str, Any] | None = None
    # a TurboQuant preset's boundary layers kept in BF16 (`--tq-boundary-layers`, vLLM's default 2); None for every
    # other format. Written only when set, so every other run keeps its identity hash.
    tq_boundary_layers: int | None = None
    # LMCache's storage tier (`--prefix-serde` / `--prefix-tokens`, kvcal.serde): the serde each sequence's first
    # prefix_tokens K/V round-tripped through. Written only when set, so every other run keeps its identity hash.
    prefix_serde: str | None = None
    prefix_tokens: int | None = None
    # log-likelihoods' log-softmax and sums (`--logprob-dtype`): "float32" or "model" (lm-eval's HFLM default),
    # recorded for a model dtype other than float32 (a float32 model gives the same numbers either way); absent
    # with a 16-bit dtype: a run of kvcal before the option, summed in the model's dtype. Written only when set.
    logprob_dtype: str | None = None
    # lm-eval's max_length (`--max-length`: rolling window and truncation) when given; None = lm-eval's default
    # (the model's positions; results.json's `max_length` holds the one used). Written only when set.
    max_length: int | None = None
    # `--perturb-weights ULPS` (kvcal.models.perturb): every weight moved by that many ulps of its dtype, random
    # signs from `seed`: a yardstick run for conformance, not a configuration to ship. Written only when set.
    perturb_weights: float | None = None
    # the engine release whose store the run's format matches bit for bit ('vllm==0.33.0', kvcal.releases), for
    # a format a vLLM release stores; written only when set (formats no vLLM release stores keep their hash)
    engine_release: str | None = None
    kvcal_version: str = ""
    run_format: int = RUN_FORMAT
    # Anything else a newer kvcal wrote: kept so that reading and rewriting loses nothing.
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        if d["nvfp4_global"] is None:
            del d["nvfp4_global"]
        for key in (
            "kv_input_dtype", "scale_source", "attention", "passkey_lengths", "passkey_depths", "prefill_chunk",
            "kl_subsample", "scoring", "repeats", "gen_kwargs", "prompts", "plan", "tq_boundary_layers",
            "prefix_serde", "prefix_tokens", "logprob_dtype", "max_length", "engine_release",
            "perturb_weights",
        ):  # fmt: skip
            if d[key] is None:
                del d[key]
        d.update(self.extra)
        return d

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RunConfig:
        """Read a config.yaml mapping; a file without `run_format` is format 1 (kvcal 0.1), same fields."""
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in raw.items() if k in names}
        known.setdefault("run_format", 1)
        for required in ("model", "kv_format"):
            if required not in known:
                raise ValueError(f"config.yaml has no '{required}'")
        known.setdefault("model_dir", "")
        known.setdefault("tasks", [])
        for key in _COUNTS:  # a hand-edited or damaged file: refused here, not met as a NaN in a report
            v = known.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise ValueError(f"config.yaml's {key} is {v!r}, not a whole number")
        if not isinstance(known["tasks"], list) or not all(isinstance(t, str) for t in known["tasks"]):
            raise ValueError(f"config.yaml's tasks is {known['tasks']!r}, not a list of task names")
        return cls(**known, extra={k: v for k, v in raw.items() if k not in names})

    def identity(self) -> dict[str, Any]:
        """The fields that decide what is measured (what the run hash covers)."""
        out = {k: v for k, v in self.to_dict().items() if k not in NON_IDENTITY_KEYS}
        if isinstance(out.get("plan"), dict):
            out["plan"] = {k: v for k, v in out["plan"].items() if k not in PLAN_NON_IDENTITY_KEYS}
        return out

    @property
    def logprob_dtype_used(self) -> str:
        """The dtype the run's log-likelihoods were computed and summed in: float32 (`--logprob-dtype float32`,
        the default), else the model's dtype (`model`, or a run recorded without the field: a float32 model, or
        kvcal before the option)."""
        return "float32" if self.logprob_dtype == "float32" else str(self.dtype)

    @property
    def plan_label(self) -> str | None:
        """The label of the plan file the run evaluated (`plan@3.0x`), None for a run of a format."""
        return str(self.plan.get("label") or "plan") if isinstance(self.plan, dict) else None

    @property
    def kv_input_dtype_or_legacy(self) -> str | None:
        """The K/V input dtype of a quantized run: recorded, else "float32" (runs made before `--kv-input-dtype`
        quantized K/V as kvcal computed them); None for auto / bf16."""
        if self.kv_format in ("auto", "bf16") and self.prefix_serde is None:
            return None  # (a bf16 run with a prefix serde records its K/V dtype: the serde round-trips them)
        return self.kv_input_dtype or "float32"

    @property
    def calibrated(self) -> bool:
        return self.scales is not None or bool(self.scales_path)

    @property
    def scales_granularity(self) -> str | None:
        return str(self.scales.get("granularity")) if self.scales and self.scales.get("granularity") else None
