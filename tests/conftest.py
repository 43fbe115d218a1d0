"""Suite-wide settings and the shared fixtures: no network, deterministic, small thread pools (CI has 2 cores).

Tiny random-weight models (wiring only; accuracy claims come from the real models):
- `tiny_tokenizer`, `tiny_config`, `tiny_model`, `tiny_model_dir`, `tiny_llama_dir`: one model of every
  cache-routed architecture kvcal calibrates (vocab 320, 3 layers, 2 KV heads, max_pos 64, sliding window 8)
  with a byte-level BPE tokenizer trained on kvcal's generated corpus.
- `word_llama`, `word_llama_dir`: a Llama with a word-level tokenizer "t0".."t255" (vocab 256, 2 KV heads,
  max_pos 128) for the scale-file and export tests.
- `tiny_lm_dir`: a Llama or Gemma 3 whose BPE tokenizer is trained on a caller's corpus (the lm-eval tests).
- `lm_eval_task`: writes a tiny local lm-eval task (YAML + jsonl docs) for `--include_path`.
tests/kernels/conftest.py has the kernels' own models (vocab 96, max_pos 128, window 6).

Markers: `slow` (real model, ../shared/data, or a pipeline end to end) and `realmodel`; see pyproject.toml.
Tests that use `shared_data` or `real_model_path` are marked for them; both skip cleanly when absent.
Conftest modules are never imported by tests (`--import-mode=importlib`): everything shared is a fixture.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

# ../shared/data beside the checkout (read-only); KVCAL_TEST_SHARED_DATA points elsewhere (a missing path
# shows the skips). Tests that need it skip when it is absent.
SHARED_DATA = Path(
    os.environ.get("KVCAL_TEST_SHARED_DATA") or Path(__file__).resolve().parents[2] / "shared" / "data"
)

TINY_ARCHS = ("llama", "qwen2", "mistral", "gemma2", "gemma3", "gpt_oss")
# Sliding window of the tiny sliding-window models (inputs are longer, so the cache really slides).
TINY_WINDOW = 8
CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"


# ------------------------------------------------------------------------------------------- session settings


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    # kvcal's caches (hashes, converted models) go to a per-session folder unless the caller chose one,
    # so tests never depend on what a developer's machine has cached.
    if "KVCAL_CACHE" not in os.environ:
        os.environ["KVCAL_CACHE"] = str(tmp_path_factory.mktemp("kvcal-cache"))


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """torch on one thread for a module (`pytestmark = pytest.mark.usefixtures("one_thread")`): tiny matmuls
    cost less than the thread hand-offs (~10x faster than two threads on a shared 2-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ------------------------------------------------- bounds derived on the machine for quantized outputs (issue 21)


def _batch_bound(response: float, base: float, bf16_error: float) -> float:
    """The most a format's scores may move under a float32 perturbation of its K/V input — a batch of 1 vs 4,
    another attention implementation upstream (sdpa, Triton), another chunking — on this machine, from three
    measurements made there on the same inputs:
    - base: the same comparison (batch 1 vs 4, implementation A vs B, ...) with the BF16 (and float32) cache —
      the perturbation's float32 rounding (other matmul shapes or kernels) as seen through storage as fine as BF16;
    - bf16_error: |BF16 storage - float32 storage|, the score effect of rounding every K/V element to BF16
      (a relative perturbation up to 2^-9 per element);
    - response: |format - the same format with its K/V input rounded to BF16 first| (`kv_input_dtype` bfloat16),
      the format's score response to that same BF16 rounding.
    The amplification of the format is response / bf16_error (measured, with its grid, its E4M3 block scales and
    subnormals, and its scale policy: no constant from one CPU), and the bound is that amplification times the
    BF16 rounding's effect, which must dominate the perturbation's (asserted: base <= bf16_error). Why not times
    base: a perturbation changes FP4/FP8 storage only where it pushes an element across a rounding boundary, and
    then by a whole step, so the response to a small perturbation is a few large flips — not proportional to its
    size (measured on AMD EPYC: nvfp4 moved 0.32 nats where 38x the BF16 difference allows 0.30). Every element a
    float32 perturbation flips lies within its size of a boundary, and the BF16 rounding (hundreds of times
    larger) moves it across as well, among many more: the response bounds the perturbation's effect, with the
    margin of sqrt(flips). Except at a tie: an element within a float32 ulp of an FP8/FP4 rounding midpoint is
    rounded by BF16 onto the midpoint itself (the midpoints are BF16 numbers), where ties-to-even keeps its code
    half the time, while the perturbation moves it across. A sample whose BF16 rounding flipped no code at all
    (response 0: a tiny model, or a format as fine as BF16) therefore carries no amplification figure (measured on
    Intel Xeon AVX-512: fp8_e4m3 response 0, one-chunk vs single-pass gap 3.0e-7 nats from such a flip); it is
    held to the BF16 rounding's own effect, the largest perturbation the derivation measured."""
    assert base <= bf16_error, (
        "the perturbation moves scores more than BF16 rounding does: no bound derives",
        base,
        bf16_error,
    )
    return max(response, base) if response > 0 else max(base, bf16_error)


@pytest.fixture(scope="session")
def batch_bound() -> Callable[[float, float, float], float]:
    """(response, base, bf16_error) -> how far a format's scores may move under a float32 perturbation (batch
    size, attention implementation, chunking) on this machine (see `_batch_bound`)."""
    return _batch_bound


def _check_greedy_agree(
    tokens_a: torch.Tensor,
    tokens_b: torch.Tensor,
    scores_b: Sequence[torch.Tensor],
    prompt: int,
    bound: float,
) -> int:
    """Greedy tokens [B, prompt + new] of two runs agree, except where run b's best two scores (scores_b: one
    [B, V] per step) lie within 2 * bound of each other (a near-tie a perturbation within the bound may swap);
    a row is compared up to its first disagreement (after it the runs continue different texts). Returns the
    number of (row, step) compared, so a caller can see the check was not vacuous."""
    compared = 0
    for i in range(tokens_a.shape[0]):
        for t, y in enumerate(scores_b):
            compared += 1
            if tokens_a[i, prompt + t] != tokens_b[i, prompt + t]:
                top2 = y[i].topk(2).values
                assert float(top2[0] - top2[1]) <= 2 * bound, (i, t, float(top2[0] - top2[1]), bound)
                break
    return compared


@pytest.fixture(scope="session")
def greedy_agree() -> Callable[..., int]:
    """(tokens_a, tokens_b, scores_b, prompt, bound) -> asserts two greedy runs' tokens agree unless b's best two
    scores are within 2 * bound (see `_check_greedy_agree`); returns the number of (row, step) compared."""
    return _check_greedy_agree


# ---------------------------------------------------------------------------------- real models, shared data


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # What a test needs decides its markers, so `-m "not slow"` can never run one that needs a real model/data.
    for item in items:
        names = getattr(item, "fixturenames", ())
        if "real_model_path" in names and item.get_closest_marker("realmodel") is None:
            item.add_marker(pytest.mark.realmodel)
        needs_assets = "shared_data" in names or item.get_closest_marker("realmodel") is not None
        if needs_assets and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)
    # vLLM's released kernels run under the Triton interpreter with triton.language's helpers re-jitted
    # (tests/conformance/conftest.py); the compiled kernels of a later test in the same session then fail to
    # compile (tests/kernels' sm_90 AOT test), so the conformance suite runs last.
    items.sort(key=lambda item: "tests/conformance/" in str(item.path).replace("\\", "/"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"../shared/data is absent ({SHARED_DATA})")
    return SHARED_DATA


@pytest.fixture(scope="session")
def real_model_path() -> Callable[[str], str]:
    """name ('smollm2' | 'gemma3-270m') -> the installed GGUF's path; skips the test when it is not installed."""
    from kvcal.errors import UsageError
    from kvcal.models.real import real_model

    def find(name: str) -> str:
        try:
            return real_model(name)
        except UsageError as exc:  # not installed: the message names the pip command
            pytest.skip(str(exc))

    return find


# ------------------------------------------------------------------------------------------------------ CLI


def _invoke(args: list[str]) -> tuple[int, str, str]:
    from typer.testing import CliRunner

    from kvcal.cli import app

    runner = CliRunner()
    with runner.isolation() as (out, err, _):
        try:
            app(args=args, prog_name="kvcal")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        sys.stdout.flush()
        sys.stderr.flush()
        return code, out.getvalue().decode(), err.getvalue().decode()


@pytest.fixture(scope="session")
def invoke() -> Callable[[list[str]], tuple[int, str, str]]:
    """`invoke(ARGS)` -> (exit code, stdout, stderr) of `kvcal ARGS`, run the way the console script runs it.
    kvcal's app renders `Error: ...` and exits itself, so the SystemExit is caught here rather than by
    CliRunner.invoke (which would hide the stderr line)."""
    return _invoke


# --------------------------------------------------------------------- tiny models of every architecture


def _train_bpe(corpus: Sequence[str], vocab_size: int, special_tokens: list[str]) -> Any:
    """A byte-level BPE `tokenizers.Tokenizer` trained here (offline)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(corpus, trainer=trainer)
    return tk


def _build_tiny_tokenizer() -> Any:
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    from kvcal.calibrate.default_corpus import generate_corpus

    tk = _train_bpe(generate_corpus(40, seed=1), 320, ["<pad>", "<bos>", "<eos>"])
    tk.post_processor = TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", model_max_length=64
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _tiny_config(arch: str) -> Any:
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
    w = TINY_WINDOW
    if arch == "llama":
        return tf.LlamaConfig(**common)
    if arch == "qwen2":  # layer 0 full, layers 1-2 sliding (max_window_layers=1)
        return tf.Qwen2Config(**common, use_sliding_window=True, sliding_window=w, max_window_layers=1)
    if arch == "mistral":
        return tf.MistralConfig(**common, sliding_window=w)
    if arch == "gemma2":
        return tf.Gemma2Config(**common, head_dim=16, sliding_window=w)
    if arch == "gemma3":
        return tf.Gemma3TextConfig(
            **common,
            head_dim=16,
            sliding_window=w,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        )
    if arch == "gpt_oss":
        common.update(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=w)
        return tf.GptOssConfig(**common)
    raise ValueError(f"no tiny config for {arch!r}; choose one of {TINY_ARCHS}")


@pytest.fixture(scope="session")
def tiny_tokenizer() -> Any:
    """A real fast byte-level BPE tokenizer (vocab 320, <bos> prepended, a chat template) trained on kvcal's
    generated corpus; no hub. One object for the session: do not mutate it."""
    return _build_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_config() -> Callable[[str], Any]:
    """arch (one of TINY_ARCHS) -> a fresh transformers config of the tiny model."""
    return _tiny_config


@pytest.fixture(scope="session")
def tiny_model() -> Callable[[str], Any]:
    """arch -> a random-weight causal LM (eval mode, float32, seed 0); the same object for the whole session,
    so tests must not modify it (load a copy from `tiny_model_dir` for that)."""
    from transformers import AutoModelForCausalLM

    built: dict[str, Any] = {}

    def get(arch: str) -> Any:
        if arch not in built:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(_tiny_config(arch), dtype=torch.float32)
            model.eval()
            built[arch] = model
        return built[arch]

    return get


@pytest.fixture(scope="session")
def tiny_model_dir(
    tiny_model: Callable[[str], Any], tiny_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Path]:
    """arch -> a saved folder (safetensors + tokenizer) of `tiny_model(arch)`; one per session: read-only."""
    saved: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in saved:
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            tiny_model(arch).save_pretrained(path)
            tiny_tokenizer.save_pretrained(path)
            saved[arch] = path
        return saved[arch]

    return get


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir("llama")


# ------------------------------------------------------------------- a word-level Llama (scales, export)


def _word_tokenizer() -> Any:
    """A tiny real fast tokenizer (no hub): the words "t0".."t255"."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(256)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="t0", pad_token="t1", eos_token="t2")


def _save_word_llama(path: Path, num_layers: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)
    _word_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def word_llama(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """(num_layers=2) -> a saved random Llama (seed 0, vocab 256, hidden 64, 4 heads / 2 KV heads, max_pos 128)
    with the word-level tokenizer "t0".."t255"; one folder per layer count for the session: read-only (copy it
    to edit)."""
    saved: dict[int, Path] = {}

    def get(num_layers: int = 2) -> Path:
        if num_layers not in saved:
            saved[num_layers] = _save_word_llama(tmp_path_factory.mktemp("word-llama") / "llama", num_layers)
        return saved[num_layers]

    return get


@pytest.fixture(scope="session")
def word_llama_dir(word_llama: Callable[..., Path]) -> Path:
    """The 2-layer `word_llama` folder (read-only)."""
    return word_llama(2)


# ------------------------------------------------------ tokenizer trained on the caller's corpus (lm-eval)


def _save_tiny_lm(path: Path, kind: str, corpus: Sequence[str], vocab_size: int, k_gain: float) -> Path:
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )

    tk = _train_bpe(list(corpus) * 4, vocab_size, ["<pad>", "<s>", "</s>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(str(path))
    ids = dict(
        vocab_size=len(fast), max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0
    )
    torch.manual_seed(0)
    if kind == "llama":
        cfg = LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, **ids,
        )  # fmt: skip
        model = LlamaForCausalLM(cfg)
    elif kind == "gemma3":
        cfg = Gemma3TextConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, sliding_window=6,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"], **ids,
        )  # fmt: skip
        model = Gemma3ForCausalLM(cfg)
    else:
        raise ValueError(f"no tiny lm-eval model of kind {kind!r}; choose llama or gemma3")
    model.eval()
    if k_gain != 1.0:
        with torch.no_grad():  # larger K: quantization error shows in the outputs of a random model
            for layer in model.model.layers:
                layer.self_attn.k_proj.weight.mul_(k_gain)
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def tiny_lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """(kind 'llama' | 'gemma3', corpus, vocab_size=320, k_gain=1.0) -> a saved random model (seed 0, float32)
    whose byte-level BPE tokenizer (<pad> <s> </s>) is trained on `corpus` * 4. Llama: hidden 32, 2 layers,
    4 heads / 2 KV heads; Gemma 3: hidden 32, 3 layers (sliding, sliding, full; window 6), 2 heads / 1 KV head,
    head_dim 16; both max_pos 256. k_gain scales every k_proj weight. One folder per arguments: read-only."""
    saved: dict[tuple[str, tuple[str, ...], int, float], Path] = {}

    def get(kind: str, corpus: Sequence[str], vocab_size: int = 320, k_gain: float = 1.0) -> Path:
        key = (kind, tuple(corpus), vocab_size, k_gain)
        if key not in saved:
            path = tmp_path_factory.mktemp(f"tiny-lm-{kind}")
            saved[key] = _save_tiny_lm(path, kind, corpus, vocab_size, k_gain)
        return saved[key]

    return get


# ------------------------------------------------------------------------------------------- lm-eval task files

# How each lm-eval output type reads a doc of the tiny tasks: multiple_choice docs are {"q", "choices",
# "label"}, loglikelihood_rolling docs {"text"}, generate_until docs {"q", "a"}.
_TASK_DOC_FIELDS: dict[str, dict[str, Any]] = {
    "multiple_choice": {"doc_to_text": "{{q}}", "doc_to_choice": "{{choices}}", "doc_to_target": "label"},
    "loglikelihood_rolling": {"doc_to_text": "", "doc_to_target": "{{text}}"},
    "generate_until": {"doc_to_text": "question : {{q}} answer :", "doc_to_target": "{{a}}"},
}


def _write_lm_eval_task(
    task_dir: Path, name: str, output_type: str, docs: Sequence[dict[str, Any]], metrics: Sequence[str],
    **extra: Any,
) -> None:  # fmt: skip
    task_dir.mkdir(parents=True, exist_ok=True)
    data = task_dir / f"{name}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    task = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        "output_type": output_type,
        **_TASK_DOC_FIELDS[output_type],
        **extra,
        "metric_list": [{"metric": m} for m in metrics],
        "metadata": {"version": 1.0},
    }
    (task_dir / f"{name}.yaml").write_text(yaml.safe_dump(task, sort_keys=False))


@pytest.fixture(scope="session")
def gemma_like(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma-3-270M's KV geometry: 18 layers (5 sliding of window 512, then 1 full, three times), 1 KV head,
    head_dim 256."""
    from transformers import Gemma3TextConfig

    from kvcal.models.geometry import FULL, SLIDING

    d = tmp_path_factory.mktemp("gemma-like")
    Gemma3TextConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=256, num_hidden_layers=18,
        intermediate_size=64, vocab_size=128, sliding_window=512, layer_types=([SLIDING] * 5 + [FULL]) * 3,
    ).save_pretrained(d)  # fmt: skip
    return d


@pytest.fixture(scope="session")
def lm_eval_task() -> Callable[..., None]:
    """(task_dir, name, output_type, docs, metrics, **extra keys) -> writes task_dir/name.jsonl (the docs) and
    task_dir/name.yaml, a local lm-eval task over them that `--include_path task_dir` loads as `name`. The doc
    fields each output type reads are in _TASK_DOC_FIELDS; `extra` adds or overrides task keys."""
    return _write_lm_eval_task
