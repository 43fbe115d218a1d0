"""One way to observe K/V, shared by calibrate, drift and sensitivity: the option group that decides which K/V an
observer sees, validated in one function, and the one function that runs the forwards.

    opts = ObserveOptions.parse(dataset=..., text_field=None, num_samples=128, seq_len=512, seed=0,
                                kv_input_dtype="bfloat16", batch_size=1)
    data = opts.samples(lm)                                    # seeded token samples (data.build_samples)
    opts.observe(lm.model, data.samples, sink, num_layers)     # K/V [B, H_kv, T, D] to sink, as opts says

What makes two observations see bit-identical K/V (and so what a scale file's manifest must record, and what
`kvcal drift` reads back from it, see `ObserveOptions.for_scale_file`):
- the token samples: text source, text field, number, `seq_len`, seed; the BOS rule is `data.build_samples`'
  (the tokenizer's special tokens, none added to a rendered chat template) — the same function for every caller;
- the model's dtype (manifest calibration.dtype; loading is the caller's);
- `kv_input_dtype`: K/V rounded to it before any statistic (`--kv-input-dtype`: what an engine serving a bf16
  model hands its quantizer); None = as the model computes them;
- batching: `batch_size` samples per forward, right-padded, padding hidden from the sinks and attention row by
  row, so the K/V equal batch 1's bit for bit (hooks.observe) — batching is speed, not a setting of the data.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from kvcal.calibrate.data import CalibrationSamples, TextSource, check_sampling, load_texts, samples_for_model
from kvcal.calibrate.hooks import KVSink, ProgressFn, observe
from kvcal.errors import UsageError
from kvcal.formats import KV_INPUT_DTYPES, parse_kv_input_dtype

if TYPE_CHECKING:
    from kvcal.models.loading import LoadedModel


def in_dtype(sink: KVSink, dtype: torch.dtype | None) -> KVSink:
    """`sink` seeing K/V rounded to `dtype` (`--kv-input-dtype`: what the engine's quantizer gets); None = as is."""
    if dtype is None:
        return sink

    def cast(layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v: [B, H_kv, T, D]; rounded, then back to the dtype the observers are used to (bf16 -> fp32 is exact)
        sink(layer_idx, k.to(dtype).to(k.dtype), v.to(dtype).to(v.dtype))

    return cast


@dataclass(frozen=True)
class ObserveOptions:
    """The options calibrate, drift and sensitivity share (`--dataset --text-field --num-samples --seq-len --seed
    --kv-input-dtype --batch-size`), validated: build one with `parse`, never field by field.

    `kv_input_dtype`: canonical name (bfloat16, float16, float32) or None (K/V as the model computes them)."""

    dataset: str | None = None
    text_field: str | None = None
    num_samples: int = 128
    seq_len: int = 512
    seed: int = 0
    kv_input_dtype: str | None = None
    batch_size: int = 1

    @classmethod
    def parse(
        cls,
        *,
        dataset: str | os.PathLike[str] | None = None,
        text_field: str | None = None,
        num_samples: int = 128,
        seq_len: int = 512,
        seed: int = 0,
        kv_input_dtype: str | None = None,
        batch_size: int = 1,
    ) -> ObserveOptions:
        """The one validation of the group (UsageError naming the flag); needs no model and no data."""
        check_sampling(num_samples, seq_len)
        if batch_size < 1:
            raise UsageError(f"--batch-size must be at least 1, got {batch_size}")
        return cls(
            dataset=None if dataset is None else str(dataset),
            text_field=text_field,
            num_samples=int(num_samples),
            seq_len=int(seq_len),
            seed=int(seed),
            kv_input_dtype=None if kv_input_dtype is None else parse_kv_input_dtype(kv_input_dtype),
            batch_size=int(batch_size),
        )

    def for_scale_file(self, ss: Any, requested_kv_input_dtype: str | None) -> ObserveOptions:
        """These options with the K/V rounding the scale file `ss` was calibrated with (manifest
        calibration.kv_input_dtype; older files: `ScaleSet.kv_input_dtype`'s rule), so that observing the
        calibration text again sees the calibration's very numbers. UsageError when the caller asked for another
        rounding: the two would disagree on the calibration text itself."""
        recorded = parse_kv_input_dtype(ss.kv_input_dtype)
        if requested_kv_input_dtype is not None:
            asked = parse_kv_input_dtype(requested_kv_input_dtype)
            if asked != recorded:
                raise UsageError(
                    f"--kv-input-dtype {asked} contradicts the scale file, whose K/V were observed in {recorded} "
                    f"(manifest calibration.kv_input_dtype); drop --kv-input-dtype, or recalibrate with "
                    f"`kvcal calibrate --kv-input-dtype {asked}`"
                )
        return replace(self, kv_input_dtype=recorded)

    @property
    def kv_dtype(self) -> torch.dtype | None:
        return None if self.kv_input_dtype is None else KV_INPUT_DTYPES[self.kv_input_dtype]

    def texts(self) -> TextSource:
        return load_texts(self.dataset)

    def samples(self, lm: LoadedModel, source: TextSource | None = None) -> CalibrationSamples:
        """The seeded token samples (`data.samples_for_model`) of `source` (default: read `dataset` now)."""
        src = self.texts() if source is None else source
        return samples_for_model(src, lm, self.num_samples, self.seq_len, self.seed, self.text_field)

    def observe(
        self,
        model: Any,
        samples: Sequence[torch.Tensor],
        sink: KVSink,
        num_layers: int,
        progress: ProgressFn | None = None,
        phase: str = "observe",
    ) -> None:
        """Every sample through the model (`hooks.observe`, `batch_size` per forward), K/V rounded to
        `kv_input_dtype` before `sink` sees them: the one observation every pass of calibrate, drift and
        sensitivity runs."""
        observe(
            model, samples, in_dtype(sink, self.kv_dtype), num_layers, progress=progress, phase=phase,
            batch_size=self.batch_size,
        )  # fmt: skip
