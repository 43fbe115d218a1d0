"""kvcal's lm-eval adapter, end to end on tiny random models (Llama and Gemma 3 with sliding layers) built here.

Parity: with kv_format=auto, `simple_evaluate(model="kvcal")` equals `simple_evaluate(model="hf")` exactly on a
loglikelihood (multiple-choice), a rolling-loglikelihood and a generate_until task (tiny task YAMLs + jsonl data
under tmp_path, loaded through include_path exactly as `lm_eval --include_path` does).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

CORPUS = [
    "the cat sat on the mat and the dog sat on the log",
    "one two three four five six seven eight nine ten",
    "question : what is two plus two ? answer : four",
    "a quick brown fox jumps over the lazy dog near the river bank",
    "paris is the capital of france and rome is the capital of italy",
]

MC_DOCS = [
    {"q": "the cat sat on the", "choices": ["mat", "dog", "river"], "label": 0},
    {"q": "paris is the capital of", "choices": ["italy", "france"], "label": 1},
    {"q": "one two three", "choices": ["four", "ten", "cat"], "label": 0},
]
ROLL_DOCS = [{"text": t} for t in CORPUS[:3]]
GEN_DOCS = [
    {"q": "what is two plus two ?", "a": "four"},
    {"q": "the quick brown", "a": "fox"},
]

TASK_YAMLS = {
    "tiny_mc.yaml": """
task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {dir}/mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{q}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
  - metric: acc_norm
metadata:
  version: 1.0
""",
    "tiny_roll.yaml": """
task: tiny_roll
dataset_path: json
dataset_kwargs:
  data_files:
    test: {dir}/roll.jsonl
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
""",
    "tiny_gen.yaml": """
task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {dir}/gen.jsonl
test_split: test
output_type: generate_until
doc_to_text: "question : {{{{q}}}} answer :"
doc_to_target: "{{{{a}}}}"
generation_kwargs:
  until: ["\\n", "question"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
metadata:
  version: 1.0
""",
}


def build_tokenizer(path: Path) -> None:
    """A byte-level BPE tokenizer trained here (offline), saved as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(str(path))


def build_model(path: Path, kind: str) -> Path:
    from transformers import AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

    build_tokenizer(path)
    vocab = len(AutoTokenizer.from_pretrained(str(path)))
    torch.manual_seed(0)
    if kind == "llama":
        cfg = LlamaConfig(
            vocab_size=vocab,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
        model = LlamaForCausalLM(cfg)
    else:
        cfg = Gemma3TextConfig(
            vocab_size=vocab,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            max_position_embeddings=256,
            sliding_window=6,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
        model = Gemma3ForCausalLM(cfg)
    model.eval()
    model.save_pretrained(str(path))
    return path


def write_tasks(task_dir: Path) -> Path:
    task_dir.mkdir(parents=True, exist_ok=True)
    for name, docs in (("mc", MC_DOCS), ("roll", ROLL_DOCS), ("gen", GEN_DOCS)):
        (task_dir / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    for fname, text in TASK_YAMLS.items():
        (task_dir / fname).write_text(text.format(dir=task_dir))
    return task_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_eval")
    return {
        "llama": build_model(root / "llama", "llama"),
        "gemma3": build_model(root / "gemma3", "gemma3"),
        "tasks": write_tasks(root / "tasks"),
    }


def _evaluate(model: str, model_args: str, task_dir: Path, tasks: list[str]) -> dict[str, Any]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    import kvcal.evaluate.adapter  # noqa: F401  (registers model "kvcal")

    return simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=tasks,
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
        batch_size=2,
        device="cpu",
        log_samples=True,
        bootstrap_iters=0,
    )


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_auto_parity_with_lm_eval_hf(tiny: dict[str, Path], kind: str) -> None:
    tasks = ["tiny_mc", "tiny_roll", "tiny_gen"]
    args = f"pretrained={tiny[kind]},dtype=float32"
    ref = _evaluate("hf", args, tiny["tasks"], tasks)
    ours = _evaluate("kvcal", args + ",kv_format=auto", tiny["tasks"], tasks)
    assert ref["results"] == ours["results"]
    for task in tasks:
        r = [(s["resps"], s["filtered_resps"]) for s in ref["samples"][task]]
        o = [(s["resps"], s["filtered_resps"]) for s in ours["samples"][task]]
        assert r == o
    # not vacuous: the rolling task produced a finite perplexity and the generation produced text
    assert ref["results"]["tiny_roll"]["word_perplexity,none"] > 1.0
    assert any(s["resps"][0][0] for s in ref["samples"]["tiny_gen"])
