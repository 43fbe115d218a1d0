"""Process groups for runs spread over several processes (torchrun, `accelerate launch`, `--num-processes N`).

A launcher starts N copies of the same `kvcal eval|calibrate` command with RANK / WORLD_SIZE / LOCAL_RANK (and
MASTER_ADDR / MASTER_PORT) in their environment — torchrun's and accelerate's contract. `setup(device)` joins the
process group (gloo on CPU, nccl on CUDA) and returns a `Dist`; without those variables it is the one-process
`Dist()` and nothing here touches torch.distributed. Work is split by `shard` (rank r takes items r, r+N, ... —
lm-eval's own split, `Task.doc_iterator(rank, world_size)`), results come back to rank 0 with `gather_objects`,
observer statistics are merged with `all_reduce_`.

A rank that dies mid-run leaves the others blocked in a collective: gloo reports the closed connection (or the
group's timeout, KVCAL_DIST_TIMEOUT_S, default 1800 s, fires) and `collective` turns that into one KvcalError. Rank
0 alone writes outputs, and only after the last collective, so a run that lost a rank is never marked complete.

Tensor parallelism (transformers' `tp_plan`) shards each layer's KV heads over the ranks: `heads_of_rank` says
which KV heads rank r holds and `slice_heads` cuts a per-head scale [H_kv] to them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch

from kvcal.errors import KvcalError, UsageError

T = TypeVar("T")

TIMEOUT_ENV = "KVCAL_DIST_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 1800.0
# Fault injection for tests (a real death, not a mock): KVCAL_FAULT="RANK:POINT:N" makes rank RANK kill itself
# (SIGKILL) the N-th time it passes fault point POINT (e.g. "1:kl-window:2", "1:calibrate-sample:1").
FAULT_ENV = "KVCAL_FAULT"

# set in the ranks `launch` starts: the launcher reports a lost rank, the survivors stay quiet
LAUNCHED_ENV = "KVCAL_LAUNCHED"


class PeerLost(KvcalError):
    """This rank stopped because another rank of the run failed (a consequence, not the cause)."""


@dataclass(frozen=True)
class Dist:
    """This process's place in the run: rank in [0, world_size)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def active(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def from_env(env: dict[str, str] | None = None) -> Dist:
    """The Dist a launcher describes in RANK / WORLD_SIZE / LOCAL_RANK (absent: one process)."""
    env = dict(os.environ) if env is None else env
    try:
        world = int(env.get("WORLD_SIZE", "1"))
        rank = int(env.get("RANK", "0"))
        local = int(env.get("LOCAL_RANK", str(rank)))
    except ValueError as exc:
        raise UsageError(
            f"RANK / WORLD_SIZE / LOCAL_RANK must be integers ({exc}); launch with torchrun"
        ) from None
    if world < 1 or not 0 <= rank < world:
        raise UsageError(f"RANK {rank} is not in [0, WORLD_SIZE {world}); launch with torchrun")
    return Dist(rank=rank, world_size=world, local_rank=local)


def backend_for(device: str) -> str:
    """gloo on CPU, nccl on CUDA (torch.distributed's defaults for each)."""
    return "nccl" if str(device).startswith("cuda") else "gloo"


def rank_device(device: str, dist: Dist) -> str:
    """Each rank of a data-parallel CUDA run gets its own GPU: 'cuda' -> 'cuda:LOCAL_RANK'."""
    if dist.active and str(device) == "cuda":
        return f"cuda:{dist.local_rank}"
    return str(device)


def timeout_s() -> float:
    raw = os.environ.get(TIMEOUT_ENV, "")
    try:
        value = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise UsageError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise UsageError(f"{TIMEOUT_ENV} must be positive, got {value}")
    return value


def setup(device: str = "cpu") -> Dist:
    """Join the launcher's process group (once per process) and return this process's Dist."""
    dist = from_env()
    if not dist.active:
        return dist
    import torch.distributed as td

    if not td.is_initialized():
        if str(device).startswith("cuda"):
            torch.cuda.set_device(dist.local_rank)
        try:
            td.init_process_group(
                backend=backend_for(device),
                rank=dist.rank,
                world_size=dist.world_size,
                timeout=timedelta(seconds=timeout_s()),
            )
        except (RuntimeError, ValueError) as exc:
            raise KvcalError(
                f"rank {dist.rank}: cannot join the process group ({_first_line(exc)}); launch all "
                f"{dist.world_size} processes with torchrun (MASTER_ADDR / MASTER_PORT set)"
            ) from exc
        signal.signal(signal.SIGTERM, _stopped_by_launcher(dist))
    return dist


