"""The divergence task's passes over a batch of prompts (kvcal.evaluate.divergence: greedy_batch,
teacher_forced_batch, prefilled_batch) against the same passes at batch 1 (greedy, teacher_forced, prefilled), per
sample, on tiny random-weight models.

Exact where kvcal owns the result: float64 weights with K/V rounded to bf16 before they are stored (the engines'
serving dtype, `kvcal eval`'s default), so a row's K/V in a batch of 4 and alone round to the same bf16 values and
every format stores the same codes and scales (the matmuls of another batch shape differ in the last float64 bits
only). Then the greedy tokens and their top-k are identical, and the logits agree to float32 rounding: kvcal
attends in float32 and the passes hand back float32 logits (relative 1e-6 of the largest logit, ~8 float32 ulps;
measured 5e-8; any format's damage is 1e-3 and more). `--scales first-batch` is the one batch-dependent
policy (its scale is the first write's, B prompts at batch B): shown to differ, as it must."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvcal.evaluate.divergence import (
    greedy,
    greedy_batch,
    group_prompts,
    prefilled,
    prefilled_batch,
    teacher_forced,
    teacher_forced_batch,
    trajectory_key,
)
from kvcal.evaluate.kl import forward_session
from kvcal.kernels.runtime import KVRuntime

pytestmark = pytest.mark.usefixtures("one_thread")

# four prompts of different lengths (left padding up to 14 tokens), decoded 10 tokens: the tiny models' 64
# positions hold them, and gemma3's sliding layers (window 8) slide in every row
_G = torch.Generator().manual_seed(7)
PROMPTS = [[int(x) for x in torch.randint(3, 300, (n,), generator=_G)] for n in (14, 5, 9, 11)]
GEN = 10
# formats whose stored codes do not depend on the batch (static, per-token, per-block and per-sequence scales)
FORMATS = [
    ("auto", "one"),
    ("bf16", "one"),
    ("fp8_e4m3", "one"),
    ("int8_per_token_head", "one"),
    ("nvfp4", "one"),
    ("nvfp4", "per_sequence"),
    ("fp4_e2m1", "one"),
]  # mxfp4's 32-element blocks need head_dim 32; the tiny models' is 16 (nvfp4's 16-element blocks stand for it)


def _model(tiny_model: Callable[[str], Any], arch: str) -> Any:
    model = copy.deepcopy(tiny_model(arch)).double()
    with torch.no_grad():  # rows of different scale, so a scale shared across rows would show
        model.get_input_embeddings().weight.mul_(torch.linspace(0.2, 5.0, model.config.vocab_size)[:, None])
    return model


def _runtime(model: Any, fmt: str, policy: str, first_batch: bool = False) -> Callable[[], Any]:
    def session() -> Any:
        if fmt == "auto":
            from transformers.cache_utils import DynamicCache

            KVRuntime(model, "auto")
            return forward_session(model, DynamicCache(config=model.config))
        rt = KVRuntime(
            model, fmt, impl="torch", nvfp4_global=policy, kv_input_dtype="bfloat16", first_batch=first_batch
        )
        return forward_session(model, rt.new_cache())

    return session


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6 * float(b.abs().max()))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # gemma3: sliding layers and a full one
@pytest.mark.parametrize(("fmt", "policy"), FORMATS)
def test_batched_passes_equal_batch_1_per_sample(
    tiny_model: Callable[[str], Any], arch: str, fmt: str, policy: str
) -> None:
    model = _model(tiny_model, arch)
    session = _runtime(model, fmt, policy)
    with torch.no_grad():
        alone = [greedy(session(), torch.tensor([p]), GEN, set()) for p in PROMPTS]
        # an EOS row 0 meets first at its 3rd token or later: rows stop at different steps and advance with the
        # batch after
        row0 = alone[0][0]
        stop = next(k for k in range(2, GEN) if row0[k] not in row0[:k])
        eos = {row0[stop]}
        alone = [greedy(session(), torch.tensor([p]), GEN, eos) for p in PROMPTS]
        together = greedy_batch(session(), PROMPTS, GEN, eos, "cpu")
    assert len(alone[0][0]) == stop + 1
    for (t1, k1), (tb, kb) in zip(alone, together, strict=True):
        assert tb == t1  # the same tokens, row by row
        assert torch.equal(kb, k1)  # and the same top-k at every step

    # teacher forcing of the rows' own trajectories (different lengths), and their chunked prefill (chunks of 6)
    trajs = [t for t, _ in alone]
    got: dict[str, list[list[torch.Tensor]]] = {"dec": [[] for _ in PROMPTS], "pre": [[] for _ in PROMPTS]}

    def keep(name: str) -> Callable[[int, int, torch.Tensor], None]:
        def take(i: int, r: int, logits: torch.Tensor) -> None:
            assert r == sum(x.shape[0] for x in got[name][i])  # rows arrive in order
            got[name][i].append(logits)

        return take

    seqs = [p + t[:-1] for p, t in zip(PROMPTS, trajs, strict=True)]
    firsts = [len(p) - 1 for p in PROMPTS]
    with torch.no_grad():
        teacher_forced_batch(session(), PROMPTS, trajs, "cpu", keep("dec"))
        prefilled_batch(model, session(), seqs, firsts, 6, "cpu", keep("pre"))
        for i, (p, t) in enumerate(zip(PROMPTS, trajs, strict=True)):
            dec1 = teacher_forced(session(), torch.tensor([p]), t)
            pre1 = prefilled(session(), torch.tensor([seqs[i]]), firsts[i], 6)
            assert dec1.shape[0] == pre1.shape[0] == len(t)
            _close(torch.cat(got["dec"][i]), dec1)
            _close(torch.cat(got["pre"][i]), pre1)


def test_first_batch_scales_depend_on_the_batch(tiny_model: Callable[[str], Any]) -> None:
    """vLLM's calculate_kv_scales takes its scales from the first write: at batch 4 that is the four prompts', so
    row 1 (the shortest prompt) is quantized with another scale than alone; the static scale is not."""
    model = _model(tiny_model, "llama")

    def gap(first_batch: bool) -> float:
        with torch.no_grad():
            traj = greedy(
                _runtime(model, "fp8_e4m3", "one", first_batch)(), torch.tensor([PROMPTS[1]]), GEN, set()
            )[0]
            rows: list[torch.Tensor] = []
            teacher_forced_batch(
                _runtime(model, "fp8_e4m3", "one", first_batch)(), PROMPTS, [traj] * 4, "cpu",
                lambda i, _r, x: rows.append(x) if i == 1 else None,
            )  # fmt: skip
            alone = teacher_forced(
                _runtime(model, "fp8_e4m3", "one", first_batch)(), torch.tensor([PROMPTS[1]]), traj
            )
        return float((torch.cat(rows) - alone).abs().max() / alone.abs().max())

    assert gap(False) < 1e-6 < 1e-4 < gap(True)


def test_batches_are_longest_first_and_cover_every_prompt_once() -> None:
    prompts = [[1] * n for n in (3, 7, 5, 7, 2)]
    assert group_prompts(prompts, 1) == [[0], [1], [2], [3], [4]]
    assert group_prompts(prompts, 2) == [[1, 3], [2, 0], [4]]
    assert sorted(i for g in group_prompts(prompts, 4) for i in g) == list(range(5))


def test_batch_1_keeps_its_trajectory_key_and_a_batch_has_its_own() -> None:
    args: tuple[Any, ...] = ("fp", {"kv_format": "bf16"}, [1, 2, 3], 8, {0})
    k1 = trajectory_key(*args)
    assert trajectory_key(*args, [[1, 2, 3]]) == k1  # batch 1: the key it always had (caches stay valid)
    kb = trajectory_key(*args, [[1, 2, 3], [4, 5]])
    assert kb != k1 and kb != trajectory_key(*args, [[1, 2, 3], [4, 6]])
