"""Sampling on the device: token rules (allowed ids, bad words, min_tokens, logit bias), penalties,
temperature, top-k, top-p, min-p, greedy, per-request random streams, top-n logprobs; one batched pass
where the logits are, and one small copy to the host.

What a row samples from (`process_logits`, in vLLM's order): allowed_token_ids, bad_words, min_tokens (a
request's stop tokens at -inf until it has that many outputs), logit_bias, then the penalties: repetition
over prompt and output tokens, frequency and presence over the output. Logprobs stay those of the raw
distribution.

The filters keep a row's tokens in rank order (temperature-scaled logit descending): top-k the first k, top-p
while the mass before a token (over the top k's, else the row's) is < top_p, min-p those with p >= min_p * p_max.
A sampled row draws by inverse CDF with one uniform: weights w = exp(x - max) over its kept tokens in token-id
order, float64 prefix sums, the first token whose sum exceeds u * total. The uniform is Philox(request seed,
position of the token, purpose) (engine/philox.py), so a seeded request's tokens depend only on its seed,
positions and logits. `target_weights` + `inverse_cdf` is the dense twin speculative decoding uses; it picks the
same token from the same uniform.

Neither way sorts the vocabulary when it need not. On the CPU one kernel does a row's filters and draw
(engine/sampler_cpu.cpp: the kept set from a histogram of w by exponent, sorting only where a cut falls; ties
in rank by token id), and the dense twin comes from the same kernel. Elsewhere (CUDA) torch finds a row's kept set
inside its K largest logits (`torch.topk`), K = its top_k, or a candidate set (256, then 4096) for top-p / min-p
rows, enough whenever those candidates already reach top_p (or already fall below min_p * p_max); a row the
candidates do not cover takes the full sort. Both torch ways run the same cut (`_cut`). In either
implementation a row's kept set depends on its logits and parameters alone, not on the batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine import cpu_model
from engine.philox import DRAFT, SAMPLE, as_seed, uniforms
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.sequence import Sequence


# candidate-set sizes tried, in turn, for top-p / min-p rows without top-k; then the full sort
_CANDIDATES = (256, 4096)
# prompt logprobs are taken this many rows at a time (a float32 [rows, vocab] each: 50 MB for 49k tokens)
_PROMPT_ROWS = 256


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]     # per row: {token: logprob} incl. the sampled one


@dataclass
class _RowGroup:
    """A group of logits rows filtered alike. ids None: whole rows in vocabulary order, nothing filtered (vals = the row).
    Otherwise ids [r, K]: each row's K largest logits (vals, descending), of which keep says which
    survive the filters; every token outside ids is filtered."""
    rows: list[int]
    vals: torch.Tensor
    ids: torch.Tensor | None = None
    keep: torch.Tensor | None = None


def _temperatures(params: list[SamplingParams], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Each row's temperature (1 for greedy rows: their filters are taken at the logits as they are)."""
    return torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], dtype=dtype, device=device)


