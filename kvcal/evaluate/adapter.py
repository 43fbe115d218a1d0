"""lm-eval model `kvcal`: lm-eval's HFLM whose every forward reads K/V through kvcal's quantized cache.

`kvcal-lm-eval --model kvcal --model_args pretrained=DIR,kv_format=nvfp4,kv_scales=S,skip_layers=sliding_window
--tasks ...` is lm-eval's own command line with this model registered (lm-eval 0.4.13 has no model plugin discovery,
so plain `lm_eval --model kvcal` works wherever kvcal.evaluate.adapter has been imported, e.g. from Python). With `kv_format=auto` nothing is overridden: the class *is* HFLM (the parity
reference) but for one default: log-likelihoods' log-softmax and sums run in float32 whatever the model's dtype
(HFLM's softmax_dtype; lm-eval's own default, the model's dtype, with `logprob_dtype=model`). Otherwise:

- `_loglikelihood_tokens` (loglikelihood, loglikelihood_rolling) with `scoring=continuation` scores only the
  continuation's rows (kvcal.evaluate.scoring): each forward gets a fresh quantized cache as `past_key_values` with
  `use_cache=True`, so the prefill itself writes K/V into the quantized cache and attention reads them back
  dequantized — the same thing an engine does when it serves a prompt with a quantized KV cache; a question's
  choices share one prefill of its context; the LM head and a log-softmax run on the continuation rows only, a
  bounded block at a time.
  A sequence longer than `prefill_chunk` is prefilled chunk by chunk. `scoring=continuation-whole` keeps lm-eval's
  forwards (every request's whole window in one forward, its batches) and sends only the continuation's rows through
  the head: lm-eval's numbers through a quantized cache too. `scoring=full` (the default) keeps lm-eval's
  own path (full-vocabulary logits of every position, through `_model_call`), its cache a fresh quantized one too.
- `_model_generate` (generate_until) passes a fresh quantized cache to `generate`, so prefill and every decode step
  read quantized K/V.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from kvcal import parallel
from kvcal.errors import UsageError
from kvcal.evaluate.bound import BoundSpec, bind
from kvcal.evaluate.kl import DEFAULT_PREFILL_CHUNK, check_prefill_chunk
from kvcal.evaluate.spec import check_logprob_dtype, check_scoring
from kvcal.evaluate.timing import ForwardTimer, generate_call
from kvcal.kernels.plan import CachePlan
from kvcal.models.loading import input_device, load_resolved
from kvcal.models.perturb import check_perturbation, perturb_weights
from kvcal.models.resolve import resolve_model


def _as_bool(value: Any) -> bool:
    # lm-eval's --model_args parser turns "true"/"false" into bools, but a dict may still hold strings.
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


@register_model("kvcal")
class KvcalLM(HFLM):
    """HFLM with kvcal's quantized KV cache. Extra model_args: kv_format, kv_scales, skip_layers, impl,
    force_scales, nvfp4_global (nvfp4 without scales: one | per_sequence), model_ref (the name recorded in results; defaults to `pretrained`),
    kv_input_dtype (K/V rounded to it before quantization; default: kvcal eval's, bfloat16); kv_scales=first-batch is vLLM's
    calculate_kv_scales; attention (kv | fp8: vLLM's FlashAttention-3 FP8 attention); scoring (full: lm-eval's
    every-position path, the default | continuation: only the continuation rows meet the LM head); prefill_chunk
    (continuation scoring prefills a longer sequence chunk by chunk; default 2048); prefix_serde +
    prefix_tokens (LMCache's storage tier, kvcal.serde: each request's first N tokens' K/V round-trip through it);
    logprob_dtype (float32: log-softmax and sums of log-likelihoods in float32 whatever the model's dtype, the
    default | model: lm-eval's HFLM default, the model's dtype; HFLM's own softmax_dtype, given, wins). HFLM's
    max_length is lm-eval's (the rolling window of loglikelihood_rolling, the truncation of contexts);
    perturb_weights + perturb_seed: every weight moved by that many ulps of its dtype (kvcal.models.perturb)."""

    # kvcal eval's timer of this LM's forwards (kvcal.evaluate.timing); its generate calls mark their requests
    forward_timer: ForwardTimer | None = None
    # the base of every sampled request's seed (generate_until): lm-eval's default torch seed; kvcal eval sets
    # its --seed's (kvcal.evaluate.record.seeds)
    sample_seed: int = 1234
    # each generate_until request's generated token ids, by context (GenerationRecorder; kvcal eval takes them)
    generations: GenerationRecorder

    def __init__(
        self,
        pretrained: str | Any,
        kv_format: str | None = None,
        kv_scales: str | None = None,
        skip_layers: str | None = None,
        impl: str | None = None,
        force_scales: bool | str = False,
        model_ref: str | None = None,
        nvfp4_global: str | None = None,
        kv_input_dtype: str | None = None,
        attention: str | None = None,
        device_map: str | None = None,
        max_memory: str | None = None,
        offload_folder: str | None = None,
        prefix_serde: str | None = None,
        prefix_tokens: int | str | None = None,
        **kwargs: Any,
    ) -> None:
        # lm-eval's command line and Python: the model_args strings parsed here, once, by the same eval_spec and
        # bind that kvcal eval uses, with kvcal eval's defaults for what is not given (None here: EvalConfig's);
        # kvcal eval itself builds the LM with `from_bound`
        bound = bind_model_args(
            pretrained,
            kv_format=kv_format,
            kv_scales=kv_scales,
            skip_layers=skip_layers,
            impl=impl,
            force_scales=force_scales,
            model_ref=model_ref,
            nvfp4_global=nvfp4_global,
            kv_input_dtype=kv_input_dtype,
            attention=attention,
            device_map=device_map,
            max_memory=max_memory,
            offload_folder=offload_folder,
            prefix_serde=prefix_serde,
            prefix_tokens=prefix_tokens,
            trust_remote_code=kwargs.get("trust_remote_code", False),
        )
        self._set_up(bound, pretrained, kwargs)

    @classmethod
    def from_bound(cls, bound: BoundSpec, **kwargs: Any) -> KvcalLM:
        """kvcal eval's LM: the spec bound to the checkpoint (kvcal.evaluate.bound) passed whole; its cache plan
        holds the checked scale set and skip indices, nothing is parsed or read again. `kwargs`: HFLM's."""
        lm = cls.__new__(cls)
        lm._set_up(bound, str(bound.model_dir), kwargs)
        return lm

    def _set_up(self, bound: BoundSpec, pretrained: Any, kwargs: dict[str, Any]) -> None:
        """HFLM's load of `pretrained` (the bound folder, or a built model) and the bound cache plan installed."""
        scoring = kwargs.pop("scoring", "full")
        # log-likelihoods in float32 whatever the model's dtype unless asked (lm-eval's HFLM: softmax_dtype = the
        # model's dtype, a bf16 document total rounded to tens of nats); HFLM's own softmax_dtype, given, wins
        logprob_dtype = check_logprob_dtype(str(kwargs.pop("logprob_dtype", "float32")), "model_args logprob_dtype=")
        own_softmax = kwargs.get("softmax_dtype") is not None
        prefill_chunk = kwargs.pop("prefill_chunk", DEFAULT_PREFILL_CHUNK)
        perturb = check_perturbation(kwargs.pop("perturb_weights", None), "model_args perturb_weights=")
        perturb_seed = int(kwargs.pop("perturb_seed", 0))
        placement = bound.spec.placement
        if isinstance(pretrained, (str, os.PathLike)):
            pretrained = str(bound.model_dir)  # real-model names and .gguf files: a local safetensors folder
            if placement.active:  # accelerate's dispatch: kvcal loads, HFLM takes the placed model
                placed = load_resolved(
                    bound.model_dir,
                    bound.hf_config,
                    dtype=str(kwargs.pop("dtype", "auto")),
                    device=bound.spec.device,
                    trust_remote_code=bound.spec.trust_remote_code,
                    placement=placement,
                    ref=bound.spec.model,
                )
                pretrained, kwargs["tokenizer"] = placed.model, placed.tokenizer
                kwargs.pop("device", None)
        super().__init__(pretrained=pretrained, **kwargs)
        if (
            perturb is not None
        ):  # the same model as another correct implementation computes it (a yardstick run)
            perturb_weights(self.model, perturb, perturb_seed)
        if not own_softmax:  # HFLM's _loglikelihood_tokens and kvcal's Scorer both read softmax_dtype
            self.softmax_dtype = torch.float32 if logprob_dtype == "float32" else None
        if placement.active:  # inputs go where the embedding is (HFLM took the first parameter's device)
            self._device = input_device(self.model)
        # Data parallel under torchrun / accelerate launch: lm-eval splits requests by lm.rank / lm.world_size
        # (Task.doc_iterator) and gathers them on rank 0 (evaluator.evaluate), but HFLM 0.4.13 reports them only
        # with several GPUs; kvcal reports them whatever the device (gloo on CPU). tp_plan: one model, no split.
        self._kvcal_dist = parallel.from_env() if kwargs.get("tp_plan") is None else parallel.Dist()
        self._kvcal_tp = parallel.from_env() if kwargs.get("tp_plan") is not None else parallel.Dist()
        if self._kvcal_dist.active:
            self._rank, self._world_size = self._kvcal_dist.rank, self._kvcal_dist.world_size
        self.model_dir = bound.model_dir
        self.generations = GenerationRecorder(self.tok_decode)
        self.cache: CachePlan = bound.cache  # what the runtime installs (format auto: nothing)
        # loglikelihood requests: "continuation" / "continuation-whole" (kvcal.evaluate.scoring) or "full"
        # (lm-eval's every-position path)
        self.scoring = check_scoring(str(scoring), "model_args scoring=")
        # continuation scoring prefills a sequence longer than this chunk by chunk (kvcal.evaluate.scoring)
        self.prefill_chunk = check_prefill_chunk(int(prefill_chunk))
        self.runtime: Any = None
        if self.cache.quantized:
            self.activate_runtime()
        self.kvcal_config = resolved_config(bound, self.model, self.scoring, self.prefill_chunk)
        if perturb is not None:
            self.kvcal_config.update(perturb_weights=perturb, perturb_seed=perturb_seed)

    def get_model_info(self) -> dict[str, Any]:
        """HFLM's model info (lm-eval's simple_evaluate adds it to the results' `config`) and kvcal's whole
        resolved configuration under `kvcal`: what a kvcal eval run's config.yaml records of the cache, defaults
        included, so `kvcal compare` reads the configuration lm-eval ran, not only what was typed."""
        return {**super().get_model_info(), "kvcal": self.kvcal_config}

    # ---- lm-eval's collectives over torch.distributed (HFLM's go through accelerate, GPU runs only) --------

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self._kvcal_dist.active:
            return super().all_gather(tensor)
        return parallel.all_gather_tensor(tensor, self._kvcal_dist)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        if not self._kvcal_dist.active:
            return super().gather_object(obj, dst=dst)
        if dst != 0:
            raise ValueError("kvcal gathers on rank 0 only")
        return parallel.gather_objects(obj, self._kvcal_dist, what="gathering lm-eval's samples")

    def barrier(self) -> None:
        if not self._kvcal_dist.active:
            return super().barrier()
        parallel.barrier(self._kvcal_dist)

    # ---- the two places HFLM calls the model -------------------------------------------------------------

    def _model_call(
        self, inps: torch.Tensor, attn_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.runtime is None or attn_mask is not None or labels is not None:
            return super()._model_call(inps, attn_mask=attn_mask, labels=labels)
        # inps: [B, T] right-padded (HFLM); the mask tells the cache which positions are padding (not stored)
        mask = _right_padding_mask(inps, getattr(self, "_row_lengths", None))
        self._row_lengths = None
        with torch.no_grad(), self._autocast():
            out = self.model(
                inps, attention_mask=mask, past_key_values=self.runtime.new_cache(), use_cache=True
            )
        return out.logits  # [B, T, V]

    def _autocast(self) -> Any:
        """HFLM's mixed precision (`mixed_precision_dtype`) around a forward, as its own `_model_call` does."""
        return torch.autocast(
            device_type=self.device.type,
            dtype=self.mixed_precision_dtype,
            enabled=self.mixed_precision_dtype is not None,
        )

    def _loglikelihood_tokens(
        self, requests: list[Any], disable_tqdm: bool = False, override_bs: int | None = None
    ) -> list[tuple[float, bool]]:
        if getattr(self, "scoring", "full") == "full" or self.backend != "causal":
            with _recording_row_lengths(self):  # lm-eval's own path: every position's logits
                return super()._loglikelihood_tokens(
                    requests, disable_tqdm=disable_tqdm, override_bs=override_bs
                )
        return self._score_continuations(requests, override_bs)

    def _score_continuations(self, requests: list[Any], override_bs: int | None) -> list[tuple[float, bool]]:
        """lm-eval's loglikelihood requests scored on their continuation rows only (kvcal.evaluate.scoring): the
        same (log-likelihood, is_greedy) as HFLM's path to float rounding, with logits for no other position."""
        from transformers.cache_utils import DynamicCache

        from kvcal.evaluate.scoring import Scorer

        def forward(ids: torch.Tensor, mask: torch.Tensor | None, cache: Any, keep: int) -> torch.Tensor:
            return self.model(
                ids, attention_mask=mask, past_key_values=cache, use_cache=True, logits_to_keep=keep
            ).logits

        def new_cache() -> Any:  # read by one forward after its prefill: no values kept for later reads
            rt = self.runtime
            return rt.new_cache(workspace=False) if rt is not None else DynamicCache(config=self.model.config)

        bs = override_bs or (self.batch_size if isinstance(self.batch_size, int) else 1)
        # continuation-whole: lm-eval's forwards (whole windows, its batches), only the head's rows differ
        whole = getattr(self, "scoring", "continuation") == "continuation-whole"
        scorer = Scorer(
            self.model,
            forward,
            new_cache,
            shareable=not whole and self._prefix_shareable(),
            device=self.device,
            checked=getattr(self, "_head_checked", False),
            prefill_chunk=None if whole else getattr(self, "prefill_chunk", DEFAULT_PREFILL_CHUNK),
            logprob_dtype=getattr(self, "softmax_dtype", torch.float32),
        )
        with torch.no_grad(), self._autocast():
            res = scorer.score(requests, max_length=self.max_length, batch_size=bs)
        self._head_checked = scorer.checked
        for (key, _, _), answer in zip(requests, res, strict=True):
            if key is not None:  # lm-eval's cache hook (rolling windows carry None: their caller adds them)
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return res

    def _prefix_shareable(self) -> bool:
        """Whether a context's K/V can be written by its own forward and reused by each choice: not when a write's
        scale comes from the tokens written with it (first-batch scales, nvfp4's per-sequence global)."""
        if self.runtime is None:
            return True
        return not any(
            p.first_batch is not None
            or (
                p.side_format(w).codec.global_scale
                and getattr(p, f"{w}_scale") is None
                and p.nvfp4_global != "one"
            )
            for p in self.runtime.plans
            for w in ("k", "v")
        )

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """lm-eval's generate_until; when the requests sample, one request at a time, each from its own seed
        (kvcal.evaluate.repeats.sample_seed of this LM's sample_seed, the task, the document and the repeat), so
        repeat r of a document draws the same random numbers in every configuration and in every batching, and
        two configurations' repeats pair. lm-eval hands a request with `repeats: N` over as N consecutive copies
        of one Instance: the copy's position among them is its repeat. Greedy requests: lm-eval's path as is."""
        from kvcal.evaluate.repeats import sample_seed, samples

        with self.generations.recording(self):
            if not any(samples(req.args[1]) for req in requests):
                return super().generate_until(requests, disable_tqdm=disable_tqdm)
            from tqdm import tqdm

            seen: dict[int, int] = {}
            out: list[str] = []
            bar = tqdm(
                requests, desc="Running sampled generate_until requests", disable=disable_tqdm or self.rank != 0
            )
            for req in bar:
                repeat = seen.get(id(req), 0)
                seen[id(req)] = repeat + 1
                torch.manual_seed(sample_seed(self.sample_seed, req.task_name, req.doc_id, repeat))
                out.extend(super().generate_until([req], disable_tqdm=True))
            return out

    def _model_generate(
        self, context: torch.Tensor, max_length: int, stop: list[str], **generation_kwargs: Any
    ):
        if self.runtime is not None:
            # context: [B, T] left-padded; generate keeps the attention mask, the cache holds quantized K/V.
            generation_kwargs["past_key_values"] = self.runtime.new_cache()
        with generate_call(self.forward_timer, int(context.shape[0])):
            out = super()._model_generate(context, max_length, stop, **generation_kwargs)
        self.generations.push([row[context.shape[1] :] for row in out.tolist()])  # [B][generated ids]
        return out

    def activate_runtime(self) -> None:
        """(Re)install this LM's cache plan on its model. A model carries one KVRuntime at a time, so anything
        that installs another one (the kl task's BF16 baseline) calls this afterwards."""
        from kvcal.kernels.runtime import KVRuntime, shard_by_head

        plan = self.cache
        if self.runtime is not None and self.runtime.first_batch is not None:
            # the scales the first batch fixed stay fixed (vLLM keeps them for the server's lifetime)
            plan = dataclasses.replace(plan, first_batch=self.runtime.first_batch)
        rt = KVRuntime.from_plan(self.model, plan)
        shard_by_head(rt, self._kvcal_tp)
        self.runtime = rt if plan.quantized else None

    @property
    def kv_format(self) -> str:
        return self.cache.kv_format

    @property
    def skip_layers(self) -> frozenset[int]:
        return self.cache.skip_layers

    @property
    def scale_set(self) -> Any:
        return self.cache.scales


class GenerationRecorder:
    """The generated token ids of every generate_until request, by its context string (what the comparison needs
    to find the first token where two runs' outputs differ; lm-eval's samples keep only the text).

    HFLM.generate_until decodes each row of a `_model_generate` batch and, in the same order, hands the request's
    (context, gen_kwargs) and its final text to the LM's cache hook (`cache_hook.add_partial`). So `_model_generate`
    pushes the batch's generated rows and, while `recording`, this object stands in as the cache hook (passing
    every call on to lm-eval's own): each generate_until call takes the next row, cut to the tokens that make up
    the text lm-eval kept (up to its stop sequence)."""

    def __init__(self, decode: Any) -> None:
        self.decode = decode  # the LM's tok_decode (the one HFLM decodes rows with)
        self.inner: Any = None
        self.pending: list[list[int]] = []
        self.by_context: dict[str, list[list[int]]] = {}

    @contextmanager
    def recording(self, lm: Any) -> Iterator[None]:
        if self.inner is not None:  # nested (the sampled path calls generate_until per request): already on
            yield
            return
        self.inner, lm.cache_hook = lm.cache_hook, self
        try:
            yield
        finally:
            lm.cache_hook, self.inner = self.inner, None
            self.pending = []

    def push(self, rows: list[list[int]]) -> None:
        if self.inner is not None:
            self.pending.extend(rows)

    def add_partial(self, attr: str, req: Any, res: Any) -> None:
        if attr == "generate_until" and self.pending:
            ids = self.pending.pop(0)
            self.by_context.setdefault(str(req[0]), []).append(self.cut(ids, str(res)))
        self.inner.add_partial(attr, req, res)

    def cut(self, ids: list[int], text: str) -> list[int]:
        """The shortest prefix of `ids` that decodes to at least `text`'s length (lm-eval cut the decoded row at
        its stop sequence; rows of a batch that finished early run on until the batch stops)."""
        lo, hi = 0, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self.decode(ids[:mid])) >= len(text):
                hi = mid
            else:
                lo = mid + 1
        return ids[:lo]

    def take(self) -> dict[str, list[list[int]]]:
        out, self.by_context = self.by_context, {}
        return out


def _name_of(pretrained: Any) -> str:
    """The model's name as lm-eval gave it: a path or name, or a built model's name_or_path."""
    if isinstance(pretrained, (str, os.PathLike)):
        return str(pretrained)
    return str(getattr(pretrained, "name_or_path", "model"))


def _as_tokens(value: Any) -> int | None:
    """A model_args token count (lm-eval's parser makes '64' an int; a dict may hold the string); None if unset.
    UsageError for a value that is not a whole number."""
    if value in (None, "", "none", "None"):
        return None
    try:
        return int(str(value).strip())
    except ValueError:
        raise UsageError(f"prefix_tokens must be a whole number of tokens, got '{value}'") from None


def _given(value: Any) -> str | None:
    """A model_args string, None where lm-eval's command line leaves it empty or writes none."""
    return None if value in (None, "", "none", "None") else str(value)


def bind_model_args(pretrained: Any, **model_args: Any) -> BoundSpec:
    """lm-eval's `--model_args` of the cache (strings as typed) parsed by `eval_spec`, the parser kvcal eval uses,
    and bound to the checkpoint by `bind`: the spec has no tasks (lm-eval runs its own). An option not given (or
    given empty / none) takes EvalConfig's default, kvcal eval's: the two doors resolve one configuration the same
    way (the kv input dtype bfloat16, nvfp4's global scale one, ...). `pretrained`: a folder, hub id, .gguf file
    or real-model name, or an already-built transformers model."""
    from kvcal.evaluate.spec import EvalConfig, eval_spec

    trust = _as_bool(model_args.get("trust_remote_code", False))
    built = not isinstance(pretrained, (str, os.PathLike))
    given = {
        "kv_format": _given(model_args.get("kv_format")),
        "scales": _given(model_args.get("kv_scales")),
        "skip_layers": _given(model_args.get("skip_layers")),
        "impl": _given(model_args.get("impl")),
        "nvfp4_global": _given(model_args.get("nvfp4_global")),
        "kv_input_dtype": _given(model_args.get("kv_input_dtype")),
        "attention": _given(model_args.get("attention")),
        "prefix_serde": _given(model_args.get("prefix_serde")),
        "prefix_tokens": _as_tokens(model_args.get("prefix_tokens")),
        "device_map": _given(model_args.get("device_map")),
        "max_memory": _given(model_args.get("max_memory")),
        "offload_folder": _given(model_args.get("offload_folder")),
    }
    config = EvalConfig(
        model=str(model_args.get("model_ref") or _name_of(pretrained)),
        force_scales=_as_bool(model_args.get("force_scales", False)),
        trust_remote_code=trust,
        **{k: v for k, v in given.items() if v is not None},
    )
    spec = eval_spec(config, own_tasks=False)
    if built:  # its folder (for the scale file's binding) and its config
        return bind(
            spec, model_dir=Path(getattr(pretrained, "name_or_path", ".")), hf_config=pretrained.config
        )
    return bind(spec, model_dir=resolve_model(pretrained, trust_remote_code=trust))


def resolved_config(bound: BoundSpec, model: Any, scoring: str, prefill_chunk: int) -> dict[str, Any]:
    """The cache configuration lm-eval's model runs, resolved (config.yaml's names, kvcal.rundir.RunConfig): the
    spec's record without its tasks (lm-eval's), the checkpoint folder, the model's dtype as loaded, the skipped
    layer indices, the scale file's sha256 and granularity, the scoring path."""
    fields = bound.spec.recorded_fields()
    for key in ("tasks", "limit", "num_fewshot", "data_dir", "kl_seq_len", "passkey_lengths", "passkey_depths",
                "prompts", "repeats", "gen_kwargs", "max_gen_toks", "batch_size", "seed", "device"):  # fmt: skip
        fields.pop(key, None)  # lm-eval's own settings, in its record
    dtype = getattr(model, "dtype", None)
    scales = None
    if bound.scales is not None:  # config.yaml's `scales` record, its identity part
        from kvcal.filecache import sha256_file

        scales = {"sha256": sha256_file(str(bound.spec.scales.path)), "granularity": bound.scales.granularity}
    fields.update(
        model_dir=str(bound.model_dir),
        dtype=str(dtype).removeprefix("torch.") if dtype is not None else bound.dtype,
        skip_layer_indices=sorted(bound.skip_layers),
        scales=scales,
        scoring=scoring,
        prefill_chunk=prefill_chunk if scoring != "full" else None,
    )
    return fields


@contextmanager
def _recording_row_lengths(lm: Any) -> Iterator[None]:
    """HFLM._loglikelihood_tokens right-pads each batch (lm_eval.models.huggingface.pad_and_concat) and calls
    `_model_call(batch)` without a mask; record the rows' real lengths on `lm` for that call (padding must not be
    stored: a sample's cache must not depend on its batch). Restores lm-eval's function afterwards."""
    import lm_eval.models.huggingface as hf

    original = hf.pad_and_concat

    def recording(max_length: int, tensors: list[torch.Tensor], padding_side: str = "right") -> torch.Tensor:
        if padding_side == "right":
            lm._row_lengths = [int(t.shape[-1]) for t in tensors]
        return original(max_length, tensors, padding_side=padding_side)

    hf.pad_and_concat = recording
    try:
        yield
    finally:
        hf.pad_and_concat = original


def _right_padding_mask(inps: torch.Tensor, lengths: list[int] | None) -> torch.Tensor | None:
    """[B, T] attention mask (1 = real) of a right-padded batch with these row lengths; None = no padding known."""
    if lengths is None or len(lengths) != inps.shape[0] or max(lengths) > inps.shape[1]:
        return None
    n = torch.tensor(lengths, device=inps.device)
    return (torch.arange(inps.shape[1], device=inps.device)[None, :] < n[:, None]).long()
