"""`kvcal eval --perturb-weights ULPS` (kvcal.models.perturb): the same model as another correct implementation
computes it, the yardstick run of conformance's margin (`kvcal compare --conformance-noise`, issue 38).

- The perturbation itself, exactly: every element is round(w * (1 +- ulps * eps)) in its dtype with the seeded
  signs; zero stays zero, no sign flips; a bfloat16 weight at 1 ulp moves by one or two of its own ulps, never zero;
  tied weights are moved once; the same seed gives the same weights, another seed others.
- On the user's path (tiny random Llama, kl task): config.yaml records the perturbation (an unperturbed run does
  not), the run directory's name says it, its numbers differ from the unperturbed run's and repeat exactly; the
  engine commands are refused; bad values are one `Error:` line with nothing written.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcal.engines import EngineSetup, commands_dict
from kvcal.errors import UsageError
from kvcal.evaluate.spec import EvalConfig, eval_spec, run_dir_name
from kvcal.models.perturb import check_perturbation, perturb_weights
from kvcal.rundir import RunConfig

Invoke = Callable[[list[str]], tuple[int, str, str]]
CORPUS = ["the cat sat on the mat and the dog sat on the log", "one two three four five six seven eight nine ten"]
# bfloat16: one of its ulps (2**-8 relative) moves the logits visibly; float32's would vanish in kl's float16 baseline
KL = ["--tasks", "kl", "--limit", "2", "--kl-seq-len", "24", "--dtype", "bfloat16"]


def _module(*tensors: torch.Tensor) -> torch.nn.Module:
    m = torch.nn.Module()
    for i, t in enumerate(tensors):
        m.register_parameter(f"p{i}", torch.nn.Parameter(t.clone(), requires_grad=False))
    return m


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    st.sampled_from([0.5, 1.0, 2.0, 3.0]),
    st.integers(0, 2**31 - 1),
    st.floats(-2, 2),  # weights' magnitudes (float16's range: no overflow)
)
def test_each_element_is_its_rounded_perturbation(dtype: torch.dtype, ulps: float, seed: int, log_scale: float) -> None:
    g = torch.Generator().manual_seed(seed + 1)
    w = (torch.randn(64, 33, generator=g) * 10.0**log_scale).to(dtype)
    w[0, :5] = 0.0
    m = _module(w)
    assert perturb_weights(m, ulps, seed) == w.numel()
    sign = torch.randint(0, 2, w.shape, generator=torch.Generator().manual_seed(seed)).float() * 2 - 1
    want = (w.float() * (1 + sign * ulps * torch.finfo(dtype).eps)).to(dtype)
    got = m.p0.detach()
    assert torch.equal(got.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       want.view(torch.int16 if dtype != torch.float32 else torch.int32))  # fmt: skip
    assert torch.all(got[0, :5] == 0) and torch.all(torch.sign(got) == torch.sign(w))
    normal = w.abs() >= torch.finfo(dtype).smallest_normal  # subnormals have coarser relative steps
    rel = ((got.double() - w.double()).abs() / w.double().abs().clamp_min(1e-300))[normal]
    # at most ulps * eps of the value, plus half an ulp of rounding (eps relative at worst)
    assert float(rel.max()) <= (ulps + 1) * torch.finfo(dtype).eps


def test_bfloat16_weights_move_by_one_or_two_ulps() -> None:
    w = torch.randn(4096, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    m = _module(w)
    perturb_weights(m, 1.0, 0)
    got = m.p0.detach()
    # ulps apart: the distance in the ordered int16 encoding (same sign, so the bit patterns order the values)
    steps = (got.view(torch.int16).int() - w.view(torch.int16).int()).abs()
    assert steps.min() >= 1 and steps.max() <= 2
    assert 0.3 < float((steps == 2).float().mean()) < 0.7  # mantissa m in [1, 2): m ulps, rounded


def test_seeded_and_tied_weights_once() -> None:
    w = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    a, b, c = _module(w), _module(w), _module(w)
    perturb_weights(a, 2.0, 7)
    perturb_weights(b, 2.0, 7)
    perturb_weights(c, 2.0, 8)
    assert torch.equal(a.p0, b.p0) and not torch.equal(a.p0, c.p0)
    emb = torch.nn.Embedding(16, 8)
    head = torch.nn.Linear(8, 16, bias=False)
    head.weight = emb.weight  # tied, as lm_head and embed_tokens
    tied = torch.nn.ModuleDict({"emb": emb, "head": head})
    before = emb.weight.detach().clone()
    assert perturb_weights(tied, 1.0, 0) == before.numel()  # one tensor, moved once
    assert tied["head"].weight is tied["emb"].weight
    rel = ((emb.weight.detach() - before) / before).abs()
    assert float(rel.max()) <= 2 * torch.finfo(torch.float32).eps


def test_check_perturbation() -> None:
    assert check_perturbation(None) is None and check_perturbation(0) is None and check_perturbation("") is None
    assert check_perturbation("1.5") == 1.5
    for bad in (-1, float("inf"), float("nan"), 65, "one"):
        with pytest.raises(UsageError, match="--perturb-weights"):
            check_perturbation(bad)


@pytest.fixture(scope="module")
def model(tiny_lm_dir: Callable[..., Path]) -> Path:
    return tiny_lm_dir("llama", CORPUS, k_gain=8.0)


def _kl(invoke: Invoke, model: Path, out: Path, *extra: str) -> list[float]:
    code, _stdout, err = invoke(["eval", str(model), "--kv-format", "fp8_e4m3", "-o", str(out), *KL, *extra])
    assert code == 0, err
    recs = [json.loads(line) for line in (out / "samples_kl.jsonl").read_text().splitlines()]
    return [r["kl"] for r in sorted(recs, key=lambda r: r["doc_id"])]


def test_eval_records_and_repeats_a_perturbed_run(invoke: Invoke, model: Path, tmp_path: Path) -> None:
    plain = _kl(invoke, model, tmp_path / "plain")
    pert = _kl(invoke, model, tmp_path / "pert", "--perturb-weights", "1")
    again = _kl(invoke, model, tmp_path / "again", "--perturb-weights", "1")
    other = _kl(invoke, model, tmp_path / "other", "--perturb-weights", "1", "--seed", "1")
    assert pert == again and all(a != b for a, b in zip(pert, plain, strict=True)) and other != pert
    cfg = yaml.safe_load((tmp_path / "pert" / "config.yaml").read_text())
    assert cfg["perturb_weights"] == 1.0 and cfg["seed"] == 0
    assert "perturb_weights" not in yaml.safe_load((tmp_path / "plain" / "config.yaml").read_text())
    spec = eval_spec(EvalConfig(model=str(model), kv_format="fp8_e4m3", tasks=["kl"], perturb_weights=1.0, seed=3))
    assert run_dir_name(spec).endswith("__perturb-1ulp-seed3")
    setup = EngineSetup.from_run_config(RunConfig.from_dict(cfg))
    assert all("--perturb-weights" in d["refused"] for d in commands_dict(setup).values())


def test_bad_perturbation_is_one_error(invoke: Invoke, model: Path, tmp_path: Path) -> None:
    out = tmp_path / "bad"
    code, _stdout, err = invoke(["eval", str(model), "-f", "bf16", "-o", str(out), *KL, "--perturb-weights", "-1"])
    assert code == 2 and err.count("Error:") == 1 and "--perturb-weights -1" in err and not out.exists()
