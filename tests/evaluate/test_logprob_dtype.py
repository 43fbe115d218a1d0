"""Log-likelihoods in float32 whatever the model's dtype (issue 38, item 3).

lm-eval's HFLM takes the log-softmax in the model's dtype (softmax_dtype None) and sums a request's log-probs in it:
with a bfloat16 model a wikitext document's total is a bf16 number, a multiple of its ulp (16-128 nats at real
documents' totals). kvcal's model computes both in float32 unless `logprob_dtype=model` asks for lm-eval's way.
On a tiny model saved in bfloat16, a rolling log-likelihood over several windows (max_length 16) is held to a float64
reference computed from the same bf16 logits, within a bound derived from float32's rounding; lm-eval's bf16 way is
shown to miss it (the test can fail), and the total is no multiple of a bf16 ulp.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

CORPUS = [
    "the cat sat on the mat and the dog sat on the log while the bird sang in the tree",
    "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen",
    "paris is the capital of france and rome is the capital of italy and madrid of spain",
]
DOC = " ".join(CORPUS)  # several 16-token windows
MAX_LENGTH = 16
EPS32 = float(torch.finfo(torch.float32).eps)


@pytest.fixture(scope="module")
def bf16_model(tiny_lm_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama re-saved in bfloat16 (config.json says bfloat16, the safetensors hold BF16)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = tiny_lm_dir("llama", CORPUS)
    out = tmp_path_factory.mktemp("bf16-llama-logprob")
    AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16).save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(src)).save_pretrained(str(out))
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    return out


def _lm(model: Path, **kwargs: object):  # noqa: ANN202
    from kvcal.evaluate.adapter import KvcalLM

    return KvcalLM(pretrained=str(model), dtype="auto", device="cpu", batch_size=1, max_length=MAX_LENGTH, **kwargs)


def _rolling(lm, text: str) -> float:  # noqa: ANN001
    from lm_eval.api.instance import Instance

    req = Instance(request_type="loglikelihood_rolling", doc={}, arguments=(text,), idx=0)
    (total,) = lm.loglikelihood_rolling([req], disable_tqdm=True)
    return float(total)


def _reference(lm, text: str) -> tuple[float, float, int]:  # noqa: ANN001
    """(float64 total, derived bound on float32's error, windows) of the same windows lm-eval builds
    (lm_eval.utils.get_rolling_token_windows / make_disjoint_window), from the model's own bf16 logits of the
    same input (HFLM's window `(context + continuation)[-(max_length + 1):][:-1]`, one row, no mask).

    Bound, per token of a row with logits x [V] (exact in float32: bf16 widens exactly), target t, m = max x,
    s = logsumexp(x): float32's log-softmax x_t - m - log(sum exp(x - m)) rounds the subtraction of each of its
    terms (|x_t - m| + |s - m| + 1 units of eps) and sums V exponentials (relative error at most V eps, so at most
    V eps after the log); a window's float32 sum of n log-probs adds at most (n - 1) eps sum |lp| (recursive
    summation); the windows' totals are summed in float64."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    windows = list(map(make_disjoint_window, get_rolling_token_windows(
        token_list=lm.tok_encode(text), prefix_token=lm.prefix_token_id, max_seq_len=MAX_LENGTH, context_len=1,
    )))  # fmt: skip
    total, bound = 0.0, 0.0
    for ctx, cont in windows:
        inp = (ctx + cont)[-(MAX_LENGTH + 1) :][:-1]
        with torch.no_grad():
            logits = lm.model(torch.tensor([inp])).logits[0, -len(cont) :]  # [n, V] bf16
        x = logits.double()
        lp_all = torch.log_softmax(x, dim=-1)
        lp = lp_all.gather(-1, torch.tensor(cont)[:, None]).squeeze(-1)  # [n] float64
        m, s = x.max(-1).values, torch.logsumexp(x, -1)
        xt = x.gather(-1, torch.tensor(cont)[:, None]).squeeze(-1)
        per_token = EPS32 * ((xt - m).abs() + (s - m).abs() + 1 + x.shape[-1])
        total += float(lp.sum())
        bound += float(per_token.sum()) + (len(cont) - 1) * EPS32 * float(lp.abs().sum())
    return total, bound, len(windows)


def _bf16_ulp(value: float) -> float:
    """The spacing of bfloat16 numbers at |value| (8 significant bits)."""
    exp = torch.frexp(torch.tensor(abs(value), dtype=torch.float64)).exponent.item() - 1
    return 2.0 ** (exp - 7)


@pytest.mark.parametrize("scoring", ["full", "continuation"])
def test_rolling_total_is_float32_on_a_bf16_model(bf16_model: Path, scoring: str) -> None:
    lm = _lm(bf16_model, scoring=scoring)
    assert lm.model.dtype == torch.bfloat16 and lm.softmax_dtype == torch.float32
    ref, bound, n_windows = _reference(lm, DOC)
    assert n_windows >= 3  # several rolling windows of max_length tokens
    ours = _rolling(lm, DOC)
    assert abs(ours - ref) <= bound, (ours, ref, bound)
    ulp = _bf16_ulp(ref)
    assert bound < ulp / 4  # the bound discriminates a bf16-rounded total
    steps = ours / ulp
    assert abs(steps - round(steps)) * ulp > bound  # not a multiple of the bf16 ulp at the total's size


def test_model_dtype_on_request_is_lm_evals_bf16_sum(bf16_model: Path) -> None:
    """`logprob_dtype=model`: lm-eval's HFLM default (softmax in bf16): the same float64 reference is missed by
    far more than float32's bound, and every window's total is a bf16 number."""
    lm = _lm(bf16_model, logprob_dtype="model")
    assert lm.softmax_dtype is None
    ref, bound, _ = _reference(lm, DOC)
    ours = _rolling(lm, DOC)
    assert abs(ours - ref) > 10 * bound, (ours, ref, bound)
    from lm_eval.api.instance import Instance

    one = Instance(request_type="loglikelihood", doc={}, arguments=("the cat", " sat on the mat and the dog"), idx=0)
    (ll, _), = lm.loglikelihood([one], disable_tqdm=True)
    assert float(torch.tensor(ll, dtype=torch.bfloat16)) == ll  # a bf16 value


def test_logprob_dtype_is_checked(bf16_model: Path) -> None:
    from kvcal.errors import UsageError

    with pytest.raises(UsageError, match="logprob_dtype= must be float32 .* or model"):
        _lm(bf16_model, logprob_dtype="bfloat16")
