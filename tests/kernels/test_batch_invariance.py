"""A sample's stored K/V and logits never depend on its batch (issue 13): padding is not stored, every dynamic
scale is per sequence over its real tokens, and a per-sequence nvfp4 global is fixed at the sequence's first write.

Exact comparisons: a sequence alone (batch 1) against the same sequence in a padded batch of 4 whose other rows are
1000x larger and whose padding holds NaN/Inf — the stored codes and scales of its real tokens are bit-identical,
and through a tiny model (same padded length, so the same attention code path) its logits are identical."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvcal import formats
from kvcal.kernels.cache import LayerPlan, QuantizedKVCache
from kvcal.kernels.runtime import KVRuntime

pytestmark = pytest.mark.usefixtures("one_thread")

FORMATS = ["bf16", "fp8_e4m3", "fp8_e5m2", "int8_per_token_head", "nvfp4", "fp4_e2m1", "mxfp4"]
# (format, nvfp4 policy): nvfp4 in both of its policies
CASES = [(f, "one") for f in FORMATS] + [("nvfp4", "per_sequence")]
H, D, N, T = 2, 32, 7, 11  # KV heads, head_dim, real tokens of the sequence, padded length of the batch


def _padded_batch(x: torch.Tensor, side: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [1, H, N, D] as row 1 of a [4, H, T, D] batch: other rows 1000x larger, every padding position NaN/+-Inf;
    returns (batch, attention mask [4, T])."""
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(4, H, T, D, generator=g) * 1000
    mask = torch.ones(4, T, dtype=torch.long)
    lengths = [T, N, T - 3, 2]
    for row, n in enumerate(lengths):
        pad = slice(0, T - n) if side == "left" else slice(n, T)
        mask[row, pad] = 0
        junk = torch.tensor([float("nan"), float("inf"), -float("inf")]).repeat(T)[: T - n]
        big[row, :, pad] = junk[None, :, None]
    real = slice(T - N, T) if side == "left" else slice(0, N)
    big[1, :, real] = x[0]
    return big, mask


def _real(q: formats.QTensor, row: int, real: slice) -> formats.QTensor:
    bs = None if q.block_scales is None else q.block_scales[row : row + 1, :, real]
    s = q.scale[row : row + 1] if q.scale is not None and q.scale.dim() == 4 else q.scale
    return formats.QTensor(codes=q.codes[row : row + 1, :, real], block_scales=bs, scale=s)


