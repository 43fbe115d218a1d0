"""kvcal.parallel without a process group: the launcher's environment, the split of the work, per-rank KV heads
(tensor parallel), the merge of observer statistics and the command line `--num-processes` rebuilds."""

from __future__ import annotations

import sys

import pytest
import torch
import typer
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from kvcal import parallel
from kvcal.calibrate.observers import TensorStats, get_observer
from kvcal.commands.launch import command_argv
from kvcal.commands.options import NumProcessesOpt
from kvcal.errors import UsageError
from kvcal.formats import get_format


def test_from_env_reads_the_launchers_variables() -> None:
    assert parallel.from_env({}) == parallel.Dist(0, 1, 0)
    d = parallel.from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})
    assert (d.rank, d.world_size, d.local_rank, d.active, d.is_main) == (3, 4, 1, True, False)
    for bad in ({"RANK": "x", "WORLD_SIZE": "2"}, {"RANK": "2", "WORLD_SIZE": "2"}, {"WORLD_SIZE": "0"}):
        with pytest.raises(UsageError, match="torchrun"):
            parallel.from_env(bad)


def test_backend_and_device_per_rank() -> None:
    assert parallel.backend_for("cpu") == "gloo" and parallel.backend_for("cuda:0") == "nccl"
    d = parallel.Dist(rank=3, world_size=4, local_rank=1)
    assert parallel.rank_device("cuda", d) == "cuda:1" and parallel.rank_device("cpu", d) == "cpu"
    assert parallel.rank_device("cuda", parallel.Dist()) == "cuda"


def test_shards_cover_the_work_once_in_lm_evals_order() -> None:
    items = list(range(11))
    shards = [parallel.shard(items, parallel.Dist(r, 3)) for r in range(3)]
    assert shards[0] == [0, 3, 6, 9] and shards[2] == [2, 5, 8]
    assert sorted(x for s in shards for x in s) == items


def test_fewer_items_than_processes_is_one_usage_error() -> None:
    parallel.check_enough_work(2, "samples", parallel.Dist(0, 2))
    with pytest.raises(
        UsageError, match=r"3 samples cannot be split over 4 processes; use --num-processes 3"
    ):
        parallel.check_enough_work(3, "samples", parallel.Dist(0, 4))


def test_timeout_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(parallel.TIMEOUT_ENV, "12.5")
    assert parallel.timeout_s() == 12.5
    monkeypatch.setenv(parallel.TIMEOUT_ENV, "soon")
    with pytest.raises(UsageError, match=parallel.TIMEOUT_ENV):
        parallel.timeout_s()


# ---- tensor parallel: which KV heads a rank holds ---------------------------------------------------------------


