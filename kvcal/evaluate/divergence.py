"""kvcal's `divergence` tasks: after how many generated tokens a quantized cache's greedy output leaves the BF16
cache's, and what one decode step through the cache costs.

Prompts: an lm-eval task's own requests (`divergence` and `divergence_gsm8k`: gsm8k; `divergence_aime25`;
`divergence_gpqa_diamond`), built by lm-eval (`Task.build_all_requests`: its few-shot context, its seed, its
`--num-fewshot`), so a prompt is byte for byte what `kvcal eval --tasks gsm8k` sends; `--limit` prompts. The
generation length is `--max-gen-toks` (default 256); a prompt longer than the model's positions leave for it is
cut from the left, as lm-eval's HFLM cuts a generation context.

Per prompt, three passes, each one forward per generated token (the engine's decode path: every step writes one
token into the cache and attends over everything stored):
1. baseline: greedy decode through a BF16 cache (kvcal's attention, as `kl`'s baseline), until EOS or the cap.
   Its tokens are cached on disk (key: model fingerprint, baseline side, BOS-free prompt ids, cap, EOS ids)
   under $KVCAL_CACHE/divergence, so a sweep decodes it once. The BF16 log-probs every comparison needs come
   from one chunked prefill of prompt + trajectory through the BF16 cache (`baseline_logprobs`), recomputed per
   evaluation: a prefill is cheap next to the decodes, and [n, V] float16 per prompt on disk is not (Gemma 3,
   262k vocabulary, 2,048 tokens: 1 GB a prompt).
2. quantized greedy decode from the same prompt: token-exact identity, the first generated position where the
   tokens differ (1-based; censored at the shorter output's length when they never do), the answer lm-eval's
   filters extract from each output (the task's first filter), and vLLM's `check_logprobs_close` at top-k 5
   (vllm-project/vllm tests/models/utils.py @ 9cfdcd89: at the first differing token, each side's token must be
   among the other's top-k log-probs; outputs that never differ pass).
3. teacher-forced decode: the baseline's tokens fed back one per forward through the quantized cache: KL(bf16 ||
   quant), top-1 agreement and the BF16 top-1 margin (log-prob of its best minus its second-best token) by
   generated position, in `kl`'s position buckets (1-512, 513-1024, ...).
And beside (3), the prefill KL of the same tokens: prompt + trajectory through both caches in chunks of
--prefill-chunk (kl's chunked prefill). The two agree for formats whose scales do not depend on what was written
before (static scales, per-token scales); they differ where a scale is fixed at the first write (first-batch
scales: decode quantizes every generated token with the prompt's scale, prefill with the whole sequence's).

The run's hazard, survival curve and projection to long outputs are the report's (kvcal.report.agreement).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvcal.errors import UsageError
from kvcal.evaluate.kl import mean_stderr
from kvcal.filecache import cache_root as kvcal_cache_root
from kvcal.io import atomic_write_with

DIVERGENCE_VERSION = 2  # 2: the cache holds tokens only
DEFAULT_GEN_LEN = 256
TOP_K = 5  # vLLM's correctness tests ask for 5 log-probs (e.g. tests/models/language/generation)
METRICS = ("answer_agree", "identical", "logprobs_close", "decode_kl", "prefill_kl", "decode_top1")
_LOWER = {"decode_kl", "prefill_kl"}

ChunkForward = Callable[..., torch.Tensor]  # (ids [1, c], keep=None) -> logits [1, c | len(keep), V]


# ---- comparing two outputs ----------------------------------------------------------------------------------


def first_divergence(a: list[int], b: list[int]) -> tuple[int, bool]:
    """(time, event): the 1-based position of the first token where `a` and `b` differ (event True), or the
    shorter length when one is a prefix of the other (event False: censored, the outputs were compared that far)."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i + 1, True
    return n, False


def logprobs_close(
    ids_0: list[int], ids_1: list[int], top_0: list[list[int]], top_1: list[list[int]]
) -> bool:
    """vLLM's check_logprobs_close on one prompt, as a pass/fail: at the first position where the tokens differ,
    ids_0's token must be in top_1 (the other side's top-k ids there) and ids_1's in top_0; then stop (the
    sequences diverge from there). No differing position: pass. top_*: [n][k] token ids per generated step."""
    for idx, (t0, t1) in enumerate(zip(ids_0, ids_1, strict=False)):
        if t0 != t1:
            return t0 in top_1[idx] and t1 in top_0[idx]
    return True


# ---- decoding -----------------------------------------------------------------------------------------------


