"""`parallel.finish` on a real two-process gloo group: no rank leaves before rank 0 has written its outputs, and
every rank leaves the group (a rank exiting with its group alive can abort in gloo's teardown, SIGABRT — the
launcher then reports a finished run as lost; CI saw it once)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import torch.multiprocessing as mp

from kvcal import parallel

WRITE_S = 1.0  # rank 0's "writing the outputs"


def _rank(rank: int, port: int, out: str) -> None:
    import os

    import torch.distributed as td

    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
         "MASTER_PORT": str(port)}
    )  # fmt: skip
    dist = parallel.setup("cpu")
    if dist.is_main:
        time.sleep(WRITE_S)
    wrote = time.monotonic()
    parallel.finish(dist)
    left = time.monotonic()
    Path(out, f"rank{rank}").write_text(f"{wrote} {left} {int(td.is_initialized())}")


def test_every_rank_waits_for_rank_0_then_leaves_the_group(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, str(tmp_path)), nprocs=2, join=True)
    (w0, _, init0), (_, left1, init1) = (
        [float(x) for x in (tmp_path / f"rank{r}").read_text().split()] for r in (0, 1)
    )
    assert init0 == 0 and init1 == 0  # both left the process group
    assert left1 >= w0  # rank 1 returned only after rank 0 was done writing
    assert parallel.finish(parallel.Dist()) is None  # one process: nothing to leave
