"""Task resolution: lm-eval's own task configs pointed at local files (--data-dir), GPQA read in memory from a
password-protected zip, include paths, and the errors for bad input."""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from kvcal.errors import UsageError  # noqa: E402
from kvcal.evaluate import tasks as T  # noqa: E402

WIKI_ROWS = [
    "",
    " = Alpha = \n",
    "",
    " Alpha is a letter @-@ like thing . \n",
    "",
    " = = Uses = = \n",
    "",
    " It is used . \n",
    "",
    " = Beta = \n",
    "",
    " Beta follows alpha . \n",
    "",
]

GPQA_FIELDS = [
    "Question",
    "Correct Answer",
    "Incorrect Answer 1",
    "Incorrect Answer 2",
    "Incorrect Answer 3",
    "Record ID",
]


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture()
def data_dir(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    gsm = [{"question": f"q{i}?", "answer": f"work\n#### {i}"} for i in range(8)]
    _jsonl(root / "gsm8k" / "train.jsonl", gsm)
    _jsonl(root / "gsm8k" / "test.jsonl", gsm[:3])
    _jsonl(
        root / "aime2025" / "test.jsonl",
        [{"problem": "1+1", "answer": "2"}, {"problem": "2+2", "answer": "4"}],
    )
    _jsonl(root / "wikitext2" / "test.jsonl", [{"text": r} for r in WIKI_ROWS])
    (root / "wikitext2" / "wiki.test.joined.txt").write_text("\n\n".join(WIKI_ROWS))
    return root


def _make_gpqa_zip(root: Path, password: str) -> None:
    """A password-protected zip like the official one (synthetic rows), built with the `zip` tool."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=GPQA_FIELDS)
    w.writeheader()
    for i in range(4):
        w.writerow(
            {
                "Question": f"synthetic question {i}",
                "Correct Answer": f"right {i}",
                "Incorrect Answer 1": f"wrong a{i}",
                "Incorrect Answer 2": f"wrong b{i}",
                "Incorrect Answer 3": f"wrong c{i}",
                "Record ID": f"rec{i}",
            }
        )
    staging = root / "staging" / "dataset"
    staging.mkdir(parents=True)
    (staging / "gpqa_diamond.csv").write_text(buf.getvalue())
    (root / "gpqa").mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["zip", "-q", "-r", "-P", password, str(root / "gpqa" / "dataset.zip"), "dataset"],
        cwd=staging.parent,
        check=True,
    )
    shutil.rmtree(root / "staging")


def test_offline_overrides_point_at_local_files(data_dir: Path) -> None:
    plan = T.resolve_tasks("gsm8k,aime25,wikitext,kl", data_dir=data_dir)
    assert plan.names == ["gsm8k", "aime25", "wikitext", "kl"] and plan.has_kl
    gsm = plan.lm_eval_specs["gsm8k"]
    assert gsm["dataset_path"] == "json"
    assert gsm["dataset_kwargs"]["data_files"] == {
        "train": str(data_dir / "gsm8k" / "train.jsonl"),
        "test": str(data_dir / "gsm8k" / "test.jsonl"),
    }
    # everything else is lm-eval's own: 5-shot, the two filters, the prompt
    assert gsm["num_fewshot"] == 5 and [f["name"] for f in gsm["filter_list"]] == [
        "strict-match",
        "flexible-extract",
    ]
    assert gsm["doc_to_text"] == "Question: {{question}}\nAnswer:" and "include" not in gsm
    aime = plan.lm_eval_specs["aime25"]
    assert aime["dataset_kwargs"]["data_files"] == {"test": str(data_dir / "aime2025" / "test.jsonl")}
    wiki = plan.lm_eval_specs["wikitext"]
    assert wiki["dataset_kwargs"]["wikitext_rows"] == str(data_dir / "wikitext2" / "test.jsonl")

    from lm_eval.tasks import get_task_dict

    built = get_task_dict(list(plan.lm_eval_specs.values()), T.task_manager_for(plan))
    assert len(list(built["gsm8k"].test_docs())) == 3
    doc = built["gsm8k"].test_docs()[0]
    assert built["gsm8k"].doc_to_text(doc) == "Question: q0?\nAnswer:"
    assert [d["problem"] for d in built["aime25"].test_docs()] == ["1+1", "2+2"]
    pages = [d["page"] for d in built["wikitext"].test_docs()]
    assert len(pages) == 2 and pages[0].startswith(" = Alpha = ") and "= = Uses = =" in pages[0]


def test_wikitext_documents_split_on_level1_headings() -> None:
    pages = T.wikitext_documents(WIKI_ROWS)
    assert len(pages) == 2
    assert pages[1].startswith(" = Beta = ") and "Beta follows alpha" in pages[1]
    assert "Beta" not in pages[0]


def test_missing_local_file_names_the_path(data_dir: Path) -> None:
    (data_dir / "aime2025" / "test.jsonl").unlink()
    with pytest.raises(UsageError, match=str(data_dir / "aime2025" / "test.jsonl")):
        T.resolve_tasks("aime25", data_dir=data_dir)


def test_gpqa_needs_password_and_reads_zip_in_memory(data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if shutil.which("zip") is None:
        pytest.skip("the `zip` tool is needed to build an encrypted test archive")
    monkeypatch.delenv(T.GPQA_PASSWORD_ENV, raising=False)
    _make_gpqa_zip(data_dir, "fixture-pass")
    with pytest.raises(UsageError, match="--gpqa-password"):
        T.resolve_tasks("gpqa_diamond", data_dir=data_dir)
    with pytest.raises(UsageError, match="wrong GPQA password"):
        T.resolve_tasks("gpqa_diamond", data_dir=data_dir, gpqa_password="nope")
    monkeypatch.setenv(T.GPQA_PASSWORD_ENV, "fixture-pass")
    plan = T.resolve_tasks("gpqa_diamond,gpqa_diamond_cot_zeroshot", data_dir=data_dir)
    assert plan.names == ["gpqa_diamond_zeroshot", "gpqa_diamond_cot_zeroshot"]
    assert plan.private == {"gpqa_diamond_zeroshot", "gpqa_diamond_cot_zeroshot"}
    cfg = plan.lm_eval_specs["gpqa_diamond_zeroshot"]
    assert "fixture-pass" not in repr(cfg) and "fixture-pass" not in json.dumps(cfg, default=str)

    from lm_eval.tasks import get_task_dict

    before = {p for p in data_dir.rglob("*")}
    task = get_task_dict([cfg], T.task_manager_for(plan))["gpqa_diamond_zeroshot"]
    docs = list(task.validation_docs())
    assert len(docs) == 4 and docs[0]["answer"] in ("(A)", "(B)", "(C)", "(D)")
    assert task.doc_to_text(docs[0]).startswith(
        "What is the correct answer to this question:synthetic question 0"
    )
    assert {p for p in data_dir.rglob("*")} == before  # nothing extracted next to the archive


def test_include_path_and_unknown_tasks(tmp_path: Path) -> None:
    inc = tmp_path / "mytasks"
    inc.mkdir()
    (inc / "mine.yaml").write_text(
        "task: my_task\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: x.jsonl\n"
        "test_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
    )
    plan = T.resolve_tasks("my_task,kl", include_path=inc)
    assert plan.lm_eval_specs == {"my_task": "my_task"} and plan.include_path == str(inc.resolve())
    with pytest.raises(UsageError, match="did you mean.*my_task"):
        T.resolve_tasks("my_tsk", include_path=inc)
    with pytest.raises(UsageError, match="did you mean.*gsm8k"):
        T.resolve_tasks("gsm8kk")
    with pytest.raises(UsageError, match="not a folder"):
        T.resolve_tasks("kl", include_path=tmp_path / "absent")
    with pytest.raises(UsageError, match="empty"):
        T.resolve_tasks(" , ")


def test_real_shared_data(shared_data: Path) -> None:  # ../shared/data: marked slow, skipped when absent
    plan = T.resolve_tasks("gsm8k,aime25,wikitext", data_dir=shared_data)
    from lm_eval.tasks import get_task_dict

    built = get_task_dict(list(plan.lm_eval_specs.values()), T.task_manager_for(plan))
    assert len(built["gsm8k"].test_docs()) == 1319 and len(built["gsm8k"].training_docs()) == 7473
    assert len(built["aime25"].test_docs()) == 30
    assert len(built["wikitext"].test_docs()) == 62  # EleutherAI/wikitext_document_level test has 62 pages
    password = os.environ.get(T.GPQA_PASSWORD_ENV)
    if password:
        rows = T.read_gpqa_rows(shared_data / "gpqa" / "dataset.zip", "dataset/gpqa_diamond.csv", password)
        assert len(rows) == 198  # counted only: GPQA questions are never printed
