"""Conformance's margin from a perturbed emulation (`kvcal compare --conformance-noise`, issue 38).

A quantized cache amplifies any disagreement between two correct implementations (docs/engines.md: engine and
emulation 4.6e-06 nats per token apart at 16 bits, 0.041 with FP8; the emulation 0.045 from itself with its weights
moved by 2**-22), so the BF16 pair's disagreement is too small a margin for a quantized configuration: a faithful
engine is never shown equivalent. Planted per-document values: the engine's FP8 damage is the emulation's plus the
chaotic scatter any implementation has (sd 0.004 nats per word); the emulation run with perturbed weights has the
same scatter. Against the BF16 pair's margin (~0.0017) that engine is not shown equivalent; against the perturbed
emulation's (the mean |perturbed damage - emulated damage|, ~0.0045) it is, and an engine with 2.5x the damage is
still not equivalent."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvcal.errors import UsageError
from kvcal.report.compare import compare_runs
from kvcal.report.conformance import EQUIVALENT, NOT_EQUIVALENT, add_conformance, before_pairing
from kvcal.report.markdown import render_markdown

Invoke = Callable[[list[str]], tuple[int, str, str]]
ROLLING = {"wikitext": {"output_type": "loglikelihood_rolling"}}
N = 20  # the study's documents


def _write(root: Path, write_run, wikitext_records, seed: int = 11, **over) -> dict[str, np.ndarray]:  # noqa: ANN001
    rng = np.random.default_rng(seed)
    words = rng.integers(200, 900, N)
    base = rng.uniform(2.5, 4.0, N)  # kvcal's BF16, nats per word
    damage = 0.013 + rng.normal(0.0, 0.004, N)  # kvcal's FP8 damage per document
    chaos = lambda: rng.normal(0.0, 0.004, N)  # noqa: E731 — another implementation's FP8 scatter
    r = rng.normal(0.0005, 0.002, N)  # the engine's BF16 minus kvcal's
    rp = rng.normal(0.0, 0.002, N)  # the perturbed emulation's BF16 minus kvcal's
    docs = {
        "emu_bf16": base, "emu_fp8": base + damage, "eng_bf16": base + r,
        "eng_fp8": base + r + damage + chaos(),  # faithful: the emulation's damage, an implementation's scatter
        "eng_bad": base + r + 2.5 * damage,
        "pert_bf16": base + rp, "pert_fp8": base + rp + damage + chaos(),
    }  # fmt: skip
    for name, values in docs.items():
        fmt = "bf16" if name.endswith("bf16") else "fp8_e4m3"
        kw = {"dtype": "bfloat16", "max_length": 8192, "task_configs": ROLLING,
              "perturb_weights": 1.0 if name.startswith("pert") else None, **over.get(name, {})}  # fmt: skip
        recs = wikitext_records(-values * words, words)
        write_run(root, name, fmt, {"wikitext": recs}, granularity=None if fmt == "bf16" else "tensor", **kw)
    return docs


def _conformance(root: Path, pairs: list[str], noise: list[str], margin: float | None = None):  # noqa: ANN202
    refs = ["eng_bf16=emu_bf16"]
    c = compare_runs([root], baseline="emu_bf16", n_boot=200, before_pairing=before_pairing(pairs, refs, margin, noise))
    add_conformance(c, pairs, references=refs, margin=margin, noise=noise)
    return c


def test_perturbed_emulation_sets_the_margin(tmp_path: Path, write_run, wikitext_records) -> None:  # noqa: ANN001
    docs = _write(tmp_path, write_run, wikitext_records)
    plain = _conformance(tmp_path, ["eng_fp8=emu_fp8"], [])
    (r0,) = plain.conformance[0].results
    assert r0.margin_source == "bf16 pair" and r0.verdict != EQUIVALENT  # the BF16 margin is too tight for FP8
    c = _conformance(tmp_path, ["eng_fp8=emu_fp8", "eng_bad=emu_fp8"], ["pert_fp8=pert_bf16"])
    ok, bad = c.conformance
    (r,), (rb,) = ok.results, bad.results
    emu_dmg = docs["emu_fp8"] - docs["emu_bf16"]
    want = np.mean(np.abs((docs["pert_fp8"] - docs["pert_bf16"]) - emu_dmg))
    assert r.margin == pytest.approx(want, rel=1e-9) and r.margin_source == "perturbed emulation"
    assert r.margin > 2 * r0.margin  # the amplification the BF16 pair cannot see
    assert r.noise_bf16_spread == pytest.approx(np.mean(np.abs(docs["pert_bf16"] - docs["emu_bf16"])), rel=1e-9)
    assert r.bf16_spread == pytest.approx(r0.margin, rel=1e-12)
    d = (docs["eng_fp8"] - docs["eng_bf16"]) - emu_dmg
    assert r.gap_spread == pytest.approx(np.mean(np.abs(d)), rel=1e-9)
    assert r.verdict == EQUIVALENT and ok.conforms is True and "(the perturbed emulation)" in ok.verdict
    assert rb.verdict == NOT_EQUIVALENT and bad.conforms is False  # 2.5x the damage is caught still
    md = render_markdown(c)
    assert f"±{r.margin:.4g} (perturbed emulation; the engine's mean |gap| {r.gap_spread:.2g}; BF16" in md.replace(
        "\\|", "|"
    )


def test_noise_runs_are_checked(tmp_path: Path, write_run, wikitext_records) -> None:  # noqa: ANN001
    _write(tmp_path, write_run, wikitext_records, emu_bf16={"dtype": "bfloat16"})
    with pytest.raises(UsageError, match="emu_bf16 is not a perturbed run; make it with kvcal eval --perturb-weights"):
        _conformance(tmp_path, ["eng_fp8=emu_fp8"], ["pert_fp8=emu_bf16"])
    with pytest.raises(UsageError, match="name the perturbed quantized run first"):
        _conformance(tmp_path, ["eng_fp8=emu_fp8"], ["pert_bf16=pert_fp8"])
    with pytest.raises(UsageError, match="--margin and --conformance-noise both set the margin"):
        _conformance(tmp_path, ["eng_fp8=emu_fp8"], ["pert_fp8=pert_bf16"], margin=0.01)
    with pytest.raises(UsageError, match="given 2 times for 1 pairs"):
        _conformance(tmp_path, ["eng_fp8=emu_fp8"], ["pert_fp8=pert_bf16", "pert_fp8=pert_bf16"])


def test_noise_runs_must_be_like_the_others(tmp_path: Path, write_run, wikitext_records) -> None:  # noqa: ANN001
    _write(tmp_path, write_run, wikitext_records, pert_fp8={"max_length": 2048})
    with pytest.raises(UsageError, match=r"wikitext max length: .*pert_fp8 2048"):
        _conformance(tmp_path, ["eng_fp8=emu_fp8"], ["pert_fp8=pert_bf16"])


def test_cli_conformance_noise(tmp_path: Path, write_run, wikitext_records, invoke: Invoke) -> None:  # noqa: ANN001
    _write(tmp_path, write_run, wikitext_records)
    base = ["compare", str(tmp_path), "--baseline", "emu_bf16", "--conformance-bf16", "eng_bf16=emu_bf16",
            "--conformance", "eng_fp8=emu_fp8", "--max-drop", "0.05"]  # fmt: skip
    code, out, err = invoke([*base, "--conformance-noise", "pert_fp8=pert_bf16", "--json"])
    assert code == 0, err
    assert '"margin_source": "perturbed emulation"' in out
    code, _, err = invoke([*base, "--conformance-noise", "pert_fp8=nope"])
    assert code == 2 and err.count("Error:") == 1 and "PERTURBED_Q=PERTURBED_BF16" in err
