"""SmolLM2 (the real model) through lm-eval's own rolling-loglikelihood path (what `wikitext` runs): each text's
log-likelihood with an nvfp4 cache is the same at --batch-size 1 and 4 (issue 13).

At batch size 4 lm-eval right-pads the four windows to the longest and scores them in one forward (HFLM
`_loglikelihood_tokens`); the adapter tells the cache the rows' lengths, so padding is not stored and the
per-sequence nvfp4 global sees only its own text — checked exactly here: every row of every layer stores byte
for byte what its own K/V store alone (the `kv_recorder` fixture), whatever the CPU. Before that fix the whole
batch (and its padding) set one global scale: the texts moved by -3.6, +1.2, +0.08 and +2.8 nats.

What remains is float32 rounding that kvcal does not own: the unpadded (batch 1) and padded (batch 4) forwards run
other matmul shapes (on Intel AVX-512 even the unpadded row's, its batch being 4), so a few K/V elements land on
the other side of an FP4 rounding boundary. How far that moves a score depends on the CPU (issue 21: nvfp4 moved
the 151-token text by 1.15 nats on an Intel Xeon; on AMD EPYC, summed over the texts, bf16 0.008 nats, nvfp4
0.32, per-sequence nvfp4 1.82 on the 56-token text alone — a flip of a rare large effect, not proportional to the
perturbation), so the bound is derived on the machine (`batch_bound`): the BF16 rounding of the K/V input, which
must dominate the BF16 cache's own batch difference, and the format's response to it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

# Four passages of different lengths (56, 151, 47 and 94 tokens), so batch size 4 pads three of them.
TEXTS = [
    "The harbour town of Calloway sits where two rivers meet before they reach the sea. For most of the "
    "nineteenth century it was known for rope, not fish: the long sheds along the eastern bank turned hemp from "
    "the inland farms into cables for ships that anchored a mile offshore.",
    "In 1871 the town counted 4,312 residents, of whom nearly a third worked in the ropewalks or in the carting "
    "trade that fed them. When steel cable arrived, the sheds emptied within a decade, and the town turned slowly "
    "toward the river traffic it had always ignored. The change is visible in the parish records. Between 1880 "
    "and 1890 the number of boatmen listed as fathers at baptism rose from nine to forty-seven, while the number "
    "of ropemakers fell from one hundred and twelve to fifteen. Many families simply moved their work a few "
    "hundred yards, from the sheds to the quays, and the skills of splicing and knotting found new use.",
    "Calloway's second transformation came with the railway. The line from the county town reached the western "
    "bank in 1903, and with it came a station, a hotel of thirty rooms and a steady stream of visitors.",
    "Numbers tell part of the story. In 1911 the census recorded 5,870 people; in 1931, 6,204; in 1951, 5,415, "
    "the decline reflecting both war and the closing of the last boatyard. Yet the town never emptied the way the "
    "ropewalks had, because the rivers still needed tending and the station still ran four trains a day.",
]


def _loglikelihoods(lm, batch_size: int) -> list[float]:
    from lm_eval.api.instance import Instance

    lm.batch_size_per_gpu = batch_size
    reqs = [
        Instance(request_type="loglikelihood_rolling", doc={}, arguments=(t,), idx=i)
        for i, t in enumerate(TEXTS)
    ]
    return [float(r) for r in lm.loglikelihood_rolling(reqs, disable_tqdm=True)]


# (name, --kv-format, --nvfp4-global): the float32 and BF16 baselines, then nvfp4 in both of its policies
CACHES = [
    ("auto", "auto", "one"),
    ("bf16", "bf16", "one"),
    ("one", "nvfp4", "one"),
    ("per_sequence", "nvfp4", "per_sequence"),
]


@pytest.mark.realmodel
def test_smollm2_nvfp4_rolling_loglikelihood_at_batch_1_and_4(
    real_model_path: Callable[[str], str],
    kv_recorder: Callable[..., Any],
    batch_bound: Callable[[float, float, float], float],
) -> None:
    """Exact where kvcal owns it, derived on the machine where the CPU does: at batch 4 every row of every layer
    stores byte for byte what its own K/V store alone (so padding and the other texts never reach a text's cache),
    and the log-likelihoods move between batch 1 and 4 by no more than the bound derived from the float32 / BF16
    caches' own batch difference and nvfp4's response to BF16 rounding of its K/V input (`batch_bound`)."""
    real_model_path("smollm2")  # skips when the model package is not installed
    from kvcal.evaluate.adapter import KvcalLM
    from kvcal.kernels.runtime import KVRuntime

    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    lm = KvcalLM(
        pretrained="smollm2", kv_format="nvfp4", impl="torch", dtype="float32", batch_size=1, device="cpu"
    )
    one: dict[str, list[float]] = {}
    four: dict[str, list[float]] = {}
    for name, fmt, policy in CACHES:
        lm.runtime = KVRuntime(lm.model, fmt, impl="torch", nvfp4_global=policy)
        one[name] = _loglikelihoods(lm, 1)
        rec = None if fmt == "auto" else kv_recorder(lm.runtime)
        four[name] = _loglikelihoods(lm, 4)
        if rec is not None:  # one forward of the four right-padded texts; three of them padded
            assert len(rec.caches) == 1
            assert (
                sum(w[3] is not None and not bool(w[3].all()) for w in rec.caches[0].writes) == 30
            )  # layers
            assert rec.check_rows_stored_alone() == 30 * 4  # layers x rows
        assert all(x < 0 for x in one[name])
        if fmt == "nvfp4":  # the same policy with its K/V input rounded to BF16 first, at batch 1
            lm.runtime = KVRuntime(
                lm.model, fmt, impl="torch", nvfp4_global=policy, kv_input_dtype="bfloat16"
            )
            one[f"{name}_bf16_input"] = _loglikelihoods(lm, 1)

    def moved(name: str) -> float:  # nats, summed over the texts
        return sum(abs(a - b) for a, b in zip(one[name], four[name], strict=True))

    def gap(x: str, y: str) -> float:  # nats between two caches at batch 1, summed over the texts
        return sum(abs(a - b) for a, b in zip(one[x], one[y], strict=True))

    base = max(moved("auto"), moved("bf16"))
    for policy in ("one", "per_sequence"):
        bound = batch_bound(gap(policy, f"{policy}_bf16_input"), base, gap("bf16", "auto"))
        assert moved(policy) <= bound, (policy, moved(policy), bound, base, one, four)