def fp16_logprobs(logits: torch.Tensor) -> torch.Tensor:
    # logits [n, V] -> float16 log-probs [n, V], as kl stores its baseline (kvcal.evaluate.kl._fp16_logprobs)
    from kvcal.evaluate.kl import _fp16_logprobs

    return _fp16_logprobs(logits)


def greedy(
    forward: ChunkForward, prompt: torch.Tensor, gen_len: int, eos: set[int]
) -> tuple[list[int], torch.Tensor]:
    """Greedy decode of up to `gen_len` tokens (EOS included, then stop), one forward per token after the
    prompt's. prompt: [1, P]. Returns (tokens, their top-k ids [n, k])."""
    P = prompt.shape[1]
    logits = forward(prompt, torch.tensor([P - 1], device=prompt.device))[0, -1]  # [V]
    tokens: list[int] = []
    rows: list[torch.Tensor] = []
    while True:
        row = logits.float()
        tok = int(row.argmax())
        tokens.append(tok)
        rows.append(row.topk(TOP_K).indices.cpu())
        if tok in eos or len(tokens) >= gen_len:
            break
        logits = forward(torch.tensor([[tok]], device=prompt.device))[0, -1]
    return tokens, torch.stack(rows)


def teacher_forced(forward: ChunkForward, prompt: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """Logits [n, V] (float32, CPU) of the quantized side predicting each of `tokens`: the prompt's last row,
    then one forward per token of tokens[:-1] (each written into the cache before the next is read)."""
    P = prompt.shape[1]
    rows = [forward(prompt, torch.tensor([P - 1], device=prompt.device))[0, -1].float().cpu()]
    for tok in tokens[:-1]:
        rows.append(forward(torch.tensor([[tok]], device=prompt.device))[0, -1].float().cpu())
    return torch.stack(rows)


def prefilled(forward: ChunkForward, ids: torch.Tensor, first: int, chunk: int) -> torch.Tensor:
    """Logits [T - first, V] (float32, CPU) of rows first..T-1 of ids [1, T], by chunked prefill (chunks of
    `chunk` tokens, each attending to the cache of the earlier ones; only the wanted rows are computed)."""
    T = ids.shape[1]
    out = []
    for s in range(0, T, chunk):
        piece = ids[:, s : min(T, s + chunk)]
        keep = torch.arange(max(first - s, 0), piece.shape[1])
        if keep.numel() == 0:
            forward(piece, torch.tensor([piece.shape[1] - 1], device=ids.device))  # fills the cache only
            continue
        out.append(forward(piece, keep.to(ids.device))[0].float().cpu())
    return torch.cat(out)


# ---- baseline cache -----------------------------------------------------------------------------------------


def cache_root() -> Path:
    return kvcal_cache_root() / "divergence"


def trajectory_key(
    fingerprint: str, baseline: dict[str, Any], prompt: list[int], gen_len: int, eos: set[int]
) -> str:
    blob = json.dumps(
        {
            "v": DIVERGENCE_VERSION,
            "model": fingerprint,
            "baseline": baseline,
            "ids": hashlib.sha256(json.dumps(prompt).encode()).hexdigest(),
            "gen_len": gen_len,
            "eos": sorted(eos),
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def _path(root: Path, key: str) -> Path:
    return root / key[:2] / f"{key}.safetensors"


def load_trajectory(root: Path, key: str) -> list[int] | None:
    """The tokens of a cached baseline trajectory; None when absent or damaged."""
    from safetensors.torch import load_file

    try:
        tokens = load_file(str(_path(root, key)))["tokens"].tolist()
    except Exception:
        return None
    return tokens if tokens else None


def store_trajectory(root: Path, key: str, tokens: list[int]) -> None:
    """Only the tokens: the BF16 log-probs a comparison needs are recomputed by one prefill (`baseline_logprobs`),
    since [n, V] float16 per prompt would be 25 MB for SmolLM2's 49k vocabulary at 256 tokens and 2 GB for
    Gemma 3's 262k at 2,048 (100 gsm8k prompts: 2.5 GB; 30 aime25 prompts on Gemma: 60 GB)."""
    from safetensors.torch import save_file

    data = {"tokens": torch.tensor(tokens, dtype=torch.long)}
    try:
        atomic_write_with(_path(root, key), lambda tmp: save_file(data, str(tmp)))
    except OSError as exc:
        raise UsageError(
            f"cannot write the divergence baseline cache under '{root}' ({exc.strerror or exc}); "
            "set KVCAL_CACHE to a writable folder"
        ) from exc


def baseline_logprobs(session: ChunkForward, prompt: list[int], tokens: list[int], chunk: int, device: Any) -> torch.Tensor:
    """float16 log-probs [n, V] of the BF16 cache predicting each of the trajectory's n tokens: one chunked
    prefill of prompt + tokens[:-1] through the BF16 cache (BF16 decode and prefill agree within float tolerance:
    tests/evaluate/test_divergence.py)."""
    full = torch.tensor([prompt + tokens[:-1]], dtype=torch.long, device=device)
    return fp16_logprobs(prefilled(session, full, len(prompt) - 1, chunk)).contiguous()


# ---- statistics ---------------------------------------------------------------------------------------------


def margins(lp16: torch.Tensor) -> torch.Tensor:
    """BF16 top-1 margin per step: log p(best) - log p(second best). lp16 [n, V] -> [n] float32."""
    top2 = lp16.float().topk(2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


def by_position(
    per_prompt: list[dict[str, torch.Tensor]], edges: list[tuple[int, int]], gen_len: int
) -> dict[str, Any]:
    """results.json's `divergence_by_position`: per kl position bucket (over the 1-based generated position) the
    token-weighted mean of decode KL, prefill KL, top-1 agreement and the BF16 margin, and the standard error over
    the prompts that reach the bucket (outputs end at EOS, so later buckets hold fewer prompts)."""
    names = ("decode_kl", "prefill_kl", "decode_top1", "margin")
    buckets = []
    for lo, hi in edges:  # kvcal.evaluate.kl.position_buckets(gen_len)
        entry: dict[str, Any] = {"lo": lo, "hi": hi}
        parts = [{m: p[m][lo - 1 : hi] for m in names} for p in per_prompt if p["decode_kl"].numel() >= lo]
        entry["n_prompts"] = len(parts)
        entry["n_tokens"] = int(sum(p["decode_kl"].numel() for p in parts))
        for m in names:
            if not parts:
                entry[m] = entry[f"{m}_stderr"] = None
                continue
            entry[m] = float(torch.cat([p[m] for p in parts]).double().mean())
            means = [float(p[m].double().mean()) for p in parts]
            entry[f"{m}_stderr"] = mean_stderr(means)
        buckets.append(entry)
    return {"gen_len": gen_len, "n_prompts": len(per_prompt), "buckets": buckets}


# ---- prompts ------------------------------------------------------------------------------------------------


def lm_eval_requests(
    spec: str | dict[str, Any],
    task_manager: Any,
    num_fewshot: int | None,
    fewshot_seed: int,
    limit: int | None,
) -> tuple[Any, list[Any]]:
    """(lm-eval Task, its generate_until Instances in doc order) of one task spec, built the way simple_evaluate
    builds them (its --num-fewshot override, its few-shot seed)."""
    from lm_eval.tasks import get_task_dict

    tasks = [t for t in _leaf_tasks(get_task_dict([spec], task_manager))]
    if len(tasks) != 1:
        raise UsageError(f"a divergence task needs one lm-eval task for its prompts, got {len(tasks)}")
    task = tasks[0]
    if task.get_config("output_type") != "generate_until":
        raise UsageError(f"the divergence prompts' task '{task.config.task}' is not a generative task")
    if num_fewshot is not None and task.get_config("num_fewshot") != 0:
        task.set_config(key="num_fewshot", value=num_fewshot)
    elif task.get_config("num_fewshot") is None:
        task.set_config(key="num_fewshot", value=0)
    task.set_fewshot_seed(seed=fewshot_seed)
    task.build_all_requests(limit=limit, rank=0, world_size=1)
    return task, sorted(task.instances, key=lambda inst: inst.doc_id)


def _leaf_tasks(d: Any) -> list[Any]:
    out = []
    for v in d.values():
        out.extend(_leaf_tasks(v) if isinstance(v, dict) else [v])
    return out


def extracted_answers(task: Any, instances: list[Any], texts: list[str]) -> list[str]:
    """The answer lm-eval's first filter of `task` extracts from each text (its filtered response)."""
    for inst, text in zip(instances, texts, strict=True):
        inst.resps = [text]
        inst.filtered_resps = {}
    task.apply_filters()
    name = task._filters[0].name
    out = []
    for inst in instances:
        r = inst.filtered_resps[name]
        out.append(str(r[0] if isinstance(r, (list, tuple)) else r))
    return out


def _cut(text: str, until: list[str]) -> str:
    # lm-eval's HFLM cuts a generation at the first stop sequence
    for term in until:
        if term:
            text = text.split(term)[0]
    return text


def eos_ids(tokenizer: Any, model: Any) -> set[int]:
    ids: set[int] = set()
    gen = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for v in (tokenizer.eos_token_id, gen):
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)
    return ids


# ---- the task -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class UserPrompts:
    """`--prompts FILE.jsonl` read: the prompt texts in file order and the file's sha256 (names the prompts)."""

    texts: list[str]
    sha256: str


@dataclass
class _UserPrompt:
    """What the loop reads of an lm-eval Instance, for a prompt of --prompts: its index and no stop sequence."""

    doc_id: int
    text: str

    @property
    def arguments(self) -> tuple[str, dict[str, Any]]:
        return self.text, {}


def run_divergence(
    lm: Any,
    *,
    task: str,
    prompts_spec: str | dict[str, Any],
    task_manager: Any,
    quant_session: Callable[[], ChunkForward],
    baseline: Any,
    baseline_desc: dict[str, Any],
    evaluated_desc: dict[str, Any],
    fingerprint: str,
    gen_len: int,
    edges: list[tuple[int, int]],
    limit: int | None,
    num_fewshot: int | None,
    fewshot_seed: int,
    prefill_chunk: int,
    cache_dir: Path | None = None,
    user_prompts: UserPrompts | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Evaluate divergence task `task` (module docstring) with kvcal's lm-eval model `lm` (.model, .tokenizer,
    .tok_encode, .tok_decode, .max_length). `quant_session()` / `baseline()`: as kl's (kvcal.evaluate.kl.lm_sides).
    `fingerprint`: the checkpoint's (kvcal.evaluate.kl.model_fingerprint), part of the baseline trajectories' key.
    Returns (an lm-eval-shaped results dict with `divergence_by_position`, one sample record per prompt)."""
    from kvcal.evaluate.kl import token_stats
    from kvcal.models.loading import input_device

    if gen_len >= lm.max_length:
        raise UsageError(
            f"--max-gen-toks {gen_len} leaves no room for a prompt in the model's {lm.max_length} positions; "
            f"use at most {lm.max_length - 1}"
        )
    model, root = lm.model, cache_dir or cache_root()
    device = input_device(model)
    if user_prompts is None:
        lm_task, instances = lm_eval_requests(prompts_spec, task_manager, num_fewshot, fewshot_seed, limit)
        texts = [inst.arguments[0] for inst in instances]
    else:  # --prompts: the user's own; the "answer" is the whole output (no task filter to extract one)
        lm_task, texts = None, user_prompts.texts[:limit] if limit else user_prompts.texts
        instances = [_UserPrompt(i, t) for i, t in enumerate(texts)]
    eos = eos_ids(lm.tokenizer, model)
    room = lm.max_length - gen_len
    prompts = [lm.tok_encode(text)[-room:] for text in texts]
    keys = [trajectory_key(fingerprint, baseline_desc, p, gen_len, eos) for p in prompts]
    hits = _baseline_trajectories(baseline, prompts, keys, root, gen_len, eos, device)

    samples: list[dict[str, Any]] = []
    per_prompt: list[dict[str, torch.Tensor]] = []
    base_texts, quant_texts = [], []
    with torch.no_grad():
        for inst, prompt, key in zip(instances, prompts, keys, strict=True):
            base_tokens = load_trajectory(root, key)
            assert base_tokens is not None  # stored just above
            with baseline() as new_session:
                base_lp16 = baseline_logprobs(new_session(), prompt, base_tokens, prefill_chunk, device)
            ids = torch.tensor([prompt], dtype=torch.long, device=device)  # [1, P]
            q_tokens, q_top = greedy(quant_session(), ids, gen_len, eos)
            base_top = base_lp16.float().topk(TOP_K, dim=-1).indices
            targets = torch.tensor(base_tokens, dtype=torch.long)
            dec = token_stats(base_lp16, teacher_forced(quant_session(), ids, base_tokens), targets)
            full = torch.tensor([prompt + base_tokens[:-1]], dtype=torch.long, device=device)
            pre = token_stats(
                base_lp16, prefilled(quant_session(), full, len(prompt) - 1, prefill_chunk), targets
            )
            t, event = first_divergence(base_tokens, q_tokens)
            until = list((inst.arguments[1] or {}).get("until") or [])
            base_texts.append(_cut(lm.tok_decode(base_tokens), until))
            quant_texts.append(_cut(lm.tok_decode(q_tokens), until))
            per_prompt.append(
                {
                    "decode_kl": dec[0],
                    "prefill_kl": pre[0],
                    "decode_top1": dec[1],
                    "margin": margins(base_lp16),
                }
            )
            samples.append(
                {
                    "doc_id": inst.doc_id,
                    "filter": "none",
                    "metrics": list(METRICS),
                    "identical": float(base_tokens == q_tokens),
                    "logprobs_close": float(
                        logprobs_close(base_tokens, q_tokens, base_top.tolist(), q_top.tolist())
                    ),
                    "decode_kl": float(dec[0].mean()),
                    "prefill_kl": float(pre[0].mean()),
                    "decode_top1": float(dec[1].mean()),
                    "first_divergence": t,
                    "diverged": event,
                    "prompt_tokens": len(prompt),
                    "prompt_sha256": hashlib.sha256(json.dumps(prompt).encode()).hexdigest(),
                    "base_len": len(base_tokens),
                    "quant_len": len(q_tokens),
                    "base_tokens": base_tokens,
                    "quant_tokens": q_tokens,
                }
            )
    if lm_task is None:
        base_answers, quant_answers = base_texts, quant_texts
    else:
        base_answers = extracted_answers(lm_task, instances, base_texts)
        quant_answers = extracted_answers(lm_task, instances, quant_texts)
    for s, a, b in zip(samples, base_answers, quant_answers, strict=True):
        s["answer_agree"] = float(a == b)
        s["base_answer"], s["quant_answer"] = a, b
    config = {
        "task": task,
        "output_type": "kvcal_divergence",
        "prompts": lm_task.config.task if lm_task else f"file sha256:{user_prompts.sha256}",
        "num_fewshot": lm_task.get_config("num_fewshot") if lm_task else None,
        "gen_len": gen_len,
        "greedy": True,
        "top_k": TOP_K,
        "eos_token_ids": sorted(eos),
        "answer_filter": lm_task._filters[0].name if lm_task else "none (the whole output)",
        "prefill_chunk": prefill_chunk,
        "baseline": baseline_desc,
        "evaluated": evaluated_desc,
        "baseline_cache_hits": hits,
    }
    results = _results(task, samples, config, len(lm_task.eval_docs) if lm_task else len(user_prompts.texts))
    results["divergence_by_position"] = {task: by_position(per_prompt, edges, gen_len)}
    return results, samples


def _baseline_trajectories(
    baseline: Any,
    prompts: list[list[int]],
    keys: list[str],
    root: Path,
    gen_len: int,
    eos: set[int],
    device: torch.device,
) -> int:
    """Greedy-decode the BF16 baseline of every prompt not cached yet, in one baseline() entry, and store its
    tokens. Returns the number of cache hits."""
    missing = [i for i, k in enumerate(keys) if load_trajectory(root, k) is None]
    if missing:
        with baseline() as new_session, torch.no_grad():
            for i in missing:
                ids = torch.tensor([prompts[i]], dtype=torch.long, device=device)
                tokens, _ = greedy(new_session(), ids, gen_len, eos)
                store_trajectory(root, keys[i], tokens)
    return len(keys) - len(missing)


def _results(task: str, samples: list[dict[str, Any]], config: dict[str, Any], total: int) -> dict[str, Any]:
    """lm-eval's results-dict shape for a divergence task: per-prompt means with their standard errors, and the
    divergences per 1,000 compared tokens (the report gives its interval, survival and projection)."""
    metrics: dict[str, Any] = {"alias": task}
    for m in METRICS:
        vals = [s[m] for s in samples]
        metrics[f"{m},none"] = sum(vals) / len(vals)
        se = mean_stderr(vals)
        metrics[f"{m}_stderr,none"] = "N/A" if se is None else se
    exposure = sum(s["first_divergence"] for s in samples)
    events = sum(bool(s["diverged"]) for s in samples)
    metrics["divergences_per_1k,none"] = events / exposure * 1000 if exposure else None
    metrics["divergences_per_1k_stderr,none"] = "N/A"
    hib = {m: m not in _LOWER for m in METRICS}
    hib["divergences_per_1k"] = False
    return {
        "results": {task: metrics},
        "configs": {
            task: {
                **config,
                "metric_list": [
                    {"metric": m, "higher_is_better": hib[m]} for m in (*METRICS, "divergences_per_1k")
                ],
                "metadata": {"version": DIVERGENCE_VERSION},
            }
        },
        "versions": {task: DIVERGENCE_VERSION},
        "n-shot": {task: config["num_fewshot"] or 0},
        "higher_is_better": {task: hib},
        "n-samples": {task: {"original": total, "effective": len(samples)}},
    }


def private_record(rec: dict[str, Any]) -> dict[str, Any]:
    """A divergence record of a private task: token ids dropped (decodable text), answers hashed."""
    out = {k: v for k, v in rec.items() if k not in ("base_tokens", "quant_tokens")}
    for k in ("base_answer", "quant_answer"):
        out[k] = "sha256:" + hashlib.sha256(str(rec[k]).encode()).hexdigest()
    return out