def _stopped_by_launcher(dist: Dist) -> Any:
    """SIGTERM handler: torchrun stops the surviving ranks when one fails; say so instead of dying silently."""

    def handler(_signum: int, _frame: Any) -> None:
        raise PeerLost(
            f"rank {dist.rank}: stopped by the launcher because another process of this {dist.world_size}-process "
            "run failed; nothing was marked complete, rerun the same command to resume"
        )

    return handler


def check_enough_work(n_items: int, what: str, dist: Dist) -> None:
    """UsageError when there are fewer items than processes (a rank would have nothing to do)."""
    if n_items < dist.world_size:
        raise UsageError(
            f"{n_items} {what} cannot be split over {dist.world_size} processes; "
            f"use --num-processes {max(n_items, 1)} or fewer, or more {what}"
        )


def shard(items: Sequence[T], dist: Dist) -> list[T]:
    """Rank r's items: r, r + N, r + 2N, ... (lm-eval's split of documents)."""
    return list(items[dist.rank :: dist.world_size])


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


@contextmanager
def collective(what: str, dist: Dist) -> Iterator[None]:
    """Turn the failure of a collective (a peer died: closed connection, or the group timed out) into one
    KvcalError that says the run is left resumable."""
    try:
        yield
    except KvcalError:
        raise
    except (RuntimeError, ValueError) as exc:  # torch.distributed.DistError subclasses RuntimeError
        raise PeerLost(
            f"rank {dist.rank}: another process of this {dist.world_size}-process run stopped during {what} "
            f"({_first_line(exc)}); nothing was marked complete, rerun the same command to resume"
        ) from exc


def all_reduce_(tensor: torch.Tensor, op: str, dist: Dist, what: str = "merging statistics") -> None:
    """In place: tensor <- max or sum of every rank's tensor (CPU tensors; moved for nccl)."""
    if not dist.active:
        return
    import torch.distributed as td

    reduce_op = {"max": td.ReduceOp.MAX, "sum": td.ReduceOp.SUM}[op]
    work = tensor
    if td.get_backend() == "nccl":
        work = tensor.to(f"cuda:{dist.local_rank}")
    with collective(what, dist):
        td.all_reduce(work, op=reduce_op)
    if work is not tensor:
        tensor.copy_(work.cpu())


def all_gather_tensor(tensor: torch.Tensor, dist: Dist, what: str = "gathering counts") -> torch.Tensor:
    """Every rank's tensor concatenated in rank order along dim 0 (a 0-d tensor counts as [1]), on every rank —
    what lm-eval's `lm.all_gather` returns (accelerate's gather)."""
    if not dist.active:
        return tensor
    import torch.distributed as td

    t = tensor.reshape(1) if tensor.dim() == 0 else tensor.contiguous()
    out = [torch.empty_like(t) for _ in range(dist.world_size)]
    with collective(what, dist):
        td.all_gather(out, t)
    return torch.cat(out)


def gather_objects(obj: Any, dist: Dist, what: str = "gathering results") -> list[Any] | None:
    """Every rank's `obj` (picklable, produced by kvcal itself) in rank order on rank 0; None elsewhere."""
    if not dist.active:
        return [obj]
    import torch.distributed as td

    out: list[Any] | None = [None] * dist.world_size if dist.is_main else None
    with collective(what, dist):
        td.gather_object(obj, out, dst=0)
    return out


def broadcast_object(obj: Any, dist: Dist, what: str = "sharing the run state") -> Any:
    """Rank 0's `obj` on every rank."""
    if not dist.active:
        return obj
    import torch.distributed as td

    box = [obj if dist.is_main else None]
    with collective(what, dist):
        td.broadcast_object_list(box, src=0)
    return box[0]


def barrier(dist: Dist, what: str = "waiting for the other processes") -> None:
    if not dist.active:
        return
    import torch.distributed as td

    with collective(what, dist):
        td.barrier()


def finish(dist: Dist) -> None:
    """End of a run, on every rank: wait until rank 0 has written the outputs, then leave the process group.
    A rank that exits with its gloo group alive can abort in the group's teardown ("terminate called without an
    active exception", SIGABRT) while rank 0 still writes, and the launcher then reports a finished run as lost."""
    if not dist.active:
        return
    import torch.distributed as td

    if not td.is_initialized():
        return
    barrier(dist, "waiting for rank 0 to write the outputs")
    td.destroy_process_group()


_fault_counts: dict[str, int] = {}


