"""kvcal's `kl` task: how far a quantized KV cache moves the model's next-token distributions.

Over held-out text windows (WikiText-2 test from --data-dir, or the embedded text below), for every position t:
  KL(p_bf16 || p_quant) = sum_v p_bf16(v) * (log p_bf16(v) - log p_quant(v)),
top-1 agreement (argmax equal) and the quantized run's negative log-likelihood of the true next token (-> ppl).
p_bf16 is the same model with a BF16 KV cache (what a BF16 server stores), read through kvcal's attention. For a
quantized format the evaluated side reads its cache through that same attention, so the difference is the cache
format alone; for `auto` the evaluated side is the model's own transformers attention over its own-dtype cache,
so the KL also holds the difference between the two attention implementations (the results say which: `configs.kl`
records both sides, `baseline` and `evaluated`).

Windows start the way the model's tokenizer starts a text: with BOS only when the tokenizer itself adds one
(`tokenizer("x")` starts with it, or `add_bos_token`); SmolLM2's tokenizer has a BOS token (<|im_start|>) but never
adds it, Gemma's adds <bos>. The rule that applied is recorded (`configs.kl.bos`) and is part of the cache key.

Baseline cache: the baseline's full log-probs of each window are stored once (float16 safetensors, keyed by the
model's weights/config fingerprint, dtype, device, attention impl, BOS rule and the window's token ids) under
$KVCAL_CACHE/kl (default ~/.cache/kvcal/kl), so a sweep over formats runs the baseline once per window.
Both sides are rounded to float16 log-probs and renormalised before the KL, so identical runs give exactly 0 and
a cached baseline gives exactly what a fresh one would. (fp16 keeps ~3 significant digits of a log-prob; the
rounding is the same on both sides, its effect on KL is far below the 1e-4 that FP8 caches already produce.)

Long windows (seq_len > prefill_chunk, default 2048): chunked prefill, as an engine with chunked prefill serves a
long prompt. Each chunk is one forward with the side's own cache as `past_key_values`, so it attends to the
(quantized) K/V of every earlier chunk; the baseline runs in lockstep, chunk by chunk with its own BF16 cache, and
KL / top-1 / NLL are computed per chunk, so memory is bounded by chunk x vocabulary (never window x vocabulary:
a 32k-token window of Gemma 3's 262k vocabulary would be 17 GB of float16 log-probs). Nothing of a chunked
window's baseline is cached on disk (it is recomputed with every run); windows that fit one chunk keep the disk
cache above, bit for bit.

Subsampled positions (`--kl-subsample N`, N a power of two up to 512): every token still runs through both
sides (the cache holds them all), but only positions 0, N, 2N, ... of a window are scored: the model computes
logits for those rows only (transformers' `logits_to_keep` as indices), so the LM head and the statistics cost 1/N.
At long windows of a large vocabulary these dominate (Gemma 3's 262k-entry head is ~60% of a 2048-token chunk's
FLOPs, the statistics as much again on CPU). Each bucket below starts at a multiple of N, so none is empty; every
mean is over the scored positions and `n_tokens` counts them.

By position: every run also reports KL, top-1 agreement and NLL averaged in position buckets (`kl_by_position`:
1-512, 513-1024, 1025-2048, ... over the 1-based position of the predicting token), with standard errors over
windows, so damage that grows with context shows.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import torch

from kvcal import parallel
from kvcal.errors import KvcalError, UsageError
from kvcal.evaluate.tasks import KL_TEXT_FILE, read_text_file
from kvcal.filecache import cache_root as kvcal_cache_root
from kvcal.filecache import cached_sha256
from kvcal.io import atomic_write_with
from kvcal.models.loading import input_device

# 2: windows start with BOS only where the tokenizer adds one (1 prepended it whenever the tokenizer had one).
KL_VERSION = 2
DEFAULT_SEQ_LEN = 256
DEFAULT_PREFILL_CHUNK = 2048
MAX_SUBSAMPLE = 512  # = FIRST_BUCKET: every position bucket keeps its first position
FIRST_BUCKET = 512  # kl_by_position: [1, 512], then powers of two [513, 1024], [1025, 2048], ...
# Logit rows per step of the per-token statistics: ~2**20 elements (4 MiB float32) whatever the vocabulary.
# Small on purpose: glibc serves allocations over 32 MiB by a fresh mmap each time, so 64 MiB blocks paid page
# faults and zeroing on every temporary (token_stats of 512 x 262k rows: 6.0 s at 2**24, 2.4 s at 2**20, /tmp
# micro-benchmark in the issue-14 note); row-wise statistics are identical for any block size.
_STATS_BUDGET = 1 << 20

# One side of the comparison over one window: chunk ids [1, c] in order -> logits [1, c, V]; the session's cache
# keeps the K/V of every earlier chunk. A SessionFactory opens a fresh session (a fresh cache).
ChunkForward = Callable[..., torch.Tensor]  # (ids [1, c], keep=None) -> logits [1, c | len(keep), V]
SessionFactory = Callable[[], ChunkForward]
# baseline(): a context manager that makes the BF16-cache configuration runnable on the model and yields its
# SessionFactory; on exit the evaluated configuration is in place again (a session survives exit and re-entry).
Baseline = Callable[[], AbstractContextManager[SessionFactory]]

# Held-out text for `kl` when no --data-dir is given. Written for kvcal (not copied from any corpus); plain
# English prose with numbers, names and some structure so that attention has something to do. About 2,270
# Gemma 3 / 2,320 SmolLM2 tokens: 17 windows of 128 tokens (Gemma, BOS + 127), enough for `kvcal compare`'s
# default --min-samples 10 with room to spare.
EMBEDDED_TEXT = """\
The harbour town of Calloway sits where two rivers meet before they reach the sea. For most of the nineteenth
century it was known for rope, not fish: the long sheds along the eastern bank turned hemp from the inland farms
into cables for ships that anchored a mile offshore. In 1871 the town counted 4,312 residents, of whom nearly a
third worked in the ropewalks or in the carting trade that fed them. When steel cable arrived, the sheds emptied
within a decade, and the town turned slowly toward the river traffic it had always ignored.

