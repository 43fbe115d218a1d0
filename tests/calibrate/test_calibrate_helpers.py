"""Tiny random models of every cache-routed architecture kvcal calibrates, and a byte-level tokenizer.

Imported by the calibration tests (`from test_calibrate_helpers import ...`); builds are cached per process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

ARCHS = ("llama", "qwen2", "mistral", "gemma2", "gemma3", "gpt_oss")
WINDOW = 8  # sliding window of the tiny sliding-window models (inputs are longer, so the cache really slides)

CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"


def tiny_tokenizer() -> Any:
    """A real fast byte-level BPE tokenizer (vocab 320) trained on kvcal's generated corpus; no hub."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from kvcal.calibrate.default_corpus import generate_corpus

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<pad>", "<bos>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(generate_corpus(40, seed=1), trainer=trainer)
    from tokenizers.processors import TemplateProcessing

    tk.post_processor = TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", model_max_length=64
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_config(arch: str) -> Any:
    import transformers as tf

    common: dict[str, Any] = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    if arch == "llama":
        return tf.LlamaConfig(**common)
    if arch == "qwen2":
        # layer 0 full, layers 1-2 sliding (max_window_layers=1)
        return tf.Qwen2Config(**common, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    if arch == "mistral":
        return tf.MistralConfig(**common, sliding_window=WINDOW)
    if arch == "gemma2":
        return tf.Gemma2Config(**common, head_dim=16, sliding_window=WINDOW)
    if arch == "gemma3":
        return tf.Gemma3TextConfig(
            **common,
            head_dim=16,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        )
    if arch == "gpt_oss":
        common.update(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=WINDOW)
        return tf.GptOssConfig(**common)
    raise ValueError(arch)


_BUILT: dict[str, Any] = {}


def tiny_model(arch: str) -> Any:
    """A random-weight causal LM (eval mode, float32), seeded; the same object per process."""
    from transformers import AutoModelForCausalLM

    if arch not in _BUILT:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32)
        model.eval()
        _BUILT[arch] = model
    return _BUILT[arch]


def save_tiny(arch: str, path: Path) -> Path:
    """A tiny model folder (safetensors + tokenizer) at `path`."""
    tiny_model(arch).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny("llama", tmp_path_factory.mktemp("tiny-llama"))


def test_tiny_tokenizer_round_trips() -> None:
    tok = tiny_tokenizer()
    ids = tok("Hello, kvcal: 12 + 30 = 42.")["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == "Hello, kvcal: 12 + 30 = 42."