def _bits(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return t.view(torch.uint8) if t.element_size() == 1 else t.flatten().view(torch.uint8)


def _same_storage(a: formats.QTensor, b: formats.QTensor) -> bool:
    pairs = [(a.codes, b.codes), (a.block_scales, b.block_scales), (a.scale, b.scale)]
    for x, y in pairs:
        if (x is None) != (y is None):
            return False
        if x is not None and not torch.equal(_bits(x.contiguous()), _bits(y.contiguous())):
            return False
    return True


def _write(fmt: str, policy: str, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, decode: int):
    """A prefill of k/v under `mask`, then `decode` one-token writes (all real); returns the layer."""
    plan = LayerPlan(index=0, fmt=formats.get_format(fmt), nvfp4_global=policy)
    cache = QuantizedKVCache([plan])
    cache.set_attention_mask(mask)
    cache.update(k, v, 0)
    g = torch.Generator().manual_seed(99)
    step = torch.randn(1, H, 1, D, generator=g) * 4  # larger than the prefill: the fixed global must clip it
    for _ in range(decode):
        b = k.shape[0]
        m = None if mask is None else torch.cat([mask, torch.ones(b, 1, dtype=mask.dtype)], dim=1)
        cache.set_attention_mask(m)
        cache.update(step.expand(b, -1, -1, -1), -step.expand(b, -1, -1, -1), 0)
        mask = m
    return cache.layers[0]


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize(("fmt", "policy"), CASES)
def test_stored_kv_of_a_sequence_does_not_depend_on_its_batch(fmt: str, policy: str, side: str) -> None:
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(1, H, N, D, generator=g), torch.randn(1, H, N, D, generator=g) * 0.1
    alone = _write(fmt, policy, k, v, None, decode=2)
    bk, mask = _padded_batch(k, side, seed=4)
    bv, _ = _padded_batch(v, side, seed=5)
    batched = _write(fmt, policy, bk, bv, mask, decode=2)
    real = slice(T - N, T + 2) if side == "left" else slice(0, N)  # right padding: decode follows the padding
    want = slice(0, N + 2) if side == "left" else slice(0, N)
    for which in ("k", "v"):
        got, ref = getattr(batched, which), getattr(alone, which)
        assert _same_storage(_real(got, 1, real), _real(ref, 0, want)), (fmt, which)
        if side == "right":  # the decode tokens, after the padding
            assert _same_storage(_real(got, 1, slice(T, T + 2)), _real(ref, 0, slice(N, N + 2)))
    # padding is stored as zeros (its NaN/Inf never reach the storage)
    stored = formats.dequantize(batched.k, fmt)[1]  # [H, T + 2, D]
    pad = stored[:, : T - N] if side == "left" else stored[:, N:T]
    assert torch.equal(pad, torch.zeros_like(pad))


def test_per_sequence_global_is_fixed_at_the_sequences_first_write() -> None:
    """A sequence whose first write is all padding fixes its global at its next write, the others keep theirs."""
    plan = LayerPlan(index=0, fmt=formats.get_format("nvfp4"), nvfp4_global="per_sequence")
    cache = QuantizedKVCache([plan])
    x = torch.randn(2, H, 3, D)
    cache.set_attention_mask(torch.tensor([[1, 1, 1], [0, 0, 0]]))
    cache.update(x, x, 0)
    g0 = cache.layers[0].k.scale.clone()
    assert g0[1].item() == 1.0 and torch.equal(g0[0:1], formats.nvfp4_dynamic_global(x[0:1]))
    y = torch.randn(2, H, 1, D) * 100
    cache.set_attention_mask(None)
    cache.update(y, y, 0)
    g1 = cache.layers[0].k.scale
    assert torch.equal(g1[0], g0[0])  # fixed at its first write: the 100x decode token clips instead
    assert torch.equal(g1[1:2], formats.nvfp4_dynamic_global(y[1:2]))  # first real token: fixed now
    assert cache.layers[0].k.scale.shape == (2, 1, 1, 1)


def _scoring_batch(seed: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Four prompts of lengths 12, 5, 9, 7, right-padded to 12 (lm-eval's loglikelihood batches)."""
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(1, 96, (n,), generator=g) for n in (12, 5, 9, 7)]
    ids = torch.zeros(4, 12, dtype=torch.long)
    mask = torch.zeros(4, 12, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
    return seqs, ids, mask


def _scoring_model(kv_model: Callable[..., torch.nn.Module]) -> torch.nn.Module:
    model = kv_model("gemma3", head_dim=32)  # sliding + full layers; head_dim 32 fits every block size
    with torch.no_grad():  # the sequences' K are made to differ in scale, so a shared scale would show
        model.model.embed_tokens.weight.mul_(torch.linspace(0.2, 5.0, 96)[:, None])
    return model


@pytest.mark.parametrize(("fmt", "policy"), CASES)
def test_scoring_batch_stores_each_row_as_if_alone(
    fmt: str, policy: str, kv_model: Callable[..., torch.nn.Module], kv_recorder: Callable[..., Any]
) -> None:
    """What kvcal owns, through a model's real forward: in a right-padded batch of 4, every layer stores for each
    row, byte for byte, what the row's own K/V store when written alone, and zeros for its padding. Exact on any
    CPU: both writes quantize the same K/V (the batch's), whatever rounding the CPU's matmuls did upstream."""
    model = _scoring_model(kv_model)
    rt = KVRuntime(model, fmt, impl="torch", nvfp4_global=policy)
    rec = kv_recorder(rt)
    _, ids, mask = _scoring_batch(seed=1)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=rt.new_cache())
    assert rec.check_rows_stored_alone() == 3 * 4  # layers x rows


def _batch_difference(
    model: torch.nn.Module, rt: KVRuntime, ids: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, float]:
    """(logits of the batch [4, T, V], max |row i at batch 4 - row i alone| over the real positions)."""
    with torch.no_grad():
        together = model(ids, attention_mask=mask, past_key_values=rt.new_cache()).logits
        worst = 0.0
        for i in range(4):
            alone = model(
                ids[i : i + 1], attention_mask=mask[i : i + 1], past_key_values=rt.new_cache()
            ).logits
            n = int(mask[i].sum())
            worst = max(worst, float((together[i, :n] - alone[0, :n]).abs().max()))
    return together, worst


@pytest.mark.parametrize(("fmt", "policy"), CASES)
def test_scoring_logits_per_sequence_at_batch_1_and_4_within_float32_rounding(
    fmt: str,
    policy: str,
    kv_model: Callable[..., torch.nn.Module],
    batch_bound: Callable[[float, float, float], float],
) -> None:
    """Each row of a right-padded batch of 4 against the same row scored alone (padded to the same length): the
    storage is exact (above), what is left is the CPU's float32 matmul rounding, which differs with the batch on
    some CPUs (0 on others). The bound is derived on the machine (the `batch_bound` fixture): the float32 and
    BF16 caches' own batch difference, and the format's response to rounding its K/V input to BF16."""
    model = _scoring_model(kv_model)
    _, ids, mask = _scoring_batch(seed=1)
    real = mask.bool()
    out, diff = {}, {}
    for name, f, pol, kin in (
        ("auto", "auto", "one", None),
        ("bf16", "bf16", "one", None),
        ("fmt", fmt, policy, None),
        ("fmt_bf16_input", fmt, policy, "bfloat16"),
    ):
        rt = KVRuntime(model, f, impl="torch", nvfp4_global=pol, kv_input_dtype=kin)
        out[name], diff[name] = _batch_difference(model, rt, ids, mask)
    gap = lambda x, y: float((out[x] - out[y])[real].abs().max())  # noqa: E731  batch 4, real positions
    bound = batch_bound(gap("fmt", "fmt_bf16_input"), max(diff["auto"], diff["bf16"]), gap("bf16", "auto"))
    assert diff["fmt"] <= bound, (fmt, diff, bound)


def _generate(model: torch.nn.Module, rt: KVRuntime, ids: torch.Tensor, mask: torch.Tensor) -> Any:
    with torch.no_grad():
        return model.generate(
            input_ids=ids,
            attention_mask=mask,
            past_key_values=rt.new_cache(),
            max_new_tokens=4,
            do_sample=False,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )


def _generation_difference(
    model: torch.nn.Module, rt: KVRuntime, ids: torch.Tensor, mask: torch.Tensor
) -> tuple[Any, list[Any], float]:
    """(batch-4 output, the four rows' outputs alone, max |score at batch 4 - alone| over the steps where the
    row's tokens agree so far)."""
    together = _generate(model, rt, ids, mask)
    alone = [_generate(model, rt, ids[i : i + 1], mask[i : i + 1]) for i in range(4)]
    worst = max(_score_gap(together, a, ids.shape[1], row=i) for i, a in enumerate(alone))
    return together, alone, worst


def _score_gap(a: Any, b: Any, prompt: int, row: int | None = None) -> float:
    """max |score of a - score of b| over the rows (or a's `row` against b's only row) and the steps up to and
    including the first where their greedy tokens differ (after it they continue different texts)."""
    worst = 0.0
    for i in range(a.sequences.shape[0]) if row is None else [row]:
        j = i if row is None else 0
        for t, (x, y) in enumerate(zip(a.scores, b.scores, strict=True)):
            worst = max(worst, float((x[i] - y[j]).abs().max()))
            if a.sequences[i, prompt + t] != b.sequences[j, prompt + t]:
                break
    return worst


@pytest.mark.parametrize(("fmt", "policy"), [("nvfp4", "per_sequence"), ("int8_per_token_head", "one")])
def test_generation_per_sequence_at_batch_1_and_4(
    fmt: str,
    policy: str,
    kv_model: Callable[..., torch.nn.Module],
    kv_recorder: Callable[..., Any],
    batch_bound: Callable[[float, float, float], float],
) -> None:
    """Left-padded generate(), prefill and decode writes: every row stores exactly what it stores alone (exact,
    what kvcal owns); its scores at batch 4 and alone differ by no more than the float32 / BF16 caches' own
    difference and the format's response to BF16 rounding of its input (`batch_bound`; generate() itself is not bitwise batch-invariant: its
    position ids and last-token head differ between batch 1 and 4 with any cache, bf16 included); its greedy
    tokens agree unless the two best scores lie within that bound."""
    model = kv_model("llama", head_dim=32)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(torch.linspace(0.2, 5.0, 96)[:, None])
    seqs, _, _ = _scoring_batch(seed=2)
    ids = torch.zeros(4, 13, dtype=torch.long)
    mask = torch.zeros(4, 13, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, 13 - len(s) :], mask[i, 13 - len(s) :] = s, 1
    out, diff = {}, {}
    for name, f, pol, kin in (
        ("auto", "auto", "one", None),
        ("bf16", "bf16", "one", None),
        ("fmt_bf16_input", fmt, policy, "bfloat16"),
        ("fmt", fmt, policy, None),
    ):
        rt = KVRuntime(model, f, impl="torch", nvfp4_global=pol, kv_input_dtype=kin)
        rec = kv_recorder(rt) if name == "fmt" else None
        out[name], alone, diff[name] = _generation_difference(model, rt, ids, mask)
        if rec is not None:  # the batch's cache and the rows' own: prefill + 3 decode writes per layer
            assert rec.check_rows_stored_alone() == 3 * 4 * 4 * 2  # layers x rows x writes x (batch, alone)
    bound = batch_bound(
        _score_gap(out["fmt"], out["fmt_bf16_input"], ids.shape[1]),
        max(diff["auto"], diff["bf16"]),
        _score_gap(out["bf16"], out["auto"], ids.shape[1]),
    )
    assert diff["fmt"] <= bound, (fmt, diff, bound)
    for i, a in enumerate(alone):  # the format's runs
        for t, y in enumerate(a.scores):
            pos = ids.shape[1] + t
            if out["fmt"].sequences[i, pos] != a.sequences[0, pos]:  # only where the best two are that close
                top2 = y[0].topk(2).values
                assert float(top2[0] - top2[1]) <= 2 * bound, (fmt, i, t)
                break