The change is visible in the parish records. Between 1880 and 1890 the number of boatmen listed as fathers at
baptism rose from nine to forty-seven, while the number of ropemakers fell from one hundred and twelve to fifteen.
Many families simply moved their work a few hundred yards, from the sheds to the quays, and the skills of splicing
and knotting found new use in rigging barges. A local schoolmaster, writing to a regional newspaper in 1889,
complained that the children now learned the names of every lock upstream but could no longer tell a good fibre
from a poor one.

Calloway's second transformation came with the railway. The line from the county town reached the western bank in
1903, and with it came a station, a hotel of thirty rooms and a steady stream of visitors who wanted to see the
confluence at high tide. The hotel's register, which survives almost complete, shows guests from every part of the
country and a surprising number from abroad: engineers studying the tidal bore, painters who rented rooms for a
month at a time, and in one wet August a party of eleven botanists searching the salt marsh for a rare sedge.

A careful reader of that register notices patterns. Guests arrived on Fridays far more often than on any other
day; the average stay was three nights in summer and five in winter, when the few who came were mostly working.
The rooms facing the water cost a shilling more, and the hotel was rarely full except during the regatta, which
began in 1907 and was held on the first Saturday after the spring equinox. The regatta's rules, printed each year
on a single sheet, changed little: boats were divided by length into four classes, no boat could carry more than
six crew, and any dispute was settled by the harbour master, whose decision was final.

Numbers tell part of the story. In 1911 the census recorded 5,870 people; in 1931, 6,204; in 1951, 5,415, the
decline reflecting both war and the closing of the last boatyard. Yet the town never emptied the way the ropewalks
had. People stayed because the rivers still needed tending, because the station still ran four trains a day, and
because, as one resident put it in an oral history recorded in 1978, "there is always something to mend here, and
somebody has to know how."

Today the sheds on the eastern bank hold a museum, a bakery and a workshop where volunteers restore wooden boats.
Visitors can watch a cable being laid by hand on the second Sunday of each month, using a reconstructed walk
ninety yards long. The demonstration takes about two hours. First the yarns are spun from fibre, then twisted into
strands in the opposite direction, and finally the strands are laid together, again reversing the twist, so that
the finished rope holds its shape under load. The guides explain that each reversal locks the previous one, and
that a rope made without this balance will kink and unravel the first time it is used.

The lesson has an obvious appeal for a town that has changed its trade three times in a hundred and fifty years.
Each new way of earning a living was laid against the grain of the last, and the community held together because
of the tension between them rather than in spite of it. Whether that is history or only a good story told to
visitors is a question the museum leaves open, printed in small letters on the last panel before the exit.
The museum keeps one more document that visitors rarely ask about: the ferry ledger. From 1922 until the bridge
opened in 1964, a flat-bottomed ferry crossed the western river twelve times a day in summer and eight in winter.
The ferryman wrote every crossing in a ledger ruled into seven columns: the date, the hour, the number of foot
passengers, bicycles, carts, motor cars and a last column headed simply "other". Over forty-two years that column
recorded, among other things, a piano, two cows that refused to stand still, a coffin with its mourners, a
travelling dentist and his chair, and on 3 March 1947 a rowing eight that had lost its way in the fog.

The fares changed only four times. A foot passenger paid a penny until 1931, then three halfpence; a car paid
sixpence, later a shilling. Children under seven crossed free if they could prove their age, which in practice
meant that nobody under ten ever paid. The ledger shows the busiest single day as 14 August 1953, the day of the
county show, with 1,208 foot passengers and 96 cars carried in thirty-one crossings, several of them after dark.
The quietest full day, 19 January 1940, carried a single passenger, the postman, who went over and came back.