def _scale(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    return logits / _temperatures(params, logits.dtype, logits.device).unsqueeze(1)


def _top_k(p: SamplingParams, vocab: int) -> int:
    return p.top_k if 0 < p.top_k < vocab else 0      # top_k >= vocab keeps everything: off


def _filters(p: SamplingParams, vocab: int) -> bool:
    return _top_k(p, vocab) > 0 or p.top_p < 1.0 or p.min_p > 0


def _native(logits: torch.Tensor):
    """The CPU kernels (engine/sampler_cpu.cpp) for float32 logits on the CPU, or None: torch's way."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or not cpu_model.sampler_enabled() \
            or not cpu_model.available():
        return None
    return cpu_model.kernels()


def _native_rows(kernels, logits: torch.Tensor, params: list[SamplingParams], u: torch.Tensor | None,
                 dense: bool) -> list[torch.Tensor]:
    """sample_rows over raw (unscaled) logits: (tokens if u, dense weights and keep mask if dense)."""
    vocab = logits.shape[1]
    temps = _temperatures(params, torch.float32, logits.device)
    ks = torch.tensor([_top_k(p, vocab) for p in params], dtype=torch.int64)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64)
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float64)
    x = logits if logits.stride(1) == 1 else logits.contiguous()
    return kernels.sample_rows(x, temps, ks, top_p, min_p, None if u is None else u.to(torch.float64).contiguous(),
                               dense)


def _take(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t[rows] for ascending distinct rows, without a copy when that is all of t."""
    return t if len(rows) == t.shape[0] else t[rows]


def _row_groups(logits: torch.Tensor, params: list[SamplingParams]) -> list[_RowGroup]:
    """logits: temperature-scaled [R, V]. Splits the rows into groups whose kept sets are known."""
    vocab = logits.shape[-1]
    plain = [i for i, p in enumerate(params) if not _filters(p, vocab)]
    groups = [_RowGroup(plain, _take(logits, plain))] if plain else []
    pending = [i for i, p in enumerate(params) if _filters(p, vocab)]
    if not pending:
        return groups
    x, sub = _take(logits, pending), [params[i] for i in pending]
    ks = [_top_k(p, vocab) for p in sub]
    first = max(max(ks), _CANDIDATES[0]) if min(ks) == 0 else max(ks)
    sizes = [k for k in (first, *(c for c in _CANDIDATES[1:] if c > first)) if 2 * k < vocab]
    live = list(range(len(pending)))                        # rows of x not yet covered
    s_full = None
    for size in sizes + [vocab]:
        xl = _take(x, live)
        if size == vocab:                                   # the full sort: covers every row
            vals, ids = xl.sort(dim=-1, descending=True)
        else:
            vals, ids = xl.topk(size, dim=-1)
        if s_full is None:      # the normalizer of a top-p row without top-k: sum of exp(x - max), float64
            s_full = torch.zeros(len(pending), dtype=torch.float64, device=x.device)
            need = [j for j, (k, p) in enumerate(zip(ks, sub)) if k == 0 and p.top_p < 1.0]
            if need:
                s_full[need] = (_take(x, need) - vals[need, :1]).exp_().sum(-1, dtype=torch.float64)
        keep, covered = _cut(vals, [sub[j] for j in live], s_full[live], vocab)
        done = covered.nonzero().squeeze(1)
        if len(done) == len(live):
            groups.append(_RowGroup([pending[j] for j in live], vals, ids, keep))
            return groups
        if len(done):
            groups.append(_RowGroup([pending[live[j]] for j in done.tolist()], vals[done], ids[done], keep[done]))
        live = [j for j, c in zip(live, covered.tolist()) if not c]
    raise AssertionError("unreachable: the full sort covers every row")


def _cut(vals: torch.Tensor, params: list[SamplingParams], s_full: torch.Tensor,
         vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The filters on each row's K largest temperature-scaled logits `vals` [R, K] (descending).

    top-k keeps the first top_k; top-p then keeps a token while the mass before it, in the top-k
    renormalized distribution (the full one without top-k), is < top_p; min-p drops tokens with
    p < min_p * p_max. With w = exp(x - max): p_max = 1 / s, so min-p is w < min_p, and top-p is
    (w's prefix sum before the token) / s >= top_p, s = sum of w over the top-k (or the row, s_full).
    Returns keep [R, K] and covered [R]: whether every token after the K is filtered too.
    """
    rows, size = vals.shape
    dev = vals.device
    w = (vals - vals[:, :1]).exp().double()
    csum = w.cumsum(-1)
    before = torch.cat([torch.zeros(rows, 1, dtype=csum.dtype, device=dev), csum[:, :-1]], dim=1)
    ks = torch.tensor([_top_k(p, vocab) for p in params], device=dev)
    has_k = ks > 0
    s = torch.where(has_k, csum.gather(1, (ks - 1).clamp(0, size - 1).unsqueeze(1)).squeeze(1), s_full)
    has_p = torch.tensor([p.top_p < 1.0 for p in params], device=dev)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64, device=dev)
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float64, device=dev)
    ranks = torch.arange(size, device=dev)
    drop = has_k.unsqueeze(1) & (ranks >= ks.unsqueeze(1))
    drop |= has_p.unsqueeze(1) & (before / s.unsqueeze(1) >= top_p.unsqueeze(1))
    drop |= w < min_p.unsqueeze(1)
    drop[:, 0] = False
    covered = has_k | (size == vocab)
    covered |= has_p & (csum[:, -1] / s >= top_p)            # the token after the K is cut by top-p
    covered |= w[:, -1] < min_p                              # ... or by min-p, as are all after it
    return ~drop, covered


def apply_filters(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature-scaled logits with top-k / top-p / min-p applied (filtered entries at -inf)."""
    kernels = _native(logits)
    if kernels is not None:
        keep = _native_rows(kernels, logits, params, None, True)[2]
        return _scale(logits, params).masked_fill_(~keep, float("-inf"))
    logits = _scale(logits, params)
    out = torch.full_like(logits, float("-inf"))
    for g in _row_groups(logits, params):
        if g.ids is None:
            out[g.rows] = g.vals
        else:
            out[g.rows] = out[g.rows].scatter_(-1, g.ids, g.vals.masked_fill(~g.keep, float("-inf")))
    return out


def target_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    return apply_filters(logits, params).softmax(-1)


def target_weights(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """exp(x - max) of the filtered logits (0 where filtered): the unnormalized distribution a row
    samples from, bit for bit the weights the sparse draw uses."""
    kernels = _native(logits)
    if kernels is not None:
        return _native_rows(kernels, logits, params, None, True)[1]
    x = apply_filters(logits, params)
    return (x - x.max(-1, keepdim=True).values).exp_()


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first column whose float64 prefix sum of weights (>= 0) exceeds u * total: column
    i with probability w_i / total, never a zero-weight one."""
    csum = weights.cumsum(-1, dtype=torch.float64)
    target = (u.to(torch.float64) * csum[:, -1]).unsqueeze(1)
    return torch.searchsorted(csum, target, right=True).squeeze(1).clamp_(max=weights.shape[1] - 1)


def draw(logits: torch.Tensor, params: list[SamplingParams], u: torch.Tensor) -> torch.Tensor:
    """inverse_cdf(target_weights(logits, params), u) without the dense [R, V] weights: over each
    row's kept tokens only (in token order, so the same token comes out)."""
    kernels = _native(logits)
    if kernels is not None:
        return _native_rows(kernels, logits, params, u, False)[0]
    out = torch.empty(len(params), dtype=torch.long, device=logits.device)
    for g in _row_groups(_scale(logits, params), params):
        ug = _take(u, g.rows)
        if g.ids is None:
            out[g.rows] = inverse_cdf((g.vals - g.vals.max(-1, keepdim=True).values).exp_(), ug)
            continue
        w = (g.vals - g.vals[:, :1]).exp_().masked_fill_(~g.keep, 0.0)
        if g.ids.shape[1] == logits.shape[1]:               # the full sort: back to token order
            out[g.rows] = inverse_cdf(torch.zeros_like(w).scatter_(-1, g.ids, w), ug)
        else:
            ids, order = g.ids.sort(-1)
            pick = inverse_cdf(w.gather(-1, order), ug)
            out[g.rows] = ids.gather(-1, pick.unsqueeze(1)).squeeze(1)
    return out


def sample(logits: torch.Tensor, params: list[SamplingParams], u: torch.Tensor | None) -> torch.Tensor:
    """Token ids [R] on the logits' device: argmax for greedy rows, `draw` for the others (u: one
    uniform per row; None when every row is greedy)."""
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if len(greedy) == len(params):
        return logits.argmax(-1)
    out = torch.empty(len(params), dtype=torch.long, device=logits.device)
    if greedy:
        out[greedy] = _take(logits, greedy).argmax(-1)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    out[sampled] = draw(_take(logits, sampled), [params[i] for i in sampled], _take(u, sampled))
    return out


def draft_sample(logits: torch.Tensor, seqs: list[Sequence],
                 ahead: list[list[int]]) -> tuple[list[int], list[torch.Tensor | None]]:
    """A model proposer's drafts: row r drafts seqs[r]'s token after ahead[r] (its drafts so far), from
    the filtered distribution of its processed logits (process_logits) with Philox(seed, position, DRAFT).
    Returns the ids (on the host: the next pass feeds them) and each row's q [V] on the device (None for
    greedy rows)."""
    x = process_logits(logits.float(), seqs, ahead)
    picks = x.argmax(-1)
    q: list[torch.Tensor | None] = [None] * len(seqs)
    sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if sampled:
        w = target_weights(_take(x, sampled), [seqs[i].params for i in sampled])
        u = row_uniforms([seqs[i] for i in sampled], [ahead[i] for i in sampled], DRAFT, x.device)
        picks[sampled] = inverse_cdf(w, u)
        for i, row in zip(sampled, w / w.sum(-1, keepdim=True)):
            q[i] = row
    return picks.tolist(), q


# -- per-row inputs: random streams, token rules and penalties ---------------------------------------
def row_uniforms(seqs: list[Sequence], ahead: list[list[int]] | None, purpose: int,
                 device: torch.device) -> torch.Tensor:
    """One uniform per row: row r samples the token of seqs[r] at position num_tokens + len(ahead[r])."""
    seeds = np.fromiter((s.sampling_seed for s in seqs), dtype=np.uint64, count=len(seqs))
    pos = np.fromiter((s.num_tokens for s in seqs), dtype=np.int64, count=len(seqs))
    if ahead is not None:
        pos += np.fromiter((len(a) for a in ahead), dtype=np.int64, count=len(seqs))
    return to_device(uniforms(seeds, pos, purpose), device)


def _penalized(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


def _counts(lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(lists), vocab] occurrence counts, from one scatter_add over the lists concatenated."""
    lens = np.fromiter((len(t) for t in lists), dtype=np.int64, count=len(lists))
    ids = np.concatenate([np.asarray(t, dtype=np.int64) for t in lists])
    flat = to_device(np.repeat(np.arange(len(lists), dtype=np.int64), lens) * vocab + ids, device)
    counts = torch.zeros(len(lists) * vocab, dtype=torch.float32, device=device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.float32)).view(len(lists), vocab)


def _banned_by_bad_words(seq: Sequence, ahead: list[int]) -> list[int]:
    """The last token of each bad word whose other tokens end the output (drafts ahead included), vLLM's rule."""
    banned = []
    for word in seq.bad_word_ids:
        n = len(word) - 1
        if n == 0:
            banned.append(word[0])
            continue
        tail = (seq.output_token_ids + ahead)[-n:]
        if len(tail) == n and tuple(tail) == word[:n]:
            banned.append(word[-1])
    return banned


def _token_rules(logits: torch.Tensor, seqs: list[Sequence], ahead: list[list[int]] | None) -> torch.Tensor:
    """A request's rules on tokens, vLLM's built-in ones in its order, before the penalties: allowed_token_ids
    (every other token at -inf), bad_words (the token that would complete one at -inf), min_tokens (while the
    outputs, drafts ahead counted, are fewer: its stop tokens at -inf, Sequence.min_stops: EOS unless ignore_eos,
    and stop_token_ids), then logit_bias added. A new tensor when any row has one."""
    vocab = logits.shape[1]
    at, add, masked, allowed = [], [], [], []
    for i, s in enumerate(seqs):
        p, row = s.params, i * vocab
        if s.allowed_ids is not None:
            allowed.append((i, s.allowed_ids))
        if s.bad_word_ids:
            masked.extend(row + t for t in _banned_by_bad_words(s, ahead[i] if ahead else []))
        if s.min_stops and s.num_output_tokens + (len(ahead[i]) if ahead else 0) < p.min_tokens:
            masked.extend(row + t for t in s.min_stops)
        if p.logit_bias:
            at.extend(row + t for t in p.logit_bias)
            add.extend(p.logit_bias.values())
    if not (at or masked or allowed):
        return logits
    x = logits.clone()
    flat = x.view(-1)
    for i, ids in allowed:
        keep = to_device(ids, x.device)
        x[i] = torch.full_like(x[i], float("-inf")).index_copy_(0, keep, x[i].index_select(0, keep))
    if masked:
        flat.index_fill_(0, to_device(np.asarray(masked, dtype=np.int64), x.device), float("-inf"))
    if at:
        flat.index_add_(0, to_device(np.asarray(at, dtype=np.int64), x.device),
                        to_device(np.asarray(add, dtype=np.float32), x.device).to(x.dtype))
    return x


def process_logits(logits: torch.Tensor, seqs: list[Sequence], ahead: list[list[int]] | None = None) -> torch.Tensor:
    """The logits each row samples from, before temperature and the filters: the request's token rules first
    (allowed_token_ids, bad_words, min_tokens, logit_bias: `_token_rules`), then the penalties. A new tensor
    when any row has one of these; the raw logits are left as they were (logprobs come from them). Row r's
    output tokens are seqs[r]'s followed by ahead[r] (drafts before the row's position).

    Penalties (vLLM/OpenAI): repetition over prompt and output tokens, then frequency and presence over the
    output."""
    logits = _token_rules(logits, seqs, ahead)
    rows = [i for i, s in enumerate(seqs) if _penalized(s.params)]
    if not rows:
        return logits
    dev, vocab, n = logits.device, logits.shape[1], len(rows)
    outs = [seqs[i].output_token_ids + (ahead[i] if ahead else []) for i in rows]
    prompts = [seqs[i].prompt_token_ids if seqs[i].params.repetition_penalty != 1.0 else [] for i in rows]
    out_counts, prompt_counts = _counts(outs + prompts, vocab, dev).split(n)
    pen = torch.tensor([[seqs[i].params.presence_penalty, seqs[i].params.frequency_penalty,
                         seqs[i].params.repetition_penalty] for i in rows], dtype=torch.float32, device=dev)
    presence, frequency, repetition = (c.unsqueeze(1) for c in pen.unbind(1))
    idx = torch.tensor(rows, device=dev)
    x = logits.index_select(0, idx)
    seen = (out_counts + prompt_counts) > 0
    x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
    x = x - frequency * out_counts - presence * (out_counts > 0).float()
    return logits.index_copy(0, idx, x)


# -- logprobs and the copy to the host ----------------------------------------------------------------
@dataclass
class LogprobRows:
    """The rows that asked for logprobs (of the raw distribution, before penalties, temperature and
    filters, as vLLM does): their top-n and their own token's (the sampled one, or for prompt logprobs the
    prompt's next), computed on the device."""
    rows: list[int]
    n: list[int]

    @classmethod
    def of(cls, params: list[SamplingParams]) -> LogprobRows:
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        return cls(rows, [params[i].logprobs for i in rows])

    def on_device(self, raw: torch.Tensor, tokens: torch.Tensor) -> list[torch.Tensor]:
        if not self.rows:
            return []
        idx = torch.tensor(self.rows, device=raw.device)
        lp = raw.index_select(0, idx).float().log_softmax(-1)
        top_v, top_i = lp.topk(max(max(self.n), 1), dim=-1)
        return [top_v, top_i, lp.gather(1, tokens.index_select(0, idx).unsqueeze(1)).squeeze(1)]

    def on_host(self, arrays: list[np.ndarray], tokens, num_rows: int) -> list[dict[int, float] | None]:
        """Per logits row, its {token: logprob} (None for rows not asked); `tokens[row]`: the row's own token."""
        out: list[dict[int, float] | None] = [None] * num_rows
        if not self.rows:
            return out
        top_v, top_i, tok = arrays
        for r, (row, k) in enumerate(zip(self.rows, self.n)):
            d = {int(t): float(v) for t, v in zip(top_i[r, :k], top_v[r, :k])}
            d[tokens[row]] = float(tok[r])
            out[row] = d
        return out


def record_prompt_logprobs(logits: torch.Tensor, chunks: list) -> None:
    """Prompt logprobs from the rows of prompt chunks (sequence, first row, first position, rows): row j gives
    the distribution of the token at position + j + 1, recorded in seq.prompt_logprobs (indexed by position,
    [0] None) with its top-n, of the raw logits (vLLM's). Positions already recorded (a chunk recomputed after a
    preemption) and rows past the prompt are skipped. One copy to the host per _PROMPT_ROWS rows."""
    want, targets, owners = [], [], []
    for seq, row, start, count in chunks:                  # one chunk a sequence in a step
        nxt = len(seq.prompt_logprobs)                     # the next position to record ([0] is None from the start)
        for j in range(count):
            if start + j + 1 == nxt and nxt < seq.num_prompt_tokens:
                want.append(row + j)
                targets.append(seq.token_ids[nxt])
                owners.append(seq)
                nxt += 1
    if not want:
        return
    by_row = dict(zip(want, targets))                      # each row's own token: the prompt's next
    tokens = torch.zeros(logits.shape[0], dtype=torch.long)
    tokens[want] = torch.tensor(targets)
    tokens = tokens.to(logits.device)
    for at in range(0, len(want), _PROMPT_ROWS):            # a bounded [rows, vocab] float32 at a time
        lps = LogprobRows(want[at:at + _PROMPT_ROWS], [s.params.prompt_logprobs for s in owners[at:at + _PROMPT_ROWS]])
        got = lps.on_host(to_host(*lps.on_device(logits, tokens)), by_row, logits.shape[0])
        for row, seq in zip(lps.rows, owners[at:at + _PROMPT_ROWS]):
            seq.prompt_logprobs.append(got[row])


def to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(a)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def to_host(*tensors: torch.Tensor) -> list[np.ndarray]:
    """One device-to-host copy for several small tensors (ids travel as float64, exact below 2**53)."""
    if len(tensors) == 1:
        return [tensors[0].cpu().numpy()]
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors]).cpu().numpy()
    out, at = [], 0
    for t in tensors:
        out.append(flat[at:at + t.numel()].reshape(t.shape))
        at += t.numel()
    return out


class Sampler:
    def __init__(self, seed: int = 0):
        self._rng = np.random.default_rng(seed)             # seeds of requests that bring none

    def request_seed(self, seed: int | None) -> int:
        """A request's 64-bit sampling seed: its own (as uint64), else one from the engine's seeded RNG."""
        return as_seed(seed) if seed is not None else int(self._rng.integers(0, 2**64, dtype=np.uint64))

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], masks=None) -> SampleResult:
        """Row i samples seqs[i]'s next token (at position seqs[i].num_tokens). `masks`: the step's grammar
        bitmasks, filled while the model ran (engine.structured.StepMasks); else they are filled here."""
        raw = logits.float()
        params = [s.params for s in seqs]
        u = None if all(p.greedy for p in params) else row_uniforms(seqs, None, SAMPLE, raw.device)
        logits = process_logits(raw, seqs)
        if masks is not None:
            logits = masks.apply(logits, seqs)
        elif any(s.guide is not None for s in seqs):
            from engine.structured import mask_logits
            logits = mask_logits(logits, [s.guide for s in seqs])
        tokens = sample(logits, params, u)
        lps = LogprobRows.of(params)
        host = to_host(tokens, *lps.on_device(raw, tokens))
        token_list = host[0].astype(np.int64).tolist()
        return SampleResult(token_list, lps.on_host(host[1:], token_list, len(seqs)))
