"""kvcal sensitivity measures damage with kvcal.evaluate.kl's per-token KL, and refuses bad requests before it
loads anything."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvcal.errors import UsageError
from kvcal.evaluate.kl import kl_per_token
from kvcal.pipeline.sensitivity import sensitivity


def test_kl_per_token_is_the_kl_divergence() -> None:
    g = torch.Generator().manual_seed(0)
    ref = torch.log_softmax(torch.randn(2, 5, 11, generator=g, dtype=torch.float64), -1)  # [B, T, V]
    q = torch.log_softmax(torch.randn(2, 5, 11, generator=g, dtype=torch.float64), -1)
    kl, agree = kl_per_token(ref, q)
    assert kl.shape == agree.shape == (2, 5)
    expected = torch.nn.functional.kl_div(q, ref, reduction="none", log_target=True).sum(-1)
    torch.testing.assert_close(kl, expected, rtol=1e-12, atol=0)
    assert torch.equal(agree, (ref.argmax(-1) == q.argmax(-1)).float())
    same_kl, same_agree = kl_per_token(ref, ref)
    assert torch.equal(same_kl, torch.zeros(2, 5, dtype=torch.float64)) and bool(same_agree.all())


def test_bad_requests_fail_before_the_model_loads(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-model")  # loading it would fail with another message
    with pytest.raises(UsageError, match="'auto' is zero by definition"):
        sensitivity(missing, "auto")
    with pytest.raises(UsageError, match="dynamic scales; drop --scales"):
        sensitivity(missing, "mxfp4", scales=str(tmp_path / "s.safetensors"))
    with pytest.raises(UsageError, match="unknown --device 'gpu'"):
        sensitivity(missing, "fp8", device="gpu")
