"""Prefill and decode timing of an evaluation's model forwards, as serving engines report them (TTFT, TPOT).

Every forward of the evaluated model is classified by its input and its cache:
- **prefill**: a forward over an empty cache (or no cache), or one with more than one new token per sequence
  (a prompt, a chunk of a chunked prefill, a loglikelihood batch);
- **decode step**: one new token per sequence over a non-empty cache (one step of `generate`).

Time to first token (TTFT) of a request is the time of the prefill forward(s) of its `generate` call (the first
token is sampled from the prefill's logits); every sequence of a batched call shares its call's TTFT. Time per
output token (TPOT) is decode seconds per decode step (each step gives every sequence of the batch one token).

Token counts are the positions the forwards processed: a batch's padding is included (with batch size 1 there is
none), and in a batched `generate` a sequence that already stopped still advances with the others (transformers
runs the whole batch until every sequence is done). Seconds are wall time around each forward (CUDA synchronised
on both sides), so tokenisation, sampling and lm-eval's bookkeeping are not counted. What is timed is kvcal's
emulation of the quantized cache on this machine (dequantize, then attend), with whatever else runs there at the
same time: not a serving engine's throughput.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any

PREFILL = "prefill"
DECODE = "decode"
# A task part's key (kvcal.evaluate.runstore) holding its ForwardTotals record: the run's totals and medians are
# computed from these, so a resumed run counts the tasks it finished before.
FORWARDS_KEY = "kvcal_forward_totals"


@dataclass
class ForwardTotals:
    """Counts and seconds of the forwards of one task (or of a whole run, merged), and the TTFT of each
    request of its generate calls."""

    prefill_forwards: int = 0
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_steps: int = 0
    decode_tokens: int = 0
    decode_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)  # one per generated sequence

    @property
    def tokens(self) -> int:
        """Every position a forward processed (metrics.json's `tokens`, as it was counted before the split)."""
        return self.prefill_tokens + self.decode_tokens

    def to_record(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> ForwardTotals:
        return cls(**{k: record[k] for k in cls.__dataclass_fields__ if k in record})

    @classmethod
    def merge(cls, parts: list[ForwardTotals]) -> ForwardTotals:
        """Summed over tasks or processes (several processes: seconds add up, so rates stay per process)."""
        out = cls()
        for p in parts:
            out.prefill_forwards += p.prefill_forwards
            out.prefill_tokens += p.prefill_tokens
            out.prefill_s += p.prefill_s
            out.decode_steps += p.decode_steps
            out.decode_tokens += p.decode_tokens
            out.decode_s += p.decode_s
            out.ttft_s.extend(p.ttft_s)
        return out

    def summary(self) -> dict[str, Any]:
        """metrics.json's timing fields (docs/run-directory.md); a rate or time is None where nothing was timed."""
        return {
            "prefill_tokens": self.prefill_tokens,
            "prefill_s": self.prefill_s,
            "prefill_tokens_per_s": _rate(self.prefill_tokens, self.prefill_s),
            "requests": len(self.ttft_s),
            "ttft_s_mean": statistics.fmean(self.ttft_s) if self.ttft_s else None,
            "ttft_s_median": statistics.median(self.ttft_s) if self.ttft_s else None,
            "decode_steps": self.decode_steps,
            "decode_tokens": self.decode_tokens,
            "decode_s": self.decode_s,
            "decode_tokens_per_s": _rate(self.decode_tokens, self.decode_s),
            "tpot_s": self.decode_s / self.decode_steps if self.decode_steps else None,
        }


def run_timing(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """metrics.json's run-level timing fields: the tasks' ForwardTotals merged. A part without a record (a task
    finished by a kvcal that did not time forwards, then resumed) leaves every field None rather than a total
    that misses it."""
    records = [p.get(FORWARDS_KEY) for p in parts]
    if any(r is None for r in records):
        return {k: None for k in ForwardTotals().summary()}
    return ForwardTotals.merge([ForwardTotals.from_record(r) for r in records]).summary()


def _rate(n: int, seconds: float) -> float | None:
    return n / seconds if n and seconds > 0 else None


def classify(new_tokens: int, cached: int) -> str:
    """PREFILL or DECODE for a forward of `new_tokens` new tokens per sequence over `cached` cached tokens
    (every sequence of a batch gets the same number of new tokens)."""
    return DECODE if new_tokens == 1 and cached > 0 else PREFILL


@dataclass
class _GenerateCall:
    batch: int
    prefill_s: float = 0.0
    decoding: bool = False  # a decode step has run: the first token came before it


class ForwardTimer:
    """Times every forward of `model` (forward pre- and post-hooks) into ForwardTotals; `generate_call()` marks
    the forwards of one generate call so that its prefill becomes its requests' TTFT. `take()` hands over the
    totals so far and starts new ones (one per task); `close()` removes the hooks."""

    def __init__(self, model: Any) -> None:
        self.totals = ForwardTotals()
        self._call: _GenerateCall | None = None
        self._started: tuple[float, str] | None = None  # (perf_counter, kind) of the running forward
        first = next(model.parameters(), None)
        self._cuda = first is not None and first.device.type == "cuda"
        self._handles = [
            model.register_forward_pre_hook(self._before, with_kwargs=True),
            model.register_forward_hook(self._after, with_kwargs=True),
        ]

    def _now(self) -> float:
        if self._cuda:  # kernels run asynchronously: wait for them, or the time is the launch's
            import torch

            torch.cuda.synchronize()
        return time.perf_counter()

    def _before(self, _module: Any, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")  # [B, T, H]
        if ids is None:
            return
        batch, new = (1, int(ids.shape[0])) if ids.dim() == 1 else (int(ids.shape[0]), int(ids.shape[1]))
        past = kwargs.get("past_key_values")
        seq_len = getattr(past, "get_seq_length", None)
        cached = int(seq_len()) if callable(seq_len) else 0
        kind = classify(new, cached)
        if kind == PREFILL:
            self.totals.prefill_forwards += 1
            self.totals.prefill_tokens += batch * new
        else:
            self.totals.decode_steps += 1
            self.totals.decode_tokens += batch
        self._started = (self._now(), kind)

    def _after(self, _module: Any, _args: tuple, _kwargs: dict, _out: Any) -> None:
        if self._started is None:
            return
        t0, kind = self._started
        self._started = None
        dt = self._now() - t0
        call = self._call
        if kind == PREFILL:
            self.totals.prefill_s += dt
            if call is not None and not call.decoding:
                call.prefill_s += dt
        else:
            self.totals.decode_s += dt
            if call is not None:
                call.decoding = True

    @contextmanager
    def generate_call(self, batch: int) -> Iterator[None]:
        """The forwards inside are one generate call of `batch` sequences (kvcal's lm-eval adapter wraps
        `_model_generate` in this)."""
        self._call = call = _GenerateCall(batch)
        try:
            yield
        finally:
            self._call = None
        if call.prefill_s > 0:
            self.totals.ttft_s.extend([call.prefill_s] * call.batch)

    def take(self) -> ForwardTotals:
        out, self.totals = self.totals, ForwardTotals()
        return out

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def generate_call(timer: ForwardTimer | None, batch: int) -> AbstractContextManager[None]:
    """`timer.generate_call(batch)`, or nothing when no timer runs (lm-eval's own command line)."""
    return timer.generate_call(batch) if timer is not None else nullcontext()
