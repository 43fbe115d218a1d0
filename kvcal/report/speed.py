"""The report's speed section: kvcal's *emulation* speed, prefill and decode apart, never serving throughput.

kvcal runs a quantized cache by dequantizing it and attending in torch (or Triton): its speed says how fast the
emulator ran on the machine of the run, not how fast an engine with native FP8/FP4 kernels serves. So the report
shows rates only side by side, per task, for runs timed comparably — the same device, GPU and host as the
baseline's run of that task (env.json) and both timed by forward (metrics.json's prefill / decode fields,
kvcal.evaluate.timing) — and says that load from other processes on the machine is not controlled. Left out:
kvcal's `kl` (each run also computes, or reads from disk, the BF16 reference beside the evaluated forwards) and
runs that cannot be compared (the sentences in `left_out`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvcal.report.runs import Run

KL_TASK = "kl"  # = kvcal.evaluate.tasks.KL_TASK (report does not import evaluate)
_MACHINE_KEYS = ("device", "gpu", "host")


@dataclass(frozen=True)
class SpeedRow:
    """One configuration's emulation speed on one task, with its ratios to the baseline's run of the task."""

    task: str
    config: str
    prefill_tokens_per_s: float | None
    prefill_vs_baseline: float | None
    ttft_s_median: float | None
    decode_tokens_per_s: float | None
    decode_vs_baseline: float | None
    tpot_s: float | None


@dataclass
class EmulationSpeed:
    device: str  # where the compared runs ran: 'cpu on HOST' | 'cuda:0 (NVIDIA H200) on HOST'
    rows: list[SpeedRow] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)  # why a task or configuration is not shown

    def to_dict(self) -> dict[str, Any]:
        return {
            "what": f"emulation speed on {self.device} (not serving throughput); concurrent load not controlled",
            "device": self.device,
            "rows": [asdict(r) for r in self.rows],
            "left_out": self.left_out,
        }


def _machine(run: Run) -> tuple[Any, ...] | None:
    """(device, gpu, host) from env.json; None when the run did not record its host (older kvcal)."""
    if not run.env.get("host"):
        return None
    return tuple(run.env.get(k) for k in _MACHINE_KEYS)


def machine_words(machine: tuple[Any, ...]) -> str:
    device, gpu, host = machine
    return f"{device}{f' ({gpu})' if gpu else ''} on {host}"


def _timed(run: Run, task: str) -> dict[str, Any] | None:
    """The task's metrics.json timing when the run timed its forwards (prefill / decode fields), else None."""
    per_task = run.metrics.get("per_task")
    m = per_task.get(task) if isinstance(per_task, dict) else None
    return m if isinstance(m, dict) and "prefill_tokens_per_s" in m else None


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _ratio(x: float | None, base: float | None) -> float | None:
    return x / base if x is not None and base else None


def emulation_speed(
    configs: Sequence[tuple[str, Sequence[Run]]], tasks: Sequence[str]
) -> EmulationSpeed | None:
    """The speed rows of every (task, configuration) timed comparably with the baseline (`configs[0]`), or
    None when no configuration besides the baseline has one."""
    (base_label, base_runs), others = configs[0], configs[1:]
    rows: list[SpeedRow] = []
    left_out: list[str] = []
    machines: list[tuple[Any, ...]] = []
    for task in tasks:
        if task == KL_TASK:
            left_out.append("kl: each run also computes (or reads from disk) the BF16 reference beside its own "
                            "forwards, so its time is not the format's")  # fmt: skip
            continue
        base = next((r for r in base_runs if task in r.samples), None)
        base_m = _timed(base, task) if base is not None else None
        machine = _machine(base) if base is not None else None
        if base_m is None or machine is None:
            left_out.append(f"{task}: the baseline's run did not record its timing or host (an older kvcal)")
            continue
        task_rows = []
        for label, runs in others:
            run = next((r for r in runs if task in r.samples), None)
            if run is None:
                continue
            m, theirs = _timed(run, task), _machine(run)
            if m is None or theirs is None:
                left_out.append(f"{task} · {label}: no timing or host recorded (an older kvcal)")
                continue
            if theirs != machine:
                left_out.append(f"{task} · {label}: timed on {machine_words(theirs)}, the baseline on "
                                f"{machine_words(machine)}")  # fmt: skip
                continue
            task_rows.append(_row(task, label, m, base_m))
        if task_rows:
            machines.append(machine)
            rows += [_row(task, base_label, base_m, base_m), *task_rows]
    if not rows:
        return None
    device = ", ".join(dict.fromkeys(machine_words(m) for m in machines))
    return EmulationSpeed(device=device, rows=rows, left_out=left_out)


def _row(task: str, label: str, m: dict[str, Any], base: dict[str, Any]) -> SpeedRow:
    prefill, decode = _num(m.get("prefill_tokens_per_s")), _num(m.get("decode_tokens_per_s"))
    return SpeedRow(
        task=task,
        config=label,
        prefill_tokens_per_s=prefill,
        prefill_vs_baseline=_ratio(prefill, _num(base.get("prefill_tokens_per_s"))),
        ttft_s_median=_num(m.get("ttft_s_median")),
        decode_tokens_per_s=decode,
        decode_vs_baseline=_ratio(decode, _num(base.get("decode_tokens_per_s"))),
        tpot_s=_num(m.get("tpot_s")),
    )


def speed_heading(speed: EmulationSpeed) -> str:
    return f"Emulation speed on {speed.device} (not serving throughput)"


def speed_intro() -> str:
    return (
        "kvcal's emulation of each cache (dequantize, then attend) timed forward by forward, side by side on one "
        "machine; a serving engine's FP8/FP4 kernels run at other speeds. Prefill: tokens/s of the prompt "
        "forwards and the median time to first token of generated requests; decode: generated tokens/s and the "
        "time per output token (one decode step). Load from other processes on the machine is not controlled: "
        "rerun side by side before reading a ratio as the format's."
    )
