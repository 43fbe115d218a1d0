"""Continuation-only scoring of lm-eval `loglikelihood` requests (multiple choice, rolling windows).

lm-eval's HFLM (lm_eval/models/huggingface.py, `_loglikelihood_tokens`, lm-eval 0.4.13) runs each request's window
`(context + continuation)[-(max_length + 1):][:-1]` through the model, takes the log-softmax of the full-vocabulary
logits of every position, then reads only the last len(continuation) rows. Here the same window is split into

    prefix = window[: len(window) - len(continuation) + 1]     ends with the token that predicts continuation[0]
    rest   = window[len(prefix):]                               = continuation[:-1] (after any left truncation)

and only the rows that predict continuation tokens ever meet the LM head (the decoder's final hidden states are
taken at the head's input, projected a block of rows at a time, log-softmax on those rows only: in float32 unless
`logprob_dtype=model` asks for lm-eval's HFLM default, the model's dtype), as
engines do (transformers' `logits_to_keep`, vLLM's prompt log-probs of the requested positions).

Requests whose prefixes are the same (a multiple-choice question's choices) share one prefill of the prefix: its
cache is repeated across the choices (`Cache.batch_repeat_interleave`) and every choice's rest runs in one batched
forward on top of it, as an engine with prefix caching serves them. This is only done where a write's quantization
does not depend on the tokens written with it (not for `--scales first-batch` or nvfp4's per-sequence global, whose
scale comes from the first write) and where the prefix is at least as long as the longest rest; every other request
runs its whole window in one forward, as lm-eval does.

A sequence longer than `prefill_chunk` tokens (a shared prefix, or a window scored alone) is prefilled chunk by
chunk on one cache, as kl's long windows and an engine's chunked prefill are: each chunk attends to the cache's K/V
of the earlier ones, so a layer's activations are held for one chunk at a time (an 8k passkey prefix of Gemma 3
otherwise holds 3 x 8192 x 2048 float32 MLP activations per layer at once), and only the head's input rows are kept
([T, d], small). Rows move as a split forward's do (other matmul shapes: below).

The numbers are lm-eval's to float rounding: a row's hidden state is the same function of the same tokens (computed
in a split forward, or in a batch of another shape), the head is the model's own (`get_output_embeddings`, then the
post-processing the model's forward applies: final_logit_softcapping, logits_scaling, logit_scale), and lm-eval's
is_greedy is the per-row argmax test on the same rows. Through a quantized cache "float rounding" is larger: the
split computes K/V in matmuls of other shapes, whose last-bit differences the cache turns into code flips (Gemma-3
gpqa through fp8_e4m3: up to 0.155 nats per choice; through a float32 cache 1.2e-05: bench/RESULTS.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

# (cache key, context tokens, continuation tokens): HFLM._loglikelihood_tokens' requests
Request = tuple[Any, list[int], list[int]]
NewCache = Callable[
    [], Any
]  # () -> a fresh cache for one forward's batch (kvcal's quantized one, or DynamicCache)

# Rows of logits per head call: ~2**24 elements (64 MiB of float32) whatever the vocabulary (Gemma 3's 262,144: 64
# rows; SmolLM2's 49,152: 341), so a 32k-token rolling window never holds window x vocabulary logits. Row-wise the
# statistics are the same for any block size.
_HEAD_BUDGET = 1 << 24


def model_window(context: list[int], continuation: list[int], max_length: int) -> list[int]:
    """The tokens lm-eval's causal HFLM feeds the model for one request (left-truncated to max_length)."""
    return (context + continuation)[-(max_length + 1) :][:-1]


@dataclass
class _Item:
    index: int  # position in the caller's request list
    window: list[int]
    continuation: list[int]

    @property
    def prefix_len(self) -> int:
        return len(self.window) - len(self.continuation) + 1