When engineers first proposed the bridge in 1956, the town divided almost evenly. A petition against it gathered
2,141 signatures, one in favour 2,087, and the parish council, unable to agree, sent both to the county with a
covering letter that managed to say nothing at all. The bridge was built anyway, a little downstream of the
crossing, with three spans of pre-stressed concrete and a footway on the seaward side. The ferryman, Harold
Penwarden, was given a job as its first toll keeper and kept the same hours he had kept on the water.

A small weather station stands beside the old ferry slip. It was installed by a retired teacher in 1958 and has
been read every morning at nine o'clock ever since, first by her, then by a rota of volunteers who keep the
records in a blue binder in the bakery. The instruments are simple: a rain gauge, a pair of thermometers in a
white louvred box, a wind vane and a tide board painted in tenths of a metre. From these the volunteers have
built one of the longest unbroken local records in the region, more than 24,000 daily entries without a gap.

The numbers show what everyone in Calloway already suspected. The wettest month on record is November 1960,
with 231 millimetres of rain; the driest is June 1976, with two. The highest tide, in February 1990, reached 7.4
metres on the board and flooded the lower quay to the depth of a boot. Since 1960 the average temperature at the
nine o'clock reading has risen by a little over one degree, and the number of mornings with frost has fallen from
about thirty a year to fewer than twelve. None of this is dramatic on any single day, which is exactly why the
binder matters: change that is too slow to notice can still be counted.

Counting, in fact, is what holds the museum's collection together. The rope, the ledgers, the register and the
binder are all, in their way, instruments for noticing what would otherwise slip past. A visitor who reads the
panels in order will meet the same idea four times, in different clothes: someone in the town decided to write
down a small thing every day, kept doing it long after the reason was forgotten, and left a record that later
people could question in ways the writer never imagined.

Restoring a boat in the workshop follows a rhythm the volunteers describe without much ceremony. First the hull
is surveyed and every plank is numbered with chalk, port side in odd numbers and starboard in even. Then the
damaged planks are taken off one at a time, never two neighbours together, so the shape of the hull is held by
what remains. Each new plank is steamed for an hour per inch of thickness, bent over the frames while it is
still hot, and fastened with copper nails that are clenched over small washers called roves. A dinghy of four
metres takes about three hundred hours of work; a pilot gig of ten metres took the volunteers almost two years.

The oldest boat in the shed is a crabber built in 1898, its transom carved with the initials of a man whose
descendants still live on the eastern bank. When it arrived for restoration in 2011, only the keel and eleven of
its frames could be kept. The volunteers argued for a whole winter about whether the result would still be the
same boat. They settled the matter, in the end, by agreeing that it did not matter: the boat would be launched
under its old name, and anyone who wanted to debate its identity was welcome to do so while rowing it.

It was launched on a Saturday in May 2014, at the top of a spring tide, with a crowd of about four hundred on
the quay and a brass band that knew only three tunes. It floated, leaked a little for a week until the planks
swelled, and has been rowed in every regatta since. Its crew won the second class in 2016 and came last in 2017,
and both results are recorded, with equal pride, on a small board beside the workshop door.