def test_heads_of_rank_are_contiguous_equal_blocks() -> None:
    assert [list(parallel.heads_of_rank(8, r, 4)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(UsageError, match="3 KV heads cannot be split over 2"):
        parallel.heads_of_rank(3, 0, 2)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([(1, 1), (2, 2), (4, 2), (8, 4), (8, 8), (6, 3)]), st.data())
def test_slice_heads_reassembles_the_per_head_scale(hw: tuple[int, int], data: st.DataObject) -> None:
    heads, world = hw
    values = data.draw(st.lists(st.floats(0.5, 1024.0, width=32), min_size=heads, max_size=heads))
    scale = torch.tensor(values, dtype=torch.float32)  # [H_kv]
    parts = [parallel.slice_heads(scale, heads, r, world) for r in range(world)]
    assert all(p.shape == (heads // world,) for p in parts)
    assert torch.equal(torch.cat(parts), scale)  # bit-exact: slicing, no arithmetic
    tensor_scale = torch.tensor([0.5])
    assert all(
        torch.equal(parallel.slice_heads(tensor_scale, heads, r, world), tensor_scale) for r in range(world)
    )


def test_slice_heads_refuses_a_scale_of_another_model() -> None:
    with pytest.raises(ValueError, match=r"per-head scale has shape \[4\]"):
        parallel.slice_heads(torch.ones(3), 4, 0, 2)


# ---- merged observer statistics == one stream over all samples ---------------------------------------------------


def _stream(samples: list[torch.Tensor]) -> TensorStats:
    ts = TensorStats(samples[0].shape[1])
    for x in samples:
        ts.update(x)
    return ts


@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_merged_stats_give_the_single_stream_scales(granularity: str) -> None:
    g = torch.Generator().manual_seed(0)
    samples = [torch.randn(1, 3, int(t), 8, generator=g) * (1 + i) for i, t in enumerate([5, 9, 4, 7, 6])]
    one = _stream(samples)
    ranks = [_stream(parallel.shard(samples, parallel.Dist(r, 2))) for r in range(2)]
    merged = ranks[0]
    merged.merge_(ranks[1])
    assert torch.equal(merged.amax, one.amax) and torch.equal(merged.count, one.count)
    torch.testing.assert_close(merged.sum1, one.sum1, rtol=1e-12, atol=0)
    torch.testing.assert_close(merged.sum2, one.sum2, rtol=1e-12, atol=0)
    fmt = get_format("fp8_e4m3")
    for name in ("minmax", "percentile"):  # amax and counts only: bit-exact
        obs = get_observer(name)
        assert torch.equal(
            obs.clip(merged.grouped(granularity), fmt), obs.clip(one.grouped(granularity), fmt)
        )
    mse = get_observer("mse")  # sums of |x| and x^2 in another order: the same grid point here
    torch.testing.assert_close(
        mse.clip(merged.grouped(granularity), fmt), mse.clip(one.grouped(granularity), fmt), rtol=0, atol=0
    )


# ---- --num-processes: the command line handed to torchrun -----------------------------------------------------


def test_launch_command_is_an_argument_list_for_torchrun() -> None:
    cmd = parallel.launch_command(["eval", "m", "--tasks", "kl; rm -rf /"], 2)
    assert cmd[:3] == [sys.executable, "-m", "kvcal.parallel"] and "--nproc-per-node=2" in cmd
    assert cmd[-4:] == ["eval", "m", "--tasks", "kl; rm -rf /"]  # one argument, never a shell


def test_command_argv_rebuilds_the_options(monkeypatch: pytest.MonkeyPatch) -> None:
    """The argv `--num-processes` relaunches: every non-default option, flags, repeated options; a value read
    from an environment variable (a password) goes in the environment, not on the command line."""
    seen: dict[str, object] = {}
    app = typer.Typer()

    @app.command("eval")
    def cmd(
        ctx: typer.Context,
        model: str,
        tasks: list[str] = typer.Option(["x"], "--tasks"),
        limit: int | None = typer.Option(None, "--limit"),
        strict: bool = typer.Option(False, "--strict"),
        secret: str | None = typer.Option(None, "--secret", envvar="KVCAL_TEST_SECRET"),
        num_processes: NumProcessesOpt = 1,
    ) -> None:
        seen["argv"], seen["env"] = command_argv(ctx)

    args = ["m", "--tasks", "a", "--tasks", "b", "--strict", "--secret", "pw", "--num-processes", "2"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert seen["argv"] == ["eval", "m", "--tasks", "a", "--tasks", "b", "--strict"]
    assert seen["env"] == {"KVCAL_TEST_SECRET": "pw"}


def test_the_first_failure_is_the_killed_rank_not_the_peer_that_aborted() -> None:
    # torch stamps a killed process's failure with the second it noticed it: a rank killed from outside and the peer
    # whose collective then aborted (SIGABRT) share it, and torch's own choice names the lower rank
    import signal

    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    aborted = ProcessFailure(local_rank=0, pid=10, exitcode=-signal.SIGABRT, error_file="<N/A>")
    killed = ProcessFailure(local_rank=1, pid=11, exitcode=-signal.SIGKILL, error_file="<N/A>")
    killed.timestamp = aborted.timestamp
    assert parallel._first_failure({0: aborted, 1: killed})[0] == 1
    stopped = ProcessFailure(local_rank=0, pid=10, exitcode=-signal.SIGTERM, error_file="<N/A>")
    stopped.timestamp = killed.timestamp  # the agent stopping the others (SIGTERM) is a consequence too
    assert parallel._first_failure({0: stopped, 1: killed})[0] == 1
    other = ProcessFailure(local_rank=1, pid=11, exitcode=-signal.SIGKILL, error_file="<N/A>")
    other.timestamp = killed.timestamp  # two equal kills: torch's recorded order stands
    assert parallel._first_failure({1: other, 0: killed})[0] == 1
    killed.timestamp = aborted.timestamp + 1  # a later kill: the earlier abort came first
    assert parallel._first_failure({0: aborted, 1: killed})[0] == 0
    assert "rank 1 was killed by SIGKILL" == parallel._describe_failure(1, killed)