class _HeadInput:
    """While active: a forward pre-hook on the model's output embeddings records the decoder's final hidden states
    [B, T, d] (what the head would project) and hands the head none of their rows, or only the last one
    (`keep_last`), so the model's forward computes (almost) no logits; `project` applies the head afterwards to the
    rows wanted."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.head = model.get_output_embeddings()
        self.hidden: torch.Tensor | None = None

    @contextmanager
    def active(self, keep_last: bool) -> Iterator[_HeadInput]:
        self.hidden = None

        def hook(_module: Any, args: tuple) -> tuple:
            h = args[0]  # [B, T, d]
            self.hidden = h
            return (h[..., -1:, :] if keep_last else h[..., :0, :], *args[1:])

        handle = self.head.register_forward_pre_hook(hook)
        try:
            yield self
        finally:
            handle.remove()

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """Rows of final hidden states [n, d] -> the model's logits [n, V] (its forward's post-processing)."""
        logits = self.head(h)
        cfg = self.model.config
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        cap = getattr(text, "final_logit_softcapping", None)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        scaling = getattr(text, "logits_scaling", None)
        if scaling is not None:
            logits = logits / scaling
        scale = getattr(self.model, "logit_scale", None)
        if scale is not None:
            logits = logits * scale
        return logits


def score_rows(
    head: _HeadInput, hidden: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype | None = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [n, d] final hidden states and targets [n] next tokens -> (log-prob [n] in `dtype`, greedy [n] bool),
    a block of rows through the head at a time (peak: one block of logits, whatever n). `dtype`: the log-softmax's
    (HFLM's softmax_dtype; None: the logits' own dtype, lm-eval's default)."""
    step = max(1, _HEAD_BUDGET // max(1, int(head.head.weight.shape[0])))
    logps, greedy = [], []
    for r0 in range(0, hidden.shape[0], step):
        t = targets[r0 : r0 + step]
        lp = torch.log_softmax(head.project(hidden[r0 : r0 + step]), dim=-1, dtype=dtype)  # [rows, V]
        logps.append(lp.gather(-1, t[:, None]).squeeze(-1))
        greedy.append(lp.argmax(-1) == t)
    return torch.cat(logps), torch.cat(greedy)


# forward(ids [B, T], attention_mask [B, past + T] | None, cache, logits_to_keep) -> logits [B, k, V]
Forward = Callable[[torch.Tensor, torch.Tensor | None, Any, int], torch.Tensor]


class Scorer:
    """Scores lm-eval loglikelihood requests on one model (module docstring). `forward` runs the model (the caller
    owns no_grad / autocast / the kvcal runtime's hooks); `new_cache` gives the cache each forward batch starts
    from; `shareable`: whether a prefix's K/V may be written apart from what follows (static or no scales)."""

    def __init__(
        self,
        model: Any,
        forward: Forward,
        new_cache: NewCache,
        shareable: bool,
        device: Any,
        checked: bool = False,
        prefill_chunk: int | None = None,
        logprob_dtype: torch.dtype | None = torch.float32,
    ) -> None:
        self.head = _HeadInput(model)
        self.forward = forward
        self.new_cache = new_cache
        self.shareable = shareable
        self.device = device
        self.checked = checked  # `project` verified on this model already (_verify)
        self.prefill_chunk = prefill_chunk  # longest single forward of one sequence (None: no limit)
        # log-softmax and sums in this dtype (None: the logits' dtype, lm-eval's HFLM default softmax_dtype)
        self.logprob_dtype = logprob_dtype

    def _verify(self, hidden: torch.Tensor, logits: torch.Tensor) -> None:
        """Once per model: `project` must give the model's own logits [B, k, V] bit for bit from the hidden states
        [B, k, d] its head was handed (every scored row relies on it)."""
        if self.checked:
            return
        if not torch.equal(self.head.project(hidden), logits):
            raise RuntimeError(
                f"{type(self.head.model).__name__}: the LM head applied to the decoder's hidden states does not "
                "reproduce the model's logits; score this model with model_args scoring=full"
            )
        self.checked = True

    def _chunks(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """One sequence's ids [1, T] -> its prefill chunks [1, c] in order (one chunk when T <= prefill_chunk)."""
        step = self.prefill_chunk or ids.shape[1]
        return list(ids.split(max(1, step), dim=1))

    def _lead_in(self, chunks: list[torch.Tensor], cache: Any) -> list[torch.Tensor]:
        """Every chunk but the last through the model on `cache` (the head computes no row) -> their final hidden
        states [1, c, d] in order."""
        hidden = []
        for chunk in chunks[:-1]:
            with self.head.active(keep_last=False):
                self.forward(chunk, None, cache, 0)
            assert self.head.hidden is not None
            hidden.append(self.head.hidden)
        return hidden

    def _prefix_logits(self, ids: torch.Tensor, cache: Any) -> torch.Tensor:
        """The prefix forward (chunked past prefill_chunk): the model's own logits of its last row [1, V] (its head
        computes that row only)."""
        chunks = self._chunks(ids)
        self._lead_in(chunks, cache)
        with self.head.active(keep_last=True):
            logits = self.forward(chunks[-1], None, cache, 1)  # [1, 1, V]; the head was handed that row alone
        assert self.head.hidden is not None
        self._verify(self.head.hidden, logits)
        return logits[0]

    def _hidden(self, ids: torch.Tensor, mask: torch.Tensor | None, cache: Any) -> torch.Tensor:
        """The decoder's final hidden states [B, T, d]; the head computes no row (its last row, the first time:
        the check of `project`). One unpadded sequence (B = 1, no mask) longer than prefill_chunk runs chunked."""
        chunks = self._chunks(ids) if mask is None and ids.shape[0] == 1 else [ids]
        lead = self._lead_in(chunks, cache)
        with self.head.active(keep_last=not self.checked):
            logits = self.forward(chunks[-1], mask, cache, 0)
        hidden = self.head.hidden
        assert hidden is not None
        if not self.checked:
            self._verify(hidden[:, -1:], logits)
        return torch.cat([*lead, hidden], dim=1) if lead else hidden

    def score(
        self, requests: Sequence[Request], max_length: int, batch_size: int
    ) -> list[tuple[float, bool]]:
        """(log-likelihood, is_greedy) of every request, in the order given."""
        items = [
            _Item(i, model_window(ctx, cont, max_length), cont) for i, (_, ctx, cont) in enumerate(requests)
        ]
        groups: dict[tuple[int, ...], list[_Item]] = {}
        for it in items:
            groups.setdefault(tuple(it.window[: it.prefix_len]), []).append(it)
        out: list[tuple[float, bool] | None] = [None] * len(items)
        singles: list[_Item] = []
        for prefix, members in groups.items():
            longest_rest = max(len(m.window) - m.prefix_len for m in members)
            if self.shareable and len(members) > 1 and len(prefix) >= longest_rest:
                for m, ans in zip(members, self._shared(prefix, members), strict=True):
                    out[m.index] = ans
            else:
                singles.extend(members)
        # lm-eval's order: longest window first (an out-of-memory shows at once), right-padded batches
        singles.sort(key=lambda m: (-len(m.window), m.window))
        for b0 in range(0, len(singles), max(1, batch_size)):
            batch = singles[b0 : b0 + max(1, batch_size)]
            for m, ans in zip(batch, self._batch(batch), strict=True):
                out[m.index] = ans
        return [a for a in out if a is not None]

    def _shared(self, prefix: tuple[int, ...], members: list[_Item]) -> list[tuple[float, bool]]:
        """One prefill of the shared prefix, then every member's rest in one batch on copies of its cache."""
        cache = self.new_cache()
        ids = torch.tensor([prefix], dtype=torch.long, device=self.device)  # [1, P]
        # [1, V] (float32 by default): the row that predicts every member's continuation[0], one log-softmax for all of them
        first = torch.log_softmax(self._prefix_logits(ids, cache), dim=-1, dtype=self.logprob_dtype)
        rests = [m.window[m.prefix_len :] for m in members]
        width = max(len(r) for r in rests)
        hidden: torch.Tensor | None = None
        if width:
            cache.batch_repeat_interleave(len(members))
            ids = torch.tensor([r + [0] * (width - len(r)) for r in rests], device=self.device)  # [N, R]
            lengths = torch.tensor([len(r) for r in rests], device=self.device)
            mask = None
            if bool((lengths < width).any()):  # [N, P + R]: the prefix, then each rest's own tokens
                rest_mask = torch.arange(width, device=self.device)[None, :] < lengths[:, None]
                seen = torch.ones(len(members), len(prefix), dtype=torch.bool, device=self.device)
                mask = torch.cat([seen, rest_mask], 1).long()
            hidden = self._hidden(ids, mask, cache)  # [N, R, d]
        answers = []
        for j, m in enumerate(members):
            n_rest = len(rests[j])
            rows = hidden[j, :n_rest] if hidden is not None and n_rest else None
            answers.append(self._answer(rows, m.continuation, first))
        return answers

    def _batch(self, batch: list[_Item]) -> list[tuple[float, bool]]:
        """Whole windows, right-padded into one forward (lm-eval's batches); only continuation rows are scored."""
        width = len(batch[0].window)
        ids = torch.tensor([m.window + [0] * (width - len(m.window)) for m in batch], device=self.device)
        lengths = torch.tensor([len(m.window) for m in batch], device=self.device)
        mask = None
        if bool((lengths < width).any()):
            mask = (torch.arange(width, device=self.device)[None, :] < lengths[:, None]).long()
        hidden = self._hidden(ids, mask, self.new_cache())  # [B, T, d]
        answers = []
        for j, m in enumerate(batch):
            n = len(m.window)
            answers.append(self._answer(hidden[j, n - len(m.continuation) : n], m.continuation))
        return answers

    def _answer(
        self, rows: torch.Tensor | None, continuation: list[int], first: torch.Tensor | None = None
    ) -> tuple[float, bool]:
        """rows [n, d] hidden states predicting the continuation's last n tokens (n = all of them, or all but the
        first when `first` [1, V], the log-probs predicting its first token, is given) -> lm-eval's (sum of the
        continuation's log-probs, every token greedy)."""
        targets = torch.tensor(continuation, dtype=torch.long, device=self.device)
        if first is None:
            assert rows is not None
            logp, greedy = score_rows(self.head, rows, targets, self.logprob_dtype)
        else:
            logp, greedy = first[0, targets[:1]], first[0].argmax()[None] == targets[:1]
            if rows is not None:
                rest_lp, rest_greedy = score_rows(self.head, rows, targets[1:], self.logprob_dtype)
                logp, greedy = torch.cat([logp, rest_lp]), torch.cat([greedy, rest_greedy])
        return float(logp.sum()), bool(greedy.all())
