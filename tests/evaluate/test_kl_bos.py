"""kl windows start the way the tokenizer starts a text: BOS only where the tokenizer itself adds one.

A tokenizer with a BOS token that it never adds (SmolLM2's <|im_start|>; here the tiny lm-eval tokenizer's <s>)
gets plain windows, so kl's perplexity of an `auto` run equals a plain transformers forward over the same
windows; the rule is recorded in the results and is part of the baseline cache key.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvcal.evaluate.kl import bos_rule, make_windows, window_key

CORPUS = [
    "the cat sat on the mat and the dog sat on the log",
    "one two three four five six seven eight nine ten",
    "a quick brown fox jumps over the lazy dog near the river bank",
]


def _no_bos_tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel(vocab={"<unk>": 0, "x": 1, "y": 2}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>")


def test_bos_rule_follows_the_tokenizer(tiny_tokenizer: Any, tiny_lm_dir: Callable[..., Path]) -> None:
    from transformers import AutoTokenizer

    adds = bos_rule(tiny_tokenizer)  # its post-processor prepends <bos>
    assert adds["bos_token_id"] == tiny_tokenizer.bos_token_id == 1 and "adds BOS" in adds["rule"]
    never = AutoTokenizer.from_pretrained(str(tiny_lm_dir("llama", CORPUS)))
    assert never.bos_token_id is not None and never("x")["input_ids"][0] != never.bos_token_id
    rule = bos_rule(never)
    assert rule["bos_token_id"] is None and "does not add" in rule["rule"]
    assert bos_rule(_no_bos_tokenizer()) == {"bos_token_id": None, "rule": "the tokenizer has no BOS token"}


def test_windows_and_cache_key_follow_the_rule(tiny_tokenizer: Any) -> None:
    text = " ".join(CORPUS * 3)
    ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    plain, _ = make_windows(tiny_tokenizer, text, 8, 2, None)
    assert plain == [ids[0:8], ids[8:16]]
    with_bos, _ = make_windows(tiny_tokenizer, text, 8, 2, 1)
    assert with_bos == [[1, *ids[0:7]], [1, *ids[7:14]]]
    base = {"kv_format": "bf16"}
    window = plain[0]
    keys = {
        window_key("fp", base, rule, window)
        for rule in (bos_rule(tiny_tokenizer), bos_rule(_no_bos_tokenizer()))
    }
    assert len(keys) == 2


def _plain_transformers_ppl(model_dir: Path, windows: list[list[int]]) -> tuple[float, list[float]]:
    """exp(mean NLL of each next token) over the windows, by a plain transformers forward (no kvcal)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    sums = []
    with torch.no_grad():
        for w in windows:
            ids = torch.tensor([w])
            logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)  # [T, V]
            sums.append(float(-logp[:-1].gather(-1, ids[0, 1:, None]).sum()))
    tokens = sum(len(w) - 1 for w in windows)
    return math.exp(sum(sums) / tokens), sums


def test_auto_kl_perplexity_matches_plain_transformers(
    tiny_lm_dir: Callable[..., Path], tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    from kvcal.evaluate.kl import EMBEDDED_TEXT
    from kvcal.evaluate.run import EvalConfig, run_eval
    from kvcal.evaluate.spec import eval_spec

    model = tiny_lm_dir("llama", CORPUS)
    run = run_eval(eval_spec(
        EvalConfig(model=str(model), tasks=["kl"], limit=3, kl_seq_len=24, output=str(tmp_path / "run"))
    ))
    res = json.loads((run / "results.json").read_text())
    cfg = res["configs"]["kl"]
    assert cfg["bos"]["bos_token_id"] is None and "does not add" in cfg["bos"]["rule"]
    assert (
        cfg["evaluated"]["attention"].startswith("transformers") and cfg["baseline"]["attention"] == "kvcal"
    )
    # the independent computation: the tokenizer's own ids of the same text, cut into 24-token windows
    ids = AutoTokenizer.from_pretrained(str(model))(EMBEDDED_TEXT, add_special_tokens=False)["input_ids"]
    ppl, sums = _plain_transformers_ppl(model, [ids[i * 24 : (i + 1) * 24] for i in range(3)])
    samples = [json.loads(line) for line in (run / "samples_kl.jsonl").read_text().splitlines()]
    # kl rounds log-probs to float16 (kvcal.evaluate.kl): agreement to that precision, not bit for bit
    assert [s["nll"] for s in samples] == pytest.approx(sums, rel=2e-3)
    assert res["results"]["kl"]["ppl,none"] == pytest.approx(ppl, rel=2e-3)