Visitors who stay until closing sometimes see the last ritual of the day. At five o'clock one of the volunteers
walks the length of the ropewalk with a lamp, checks that the stove in the workshop is out, writes the number of
visitors in yet another ledger, and locks the door with a key that is older than the bridge. The number is
rarely large. On an ordinary weekday in spring it might be forty; on a wet Tuesday in February it has been three.
But it is written down every time, and the volunteers say that this, more than anything on the panels, is the
part of the town's history they are still making.
"""


# ---- windows ------------------------------------------------------------------------------------------------


def kl_text(data_dir: str | os.PathLike[str] | None, task: str = "kl") -> tuple[str, str]:
    """(text, source label): WikiText-2 test from --data-dir, else the embedded text. `task` names the task that
    reads it in errors (kl, or passkey's filler)."""
    if data_dir is None:
        return EMBEDDED_TEXT, "embedded"
    path = Path(data_dir) / KL_TEXT_FILE
    if not path.is_file():
        raise UsageError(
            f"task '{task}' needs '{path}', which is missing from --data-dir; lay the folder out like ../shared/data"
        )
    return read_text_file(path, f"task '{task}'"), "wikitext2-test"


def bos_rule(tokenizer: Any) -> dict[str, Any]:
    """{"bos_token_id": the id each window starts with, or None; "rule": why} — the tokenizer's own rule."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return {"bos_token_id": None, "rule": "the tokenizer has no BOS token"}
    ids = tokenizer("x")["input_ids"]
    if ids and ids[0] == bos:
        return {"bos_token_id": bos, "rule": "the tokenizer adds BOS (tokenizer('x') starts with it)"}
    if getattr(tokenizer, "add_bos_token", False):
        return {"bos_token_id": bos, "rule": "the tokenizer adds BOS (add_bos_token)"}
    return {"bos_token_id": None, "rule": "the tokenizer has a BOS token but does not add it"}


def make_windows(
    tokenizer: Any, text: str, seq_len: int, limit: int | None, bos: int | None
) -> tuple[list[list[int]], int]:
    """Non-overlapping windows of `seq_len` tokens, each starting with `bos` when it is not None (see bos_rule).
    Returns (windows[:limit], number of windows in the whole text)."""
    if seq_len < 2:
        raise UsageError("the kl window length must be at least 2 tokens")
    ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
    body = seq_len - 1 if bos is not None else seq_len
    windows = []
    for start in range(0, len(ids) - body + 1, body):
        chunk = ids[start : start + body]
        windows.append(([bos] if bos is not None else []) + chunk)
    if not windows:
        raise UsageError(
            f"the kl text has {len(ids)} tokens, fewer than one window of {seq_len}; use a smaller --kl-seq-len "
            "or --data-dir with WikiText-2"
        )
    total = len(windows)
    return (windows[:limit] if limit else windows), total


# ---- baseline cache -----------------------------------------------------------------------------------------


def cache_root() -> Path:
    return kvcal_cache_root() / "kl"


def model_fingerprint(model_dir: str | os.PathLike[str]) -> str:
    """sha256 over config.json and every weight file (full content hashes, memoised by path+size+mtime)."""
    root = Path(model_dir)
    files = (
        sorted(
            p
            for p in root.iterdir()
            if p.name == "config.json" or p.suffix in (".safetensors", ".bin", ".gguf")
        )
        if root.is_dir()
        else []
    )
    if not files:
        raise KvcalError(f"cannot fingerprint model folder '{root}' (no config.json / weight files)")
    h = hashlib.sha256()
    for p, (digest, _hit) in zip(files, cached_sha256(files), strict=True):
        h.update(f"{p.name}:{digest}\n".encode())
    return h.hexdigest()


def window_key(fingerprint: str, baseline: dict[str, Any], bos: dict[str, Any], window: list[int]) -> str:
    ids = hashlib.sha256(json.dumps(window).encode()).hexdigest()
    blob = json.dumps(
        {"v": KL_VERSION, "model": fingerprint, "baseline": baseline, "bos": bos, "ids": ids}, sort_keys=True
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def _fp16_logprobs(logits: torch.Tensor) -> torch.Tensor:
    # logits: [T, V] -> log-probs [T, V] float16 (clamped: a -inf logit would not survive the rounding)
    return torch.log_softmax(logits.float(), dim=-1).clamp_min(-60000.0).to(torch.float16)


def _renorm(lp16: torch.Tensor) -> torch.Tensor:
    lp = lp16.float()
    return lp - torch.logsumexp(lp, dim=-1, keepdim=True)


def _cache_path(root: Path, key: str) -> Path:
    return root / key[:2] / f"{key}.safetensors"


def store_baseline(key: str, logits: torch.Tensor, root: Path) -> torch.Tensor:
    """Write the float16 log-probs [T, V] of baseline logits [T, V] (atomically) and return them."""
    from safetensors.torch import save_file

    lp16 = _fp16_logprobs(logits).contiguous()
    atomic_write_with(_cache_path(root, key), lambda tmp: save_file({"logprobs": lp16}, str(tmp)))
    return lp16


def load_baseline(key: str, root: Path, recompute: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Cached float16 log-probs [T, V]; a damaged entry is recomputed (never trusted)."""
    from safetensors.torch import load_file

    try:
        return load_file(str(_cache_path(root, key)))["logprobs"]
    except Exception:
        return store_baseline(key, recompute(), root)


def baseline_logits_again(baseline: Baseline, ids: torch.Tensor) -> torch.Tensor:
    with baseline() as new_session, torch.no_grad():
        return new_session()(ids)[0].detach().cpu()


def forward_session(model: Any, cache: Any) -> ChunkForward:
    """A session over one window: each call runs one forward of the next chunk with `cache` as past_key_values
    (the chunk attends to everything the cache holds, then appends its own K/V). `keep`: indices into the chunk
    of the rows whose logits are wanted (transformers' `logits_to_keep`); None = all."""

    def forward(
        ids: torch.Tensor,
        keep: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [B, c] -> [B, c|k, V]
        # attention_mask [B, past + c] (2-D, 1 = real token) and position_ids [B, c]: a padded batch's
        # (kvcal.evaluate.divergence); None = one unpadded sequence, positions from the cache
        extra: dict[str, Any] = {} if keep is None else {"logits_to_keep": keep}
        if attention_mask is not None:
            extra["attention_mask"] = attention_mask
        if position_ids is not None:
            extra["position_ids"] = position_ids
        with torch.no_grad():
            return model(ids, past_key_values=cache, use_cache=True, **extra).logits

    return forward


def lm_sides(lm: Any, impl: str) -> tuple[SessionFactory, Baseline]:
    """(quant_session, baseline) of kvcal's lm-eval model `lm` (`kvcal.evaluate.adapter.KvcalLM`: .model,
    .runtime, .activate_runtime()). The evaluated side: `lm`'s own configuration (a fresh kvcal cache, or for
    'auto' a transformers DynamicCache). The baseline: a BF16 cache read through kvcal's attention with `impl`.
    When the evaluated side already reads through kvcal's attention with the same implementation and plain
    (not FP8) attention, the baseline is a second cache of BF16 plans under that same attention (what
    `KVRuntime(model, "bf16")` would install, so nothing is swapped); otherwise (auto, FP8 attention)
    baseline() installs a BF16 KVRuntime and re-activates `lm`'s on exit."""
    from transformers.cache_utils import DynamicCache

    from kvcal.formats import get_format
    from kvcal.kernels.cache import LayerPlan, QuantizedKVCache
    from kvcal.kernels.plan import CachePlan
    from kvcal.kernels.runtime import KVRuntime, resolve_impl

    model = lm.model

    def quant_session() -> ChunkForward:
        rt = lm.runtime
        return forward_session(model, rt.new_cache() if rt is not None else DynamicCache(config=model.config))

    rt = lm.runtime
    bf16 = get_format("bf16")
    # FP8 attention (a plan's q_scale) is read from the attention module's plan, not from the cache: swap then
    if (
        rt is not None
        and rt.impl == resolve_impl(impl, next(model.parameters()).device)
        and all(getattr(p, "q_scale", None) is None for p in rt.plans)
    ):
        plans = [LayerPlan(index=p.index, fmt=bf16, window=p.window) for p in rt.plans]

        @contextmanager
        def beside() -> Iterator[SessionFactory]:
            yield lambda: forward_session(model, QuantizedKVCache(plans))

        # `-f bf16` evaluates the baseline itself: the same forwards, bit for bit (chunked windows run it once) —
        # unless a prefix serde (LMCache's storage tier) changes the evaluated run's first tokens
        beside.same_as_evaluated = all(  # type: ignore[attr-defined]
            p.side_format(w).name == bf16.name and p.prefix_serde is None for p in rt.plans for w in ("k", "v")
        )
        return quant_session, beside

    @contextmanager
    def installed() -> Iterator[SessionFactory]:
        # replaces the evaluated configuration for a moment
        rt = KVRuntime.from_plan(model, CachePlan(k_fmt=bf16, v_fmt=bf16, impl=impl))
        try:
            yield lambda: forward_session(model, rt.new_cache())
        finally:
            lm.activate_runtime()

    return quant_session, installed


# ---- per-token statistics -----------------------------------------------------------------------------------


def kl_per_token(ref_logprobs: torch.Tensor, q_logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(ref || q) in nats and top-1 agreement (1.0 / 0.0) at every position, from normalised log-probabilities
    [..., V] of the reference and the quantized run -> two [...] tensors."""
    kl = (ref_logprobs.exp() * (ref_logprobs - q_logprobs)).sum(-1)
    agree = (ref_logprobs.argmax(-1) == q_logprobs.argmax(-1)).float()
    return kl, agree


def _row_blocks(n: int, vocab: int) -> range:
    return range(0, n, max(1, _STATS_BUDGET // max(1, vocab)))


def _fp16_logprobs_blocked(logits: torch.Tensor) -> torch.Tensor:
    """_fp16_logprobs of logits [n, V], a block of rows at a time (row-wise identical; float32 temporaries of one
    block instead of three [n, V] copies)."""
    out = torch.empty(logits.shape, dtype=torch.float16, device=logits.device)
    blocks = _row_blocks(logits.shape[0], logits.shape[-1])
    for r0 in blocks:
        out[r0 : r0 + blocks.step] = _fp16_logprobs(logits[r0 : r0 + blocks.step])
    return out


def token_stats(
    base_lp16: torch.Tensor, quant_logits: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per position: KL(baseline || quantized) (clamped at 0: tiny negatives are rounding), top-1 agreement and
    the quantized side's NLL of the target. base_lp16: float16 log-probs [n, V]; quant_logits: [n, V]; targets:
    [n] next-token ids -> three float32 [n] tensors. Row blocks keep the float32 temporaries near 4 MiB."""
    kls, agrees, nlls = [], [], []
    n = base_lp16.shape[0]
    if n == 0:  # a chunk with no scored position (--kl-subsample longer than the chunk)
        return torch.zeros(0), torch.zeros(0), torch.zeros(0)
    targets = targets.to(device=quant_logits.device, dtype=torch.long)
    blocks = _row_blocks(n, base_lp16.shape[-1])
    for r0 in blocks:
        r1 = min(n, r0 + blocks.step)
        lp = _renorm(base_lp16[r0:r1].to(quant_logits.device))  # [rows, V]
        lq = _renorm(_fp16_logprobs(quant_logits[r0:r1]))  # [rows, V]
        kl, agree = kl_per_token(lp, lq)
        kls.append(kl.clamp_min(0.0))
        agrees.append(agree)
        nlls.append(-lq.gather(-1, targets[r0:r1, None]).squeeze(-1))
    return torch.cat(kls).cpu(), torch.cat(agrees).cpu(), torch.cat(nlls).cpu()


def window_totals(kl: torch.Tensor, agree: torch.Tensor, nll: torch.Tensor) -> dict[str, float]:
    """A window's sample record from its per-position [T-1] statistics: mean KL, mean top-1, summed NLL."""
    return {
        "kl": float(kl.mean()),
        "top1_agree": float(agree.mean()),
        "nll": float(nll.sum()),
        "n_tokens": int(kl.numel()),
    }


def window_stats(base_lp16: torch.Tensor, quant_logits: torch.Tensor, window: list[int]) -> dict[str, float]:
    """Per-window KL / top-1 / NLL over the positions that have a next token (T-1 of them); base_lp16 [T, V],
    quant_logits [T, V]."""
    targets = torch.tensor(window[1:], dtype=torch.long)
    return window_totals(*token_stats(base_lp16[:-1], quant_logits[:-1], targets))


# ---- position buckets (kl_by_position) ----------------------------------------------------------------------

_BUCKET_METRICS = ("kl", "top1_agree", "nll")


def position_buckets(n_pred: int) -> list[tuple[int, int]]:
    """[lo, hi] (inclusive, 1-based positions of the predicting token) for positions 1..n_pred: [1, 512],
    [513, 1024], [1025, 2048], ..., the last one cut at n_pred."""
    edges, lo, hi = [], 1, FIRST_BUCKET
    while lo <= n_pred:
        edges.append((lo, min(hi, n_pred)))
        lo, hi = hi + 1, hi * 2
    return edges


def scored_positions(n_pred: int, subsample: int) -> torch.Tensor:
    """0-based positions (of the predicting token) a window scores: 0, N, 2N, ... below n_pred. [n_scored]"""
    return torch.arange(0, n_pred, subsample)


def check_kl_subsample(n: int) -> int:
    if n < 1 or n > MAX_SUBSAMPLE or n & (n - 1):
        raise UsageError(
            f"--kl-subsample must be a power of two from 1 to {MAX_SUBSAMPLE} (so every position bucket keeps its "
            f"first position), got {n}"
        )
    return n


def window_buckets(
    stats: tuple[torch.Tensor, torch.Tensor, torch.Tensor], edges: list[tuple[int, int]], subsample: int = 1
) -> dict[str, list[float]]:
    """One window's bucket means {metric: [one per bucket]} from its per-position (kl, top1, nll) at the scored
    positions (`scored_positions`: all T-1 when subsample is 1)."""
    out: dict[str, list[float]] = {m: [] for m in _BUCKET_METRICS}
    rows = _bucket_rows(edges, subsample)
    for name, values in zip(_BUCKET_METRICS, stats, strict=True):
        v = values.double()
        out[name] = [float(v[r0:r1].mean()) for r0, r1 in rows]
    return out


def _bucket_rows(edges: list[tuple[int, int]], subsample: int) -> list[tuple[int, int]]:
    """[r0, r1) of the scored rows in each bucket: scored row r is 0-based position r * subsample, so bucket
    [lo, hi] (1-based) holds rows ceil((lo - 1) / N) .. floor((hi - 1) / N)."""
    return [(-(-(lo - 1) // subsample), (hi - 1) // subsample + 1) for lo, hi in edges]


def bucket_tokens(edges: list[tuple[int, int]], subsample: int = 1) -> list[int]:
    """Scored positions per bucket of one window."""
    return [r1 - r0 for r0, r1 in _bucket_rows(edges, subsample)]


def mean_stderr(values: list[float]) -> float | None:
    """Standard error of the mean of `values` (None below two)."""
    n = len(values)
    if n < 2:
        return None
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def by_position(
    per_window: list[dict[str, list[float]]],
    edges: list[tuple[int, int]],
    seq_len: int,
    chunk: int,
    subsample: int = 1,
) -> dict[str, Any]:
    """results.json's `kl_by_position` (docs/run-directory.md): per bucket the token-weighted mean over windows
    (every window has the same positions) and the standard error over windows."""
    buckets = []
    for b, ((lo, hi), n) in enumerate(zip(edges, bucket_tokens(edges, subsample), strict=True)):
        entry: dict[str, Any] = {"lo": lo, "hi": hi, "n_tokens": n * len(per_window)}
        for m in _BUCKET_METRICS:
            vals = [w[m][b] for w in per_window]
            entry[m] = sum(vals) / len(vals)
            entry[f"{m}_stderr"] = mean_stderr(vals)
        entry["per_window"] = {m: [w[m][b] for w in per_window] for m in _BUCKET_METRICS}
        buckets.append(entry)
    out = {"seq_len": seq_len, "prefill_chunk": chunk, "n_windows": len(per_window), "buckets": buckets}
    if subsample > 1:
        out["subsample"] = subsample
    return out


# ---- the task -----------------------------------------------------------------------------------------------


def aggregate(samples: list[dict[str, Any]]) -> dict[str, float]:
    """Token-weighted means; stderr from the spread of the per-window values (windows are the samples)."""
    tokens = sum(s["n_tokens"] for s in samples)
    kl = sum(s["kl"] * s["n_tokens"] for s in samples) / tokens
    top1 = sum(s["top1_agree"] * s["n_tokens"] for s in samples) / tokens
    ppl = math.exp(sum(s["nll"] for s in samples) / tokens)

    def stderr(key: str) -> float | str:
        se = mean_stderr([s[key] for s in samples])
        return "N/A" if se is None else se

    return {
        "kl,none": kl,
        "kl_stderr,none": stderr("kl"),
        "top1_agree,none": top1,
        "top1_agree_stderr,none": stderr("top1_agree"),
        "ppl,none": ppl,
        "ppl_stderr,none": "N/A",
    }


def check_prefill_chunk(chunk: int) -> int:
    if chunk < 1:
        raise UsageError(f"--prefill-chunk must be at least 1 token, got {chunk}")
    return chunk


def run_kl(
    model: Any,
    tokenizer: Any,
    *,
    quant_session: SessionFactory,
    baseline: Baseline,
    baseline_desc: dict[str, Any],
    evaluated_desc: dict[str, Any],
    model_dir: str | os.PathLike[str],
    data_dir: str | os.PathLike[str] | None,
    limit: int | None,
    seq_len: int = DEFAULT_SEQ_LEN,
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    subsample: int = 1,
    cache_dir: Path | None = None,
    progress: Callable[[int, int], None] | None = None,
    dist: parallel.Dist | None = None,
) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """Evaluate `kl`. `quant_session()`: a fresh session of the evaluated configuration (the one installed on
    the model); `baseline()`: see `Baseline`. A window that fits one chunk (seq_len <= prefill_chunk) runs in one
    forward per side, against the disk-cached baseline (missing ones are computed first, in one baseline()
    entry); a longer window runs both sides in lockstep, chunk by chunk (module docstring).
    `baseline_desc` / `evaluated_desc` describe the two sides (the baseline's is part of the cache key).
    Returns (an lm-eval-shaped results dict for task 'kl' with `kl_by_position`, per-window sample records).
    With `dist` (several processes) each rank runs windows rank, rank + N, ... and rank 0 returns the whole
    task (windows back in order, so the results equal one process's); the other ranks return (None, []).
    `subsample`: score positions 0, N, 2N, ... only (module docstring)."""
    check_prefill_chunk(prefill_chunk)
    check_kl_subsample(subsample)
    root = cache_dir or cache_root()
    text, source = kl_text(data_dir)
    bos = bos_rule(tokenizer)
    windows, total = make_windows(tokenizer, text, seq_len, limit, bos["bos_token_id"])
    device = input_device(model)  # under a device map: the embedding's device
    dist = dist or parallel.Dist()
    parallel.check_enough_work(len(windows), "kl windows", dist)
    mine = parallel.shard(range(len(windows)), dist)
    chunked = seq_len > prefill_chunk
    if chunked:
        hits = 0

        def stats_of(i: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return lockstep_stats(quant_session, baseline, ids, prefill_chunk, subsample)

    else:
        fingerprint = model_fingerprint(model_dir)
        keys = [window_key(fingerprint, baseline_desc, bos, w) for w in windows]
        missing = [i for i in mine if not _cache_path(root, keys[i]).is_file()]
        _store_missing_baselines(baseline, windows, keys, missing, root, device)
        hits = len(mine) - len(missing)

        def stats_of(i: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return cached_stats(quant_session, baseline, ids, keys[i], root, subsample)

    edges = position_buckets(seq_len - 1)
    samples: list[dict[str, Any]] = []
    per_window: list[dict[str, list[float]]] = []
    for n, i in enumerate(mine):
        stats = stats_of(i, torch.tensor([windows[i]], dtype=torch.long, device=device))  # ids [1, T]
        samples.append({"doc_id": i, **window_totals(*stats)})
        per_window.append(window_buckets(stats, edges, subsample))
        parallel.fault_point("kl-window", dist)
        if progress is not None:
            progress(n + 1, len(mine))
    merged = _gather_windows(samples, per_window, hits, dist)
    if merged is None:
        return None, []  # rank 0 holds the task
    samples, per_window, hits = merged
    task_config = {
        "task": "kl",
        "output_type": "kvcal_kl",
        "text_source": source,
        "seq_len": seq_len,
        "bos": bos,
        "baseline": baseline_desc,
        "evaluated": evaluated_desc,
        "baseline_cache_hits": hits,
    }
    if subsample > 1:
        task_config["subsample"] = subsample
    if chunked:
        task_config["prefill_chunk"] = prefill_chunk
        task_config["baseline_cache"] = "none: chunked windows run the baseline in lockstep"
    results = _kl_results(aggregate(samples), task_config, total, len(windows))
    results["kl_by_position"] = by_position(
        per_window, edges, seq_len, min(seq_len, prefill_chunk), subsample
    )
    return results, samples


def _gather_windows(
    samples: list[dict[str, Any]], per_window: list[dict[str, list[float]]], hits: int, dist: parallel.Dist
) -> tuple[list[dict[str, Any]], list[dict[str, list[float]]], int] | None:
    """Every rank's windows on rank 0, in window order (None on the other ranks)."""
    parts = parallel.gather_objects((samples, per_window, hits), dist, what="gathering the kl windows")
    if parts is None:
        return None
    rows = sorted(
        ((s, w) for part in parts for s, w in zip(part[0], part[1], strict=True)),
        key=lambda r: r[0]["doc_id"],
    )
    return [s for s, _ in rows], [w for _, w in rows], sum(part[2] for part in parts)


def cached_stats(
    quant_session: SessionFactory,
    baseline: Baseline,
    ids: torch.Tensor,
    key: str,
    root: Path,
    subsample: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-position statistics [T-1] (or at the scored positions) of a window that fits one chunk: one quantized
    forward over ids [1, T], against the disk-cached baseline (all T positions: the cache key knows no subsample)."""
    n_pred = ids.shape[1] - 1
    with torch.no_grad():
        if subsample == 1:
            quant_logits = quant_session()(ids)[0, :-1].detach().cpu()  # [T-1, V]
        else:
            pos = scored_positions(n_pred, subsample)
            quant_logits = quant_session()(ids, pos.to(ids.device))[0].detach().cpu()  # [n_scored, V]
    base_lp16 = load_baseline(key, root, lambda: baseline_logits_again(baseline, ids))  # [T, V]
    if subsample == 1:
        return token_stats(base_lp16[:-1], quant_logits, ids[0, 1:].cpu())
    return token_stats(base_lp16[pos], quant_logits, ids[0, 1:].cpu()[pos])


def lockstep_stats(
    quant_session: SessionFactory, baseline: Baseline, ids: torch.Tensor, chunk: int, subsample: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-position statistics [T-1] (or at the scored positions, `subsample`) of a window by chunked prefill:
    both sides get the same chunks in order, each through its own cache; only one chunk's logits per side exist
    at a time. The window's last token predicts nothing, so the chunks cover tokens 0..T-2."""
    n_pred = ids.shape[1] - 1
    quant = quant_session()
    same = getattr(baseline, "same_as_evaluated", False)  # the evaluated side IS the baseline (lm_sides)
    base: ChunkForward | None = None
    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for s in range(0, n_pred, chunk):
        piece = ids[:, s : min(n_pred, s + chunk)]  # [1, c]
        # rows scored in this chunk: None = all c; else chunk-local indices of positions 0, N, 2N, ...
        first = -s % subsample
        keep = None if subsample == 1 else torch.arange(first, max(first, piece.shape[1]), subsample)
        args = (piece,) if keep is None else (piece, keep.to(ids.device))
        if same:
            q_logits = quant(*args)[0]  # [c | k, V]
            base_lp16 = _fp16_logprobs_blocked(q_logits)
        else:
            with baseline() as new_session:
                base = base or new_session()
                base_lp16 = _fp16_logprobs_blocked(base(*args)[0])  # [c | k, V]
            q_logits = quant(*args)[0]
        targets = ids[0, s + 1 : s + 1 + piece.shape[1]]
        parts.append(token_stats(base_lp16, q_logits, targets if keep is None else targets[args[1]]))
        del base_lp16, q_logits
    return tuple(torch.cat(p) for p in zip(*parts, strict=True))  # type: ignore[return-value]


def _store_missing_baselines(
    baseline: Baseline,
    windows: list[list[int]],
    keys: list[str],
    missing: list[int],
    root: Path,
    device: torch.device,
) -> None:
    """Compute and cache the baseline log-probs of the windows `missing` (one baseline entry for all)."""
    if not missing:
        return
    try:
        root.mkdir(parents=True, exist_ok=True)
        with baseline() as new_session, torch.no_grad():
            for i in missing:
                ids = torch.tensor([windows[i]], dtype=torch.long, device=device)  # [1, T]
                store_baseline(keys[i], new_session()(ids)[0].detach().cpu(), root)
    except OSError as exc:  # the cache folder (the forward itself does no I/O)
        raise UsageError(
            f"cannot write kl's baseline cache under '{root}' ({exc.strerror or exc}); "
            "set KVCAL_CACHE to a writable folder"
        ) from exc


def _kl_results(
    metrics: dict[str, Any], task_config: dict[str, Any], total: int, effective: int
) -> dict[str, Any]:
    """lm-eval's results-dict shape for task 'kl'."""
    return {
        "results": {"kl": {"alias": "kl", **metrics}},
        "configs": {
            "kl": {
                **task_config,
                "metric_list": [
                    {"metric": "kl", "higher_is_better": False},
                    {"metric": "top1_agree", "higher_is_better": True},
                    {"metric": "ppl", "higher_is_better": False},
                ],
                "metadata": {"version": KL_VERSION},
            }
        },
        "versions": {"kl": KL_VERSION},
        "n-shot": {"kl": 0},
        "higher_is_better": {"kl": {"kl": False, "top1_agree": True, "ppl": False}},
        "n-samples": {"kl": {"original": total, "effective": effective}},
    }
