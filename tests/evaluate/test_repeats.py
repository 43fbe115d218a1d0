"""Repeated sampling (issue 22, item 4): `kvcal eval --repeats N --gen-kwargs temperature=...` generates each
document N times from a seed per (document, repeat), scores every repeat with the task's own filters, and makes
the document the unit of the comparison: a sample's metric is the mean over its repeats, so paired statistics
and the gate cluster the repeats by document instead of counting (document, repeat) pairs as independent."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvcal.errors import UsageError
from kvcal.evaluate.repeats import sample_seed, samples
from kvcal.evaluate.spec import parse_gen_kwargs
from kvcal.report import stats

CORPUS = [
    "question : what is two plus two ? answer : four",
    "question : what is one plus one ? answer : two",
    "the cat sat on the mat and the dog sat on the log",
]
WORDS = "one two three four five six seven eight".split()
DOCS = [{"q": f"what is {w} plus two ?", "a": "four"} for w in WORDS]
GEN = {"until": ["\n"], "max_gen_toks": 6, "do_sample": False}
Invoke = Callable[[list[str]], tuple[int, str, str]]


def test_seeds_are_per_document_and_repeat() -> None:
    seeds = {sample_seed(1234, "t", d, r) for d in range(20) for r in range(5)}
    assert len(seeds) == 100 and all(0 <= s < 2**63 for s in seeds)
    assert sample_seed(1234, "t", 3, 1) == sample_seed(1234, "t", 3, 1) != sample_seed(1235, "t", 3, 1)
    assert samples({"do_sample": True}) and samples({"temperature": 0.7})
    assert not samples({"temperature": 0.7, "do_sample": False}) and not samples({"until": ["\n"]})


def test_gen_kwargs_parse_like_lm_eval() -> None:
    assert parse_gen_kwargs("temperature=0.6,top_p=0.95,do_sample=true,top_k=20") == (
        ("temperature", 0.6), ("top_p", 0.95), ("do_sample", True), ("top_k", 20)
    )  # fmt: skip
    for bad, message in [
        ("temperature", "not key=value"),
        ("top_p=1.5", "top_p=1.5 must be a number between 0.0 and 1.0"),
        ("temperature=-1", "temperature=-1 must be a number at least 0.0"),
        ("until=x", "the task's stop sequences"),
    ]:
        with pytest.raises(UsageError, match=message):
            parse_gen_kwargs(bad)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--repeats", "0"], "--repeats must be at least 1 generation per document, got 0"),
        (["--gen-kwargs", "temperature"], "--gen-kwargs item 'temperature' is not key=value"),
    ],
)
def test_bad_repeat_options_are_one_error_line(
    tmp_path: Path, invoke: Invoke, args: list[str], message: str
) -> None:
    rc, _, err = invoke(["eval", "smollm2", "-f", "auto", "--tasks", "gsm8k", *args, "-o", str(tmp_path / "run")])
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith(f"Error: {message}"), err
    assert not (tmp_path / "run").exists()


def test_a_loglikelihood_task_refuses_repeats(
    tmp_path: Path, invoke: Invoke, tiny_lm_dir: Callable[..., Path], lm_eval_task: Callable[..., None]
) -> None:
    model = tiny_lm_dir("llama", CORPUS)
    lm_eval_task(tmp_path / "tasks", "tiny_mc", "multiple_choice",
                 [{"q": "the cat sat on the", "choices": ["mat", "dog"], "label": 0}], ["acc"])  # fmt: skip
    rc, _, err = invoke(["eval", str(model), "-f", "auto", "--tasks", "tiny_mc", "--include-path", str(tmp_path / "tasks"),
                         "--repeats", "3", "-o", str(tmp_path / "run")])  # fmt: skip
    assert rc == 2 and "--repeats applies to generative tasks" in err and "'tiny_mc' is multiple_choice" in err


def _run(invoke: Invoke, model: Path, tasks: Path, out: Path, *extra: str) -> list[dict]:
    extra = extra if "--kv-format" in extra else ("--kv-format", "auto", *extra)
    rc, _, err = invoke(["eval", str(model), "--tasks", "tiny_gen", "--include-path", str(tasks),
                         "--repeats", "4", "--gen-kwargs", "temperature=1.0", *extra, "-o", str(out)])  # fmt: skip
    assert rc == 0, err
    return [json.loads(line) for line in (out / "samples_tiny_gen.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_repeats_are_seeded_scored_and_clustered(
    tmp_path: Path, invoke: Invoke, tiny_lm_dir: Callable[..., Path], lm_eval_task: Callable[..., None]
) -> None:
    from kvcal.report.compare import compare_runs

    model = tiny_lm_dir("llama", CORPUS)
    tasks = tmp_path / "tasks"
    lm_eval_task(tasks, "tiny_gen", "generate_until", DOCS, ["exact_match"], generation_kwargs=GEN)
    one = _run(invoke, model, tasks, tmp_path / "bs1")
    two = _run(invoke, model, tasks, tmp_path / "bs2", "--batch-size", "2")
    fp8 = _run(invoke, model, tasks, tmp_path / "fp8", "--kv-format", "fp8_e4m3")
    # a seed per (document, repeat): another batching draws the same generations
    assert [s["resps"] for s in one] == [s["resps"] for s in two]
    assert len(one) == len(DOCS) and all(len(s["resps"][0]) == 4 for s in one)
    assert any(len(set(s["resps"][0])) > 1 for s in one)  # it sampled: repeats of a document differ
    for s in one:  # every repeat scored by the task's own filter and metric; the sample's score is their mean
        per = s["repeat_metrics"]["exact_match"]
        assert len(per) == 4 and s["exact_match"] == pytest.approx(sum(per) / 4)
        assert per == [float(r.strip() == "four") for r in s["resps"][0]]
    results = json.loads((tmp_path / "bs1" / "results.json").read_text())
    assert results["results"]["tiny_gen"]["exact_match,none"] == pytest.approx(
        np.mean([s["exact_match"] for s in one])
    )
    config = json.loads((tmp_path / "bs1" / "results.json").read_text())["configs"]["tiny_gen"]
    assert config["repeats"] == 4 and config["kvcal_repeats"]["scoring"] == "mean over repeats per document"
    # the comparison pairs documents, not (document, repeat) pairs
    c = compare_runs([tmp_path / "bs1", tmp_path / "fp8"], baseline="bs1", n_boot=300)
    (row,) = [r for r in c.results if r.task == "tiny_gen"]
    assert row.n == len(DOCS)
    assert [s["doc_id"] for s in fp8] == [s["doc_id"] for s in one]


def test_repeats_refuse_to_pair_with_a_run_of_other_repeats(
    tmp_path: Path, invoke: Invoke, tiny_lm_dir: Callable[..., Path], lm_eval_task: Callable[..., None]
) -> None:
    from kvcal.report.compare import compare_runs

    model = tiny_lm_dir("llama", CORPUS)
    tasks = tmp_path / "tasks"
    lm_eval_task(tasks, "tiny_gen", "generate_until", DOCS[:3], ["exact_match"], generation_kwargs=GEN)
    _run(invoke, model, tasks, tmp_path / "four")
    rc, _, err = invoke(["eval", str(model), "-f", "auto", "--tasks", "tiny_gen", "--include-path", str(tasks),
                         "--repeats", "2", "--gen-kwargs", "temperature=1.0", "-o", str(tmp_path / "two")])  # fmt: skip
    assert rc == 0, err
    with pytest.raises(UsageError, match=r"tiny_gen: .*different task settings.*repeats"):
        compare_runs([tmp_path / "four", tmp_path / "two"], baseline="four", n_boot=200)
    cooler = tmp_path / "cooler"  # the same repeats, another temperature: other samples, refused too
    rc, _, err = invoke(["eval", str(model), "-f", "auto", "--tasks", "tiny_gen", "--include-path", str(tasks),
                         "--repeats", "4", "--gen-kwargs", "temperature=0.5", "-o", str(cooler)])  # fmt: skip
    assert rc == 0, err
    with pytest.raises(UsageError, match=r"tiny_gen: .*temperature"):
        compare_runs([tmp_path / "four", cooler], baseline="four", n_boot=200)


def test_clustered_interval_is_wider_than_the_naive_one() -> None:
    """What the document-as-unit choice buys: when the quantized cache breaks some documents outright (every
    repeat of them wrong), the repeats' differences are correlated within a document, and the interval of the
    per-document means (what kvcal compares) is wider than the one that counts the (document, repeat) pairs as
    independent samples — which would call a difference significant on too little evidence."""
    rng = np.random.default_rng(0)
    n_docs, n_rep = 40, 10
    p_doc = rng.uniform(0.3, 0.9, size=n_docs)
    broken = rng.random(n_docs) < 0.2  # the documents the quantized cache breaks
    base = (rng.random((n_docs, n_rep)) < p_doc[:, None]).astype(float)
    other = (rng.random((n_docs, n_rep)) < np.where(broken, 0.05, p_doc)[:, None]).astype(float)
    naive, _, _ = stats.binary_difference(base.ravel(), other.ravel())
    clustered = stats.bca_difference(base.mean(1), other.mean(1), n_boot=2000)
    assert clustered.ci_high - clustered.ci_low > 1.2 * (naive.ci_high - naive.ci_low)


def test_sweep_and_release_yaml_take_repeats() -> None:
    from kvcal.evaluate.spec import EvalConfig, eval_spec
    from kvcal.pipeline.settings import EvalSettings, eval_options, read_fields

    raw = {"repeats": 10, "gen_kwargs": {"temperature": 0.6, "top_p": 0.95, "do_sample": True}}
    settings = EvalSettings(**read_fields(EvalSettings, raw, None, "evaluate key"))
    opts = eval_options(settings, "aime25")
    assert opts["repeats"] == 10 and opts["gen_kwargs"] == "temperature=0.6,top_p=0.95,do_sample=true"
    spec = eval_spec(EvalConfig(model="m", kv_format="fp8_e4m3", tasks=["aime25"], **opts))
    assert spec.repeats == 10 and spec.recorded_fields()["gen_kwargs"] == dict(raw["gen_kwargs"])
    with pytest.raises(UsageError, match="top_p=2 must be a number between"):
        read_fields(EvalSettings, {"gen_kwargs": "top_p=2"}, None, "evaluate key")