def fault_point(name: str, dist: Dist) -> None:
    """Test hook: die here (SIGKILL, no clean-up) when KVCAL_FAULT names this rank and point (see FAULT_ENV)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    rank, _, rest = spec.partition(":")
    point, _, nth = rest.partition(":")
    if point != name or rank != str(dist.rank):
        return
    _fault_counts[name] = _fault_counts.get(name, 0) + 1
    if _fault_counts[name] >= int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)


# ---- tensor parallel: KV heads per rank ---------------------------------------------------------------------


def heads_of_rank(num_kv_heads: int, rank: int, world_size: int) -> range:
    """The KV heads rank `rank` holds when transformers' tp_plan shards k_proj / v_proj column-wise: contiguous
    equal blocks (transformers' ColwiseParallel splits the output features into world_size equal chunks in rank
    order), so num_kv_heads must divide by world_size — lm-eval checks the same (HFLM, tp_plan)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, {world_size})")
    if num_kv_heads % world_size:
        raise UsageError(
            f"{num_kv_heads} KV heads cannot be split over {world_size} tensor-parallel ranks; "
            f"use a number of processes that divides {num_kv_heads}"
        )
    per = num_kv_heads // world_size
    return range(rank * per, (rank + 1) * per)


def slice_heads(scale: torch.Tensor, num_kv_heads: int, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s part of a layer's scale: a per-head scale [H_kv] -> [H_kv / N] (its heads); a per-tensor
    scale [1] (or a 0-d one) is the same on every rank."""
    if scale.numel() == 1:
        return scale.clone()
    if scale.shape != (num_kv_heads,):
        raise ValueError(f"a per-head scale has shape [{num_kv_heads}], got {list(scale.shape)}")
    heads = heads_of_rank(num_kv_heads, rank, world_size)
    return scale[heads.start : heads.stop].clone()


# ---- launching N processes --------------------------------------------------------------------------------------


def launch_command(argv: Sequence[str], num_processes: int) -> list[str]:
    """`python -m kvcal.parallel` (torch.distributed.run's own `run`, one summary line instead of its traceback)
    starting `num_processes` copies of `kvcal ARGV` on this machine."""
    return [
        sys.executable,
        "-m",
        "kvcal.parallel",
        "--standalone",
        f"--nproc-per-node={num_processes}",
        "--monitor-interval=0.5",
        "-m",
        "kvcal.cli",
        *argv,
    ]


def launch(argv: Sequence[str], num_processes: int) -> int:
    """Run `kvcal ARGV` in `num_processes` processes (an argument list, never a shell string); returns the exit
    code (0 when every rank succeeded). Threads are split between the processes (torchrun's default is 1)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // num_processes)))
    env[LAUNCHED_ENV] = "1"
    return subprocess.run(launch_command(argv, num_processes), env=env, check=False).returncode


def _describe_failure(rank: int, failure: Any) -> str:
    code = int(getattr(failure, "exitcode", 1) or 1)
    if code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with code {code}"
    return f"rank {rank} {how}"


def _first_failure(failures: dict[int, Any]) -> tuple[int, Any]:
    """The rank that failed first. torch stamps a killed process's failure with the second it was noticed, so the
    rank that died and the peers that followed it share a timestamp: a peer whose collective lost the other side
    aborts (SIGABRT), and the agent stops the rest (SIGTERM). Those are consequences, so they lose the tie; among
    equals torch's own order stands (the order it recorded the failures in, as its get_first_failure keeps)."""
    consequences = (-signal.SIGABRT, -signal.SIGTERM)

    def key(item: tuple[int, tuple[int, Any]]) -> tuple[float, bool, int]:
        order, (_rank, failure) = item
        code = int(getattr(failure, "exitcode", 1) or 1)
        return (float(getattr(failure, "timestamp", 0) or 0), code in consequences, order)

    return min(enumerate(failures.items()), key=key)[1]


def _launcher_main(args: Sequence[str]) -> int:
    """torch.distributed.run with its ChildFailedError traceback replaced by one `Error:` line naming the rank
    that failed first (ranks that fail with their own Error line have printed it already)."""
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # the agent's per-event log lines ("Sending process N closing signal", "failed (exitcode ...)"): the summary
    # below says the same once
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)

    try:
        run(parse_args(list(args)))
    except ChildFailedError as exc:
        rank, failure = _first_failure(exc.failures)
        code = int(getattr(failure, "exitcode", 1) or 1)
        if code < 0:  # killed: it printed nothing itself
            print(
                f"Error: {_describe_failure(rank, failure)}; the other processes were stopped and nothing was "
                "marked complete: rerun the same command to resume",
                file=sys.stderr,
            )
        return code if code > 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(_launcher_main(sys.argv[1:]))
