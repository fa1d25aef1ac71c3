"""Sampling over one step's logits for all requests at once (no per-request loop over the vocabulary).

Pipeline: grammar bitmask -> logit_bias -> allowed_token_ids -> bad_words -> min_tokens -> repetition penalty
-> frequency/presence penalties -> [greedy rows: argmax here] -> temperature -> top-k -> top-p -> min-p
-> sample (HF's warper order; vLLM v1 applies min-p before top-k/top-p, which differs only when top-p and
min-p are combined). Each stage is skipped when no row uses it, so a plain greedy batch costs one argmax.

Logprobs (params.logprobs / prompt_logprobs) are log_softmax of the *raw* model logits, before any of the
processing above but the grammar's mask, as vLLM does by default ("raw_logprobs"); ranks are 1-based in that
distribution.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from tokenmill.outputs import Logprob
from tokenmill.sampling_params import SamplingParams

_NEG_INF = float("-inf")


@dataclass
class SamplingInput:
    """One row of the logits: the request's params and the token history the processors need."""
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: Optional[torch.Generator] = None
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # structured outputs: [ceil(V / 32)] int32, bit t of word t // 32 set where the grammar allows token t
    token_bitmask: Optional[torch.Tensor] = None
    # speculative decoding by a draft model: the guess at this row and the draft's distribution q [V] it was drawn
    # from; the row then yields the guess (accepted with probability min(1, p/q)) or a draw from max(0, p - q)
    draft_token: Optional[int] = None
    draft_probs: Optional[torch.Tensor] = None


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # per row: None, or {token id: Logprob} holding the sampled token (first) and the top-N (params.logprobs)
    logprobs: list[Optional[dict[int, Logprob]]]


# ---------------------------------------------------------------------------------------------------------
# helpers the engine calls once per request (not per step)

def make_generator(seed: Optional[int], device: torch.device | str = "cpu") -> Optional[torch.Generator]:
    """A per-request generator: a seeded request draws only from it, so its tokens do not depend on the batch."""
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def bad_words_to_token_ids(tokenizer: Any, bad_words: Sequence[str]) -> list[list[int]]:
    """Token sequences for each bad word, with and without a leading space (vLLM does both: mid-sentence
    words usually carry the space in the token)."""
    out: list[list[int]] = []
    for word in bad_words:
        for prefix in ("", " "):
            ids = list(tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False))
            if ids and ids not in out:
                out.append(ids)
    return out


def check_params_for_vocab(params: SamplingParams, vocab_size: int) -> None:
    """Token ids in params must exist in the model's vocabulary; call at add_request (ValueError -> HTTP 400)."""
    def check(name: str, ids: Sequence[int]) -> None:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"SamplingParams.{name} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")

    check("logit_bias", list(params.logit_bias or {}))
    check("allowed_token_ids", params.allowed_token_ids or [])
    check("stop_token_ids", params.stop_token_ids or [])
    for name in ("logprobs", "prompt_logprobs"):
        n = getattr(params, name)
        if n is not None and n > vocab_size:
            raise ValueError(f"SamplingParams.{name} must be <= the vocabulary size {vocab_size}, got {n}")


# ---------------------------------------------------------------------------------------------------------
# logits processors (batched)

def _padded_ids(rows: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, L] token ids, each row padded by repeating its last id (a gather/scatter of a duplicate writes the
    same value twice, so padding is harmless), and [R, L] float 1 for real entries, 0 for padding."""
    width = max((len(r) for r in rows), default=0)
    ids = [r + [r[-1] if r else 0] * (width - len(r)) for r in rows]
    real = [[1.0] * len(r) + [0.0] * (width - len(r)) for r in rows]
    return (torch.tensor(ids, dtype=torch.long, device=device).view(len(rows), width),
            torch.tensor(real, dtype=torch.float32, device=device).view(len(rows), width))


def _token_mask(rows: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[R, V] bool: True where row r lists the token (rows are non-empty)."""
    mask = torch.zeros(len(rows), vocab_size, dtype=torch.bool, device=device)
    return mask.scatter_(1, _padded_ids(rows, device)[0], True)


def _check_ids(ids: Sequence[int], vocab_size: int, what: str) -> None:
    if ids and not 0 <= min(ids) <= max(ids) < vocab_size:
        raise ValueError(f"{what} has token ids outside the vocabulary [0, {vocab_size})")


def apply_logits_processors(logits: torch.Tensor, inputs: list[SamplingInput],
                            eos_token_ids: Sequence[int] = ()) -> torch.Tensor:
    """logit_bias, allowed_token_ids, bad_words, min_tokens, repetition, frequency and presence penalties.

    logits: [R, V] (not modified); returns float32 [R, V]: a new tensor, or logits itself (as float32) when no
    row uses any of these, which spares a greedy batch a copy (64 rows of a 49k vocabulary: 12 MB). Temperature
    and the top-k/p/min-p filters are applied later by the Sampler."""
    R, V = logits.shape
    dev = logits.device
    out = logits.float()
    copied = out.data_ptr() != logits.data_ptr()      # float() of another dtype is a copy already

    def writable() -> torch.Tensor:
        """out, copied the first time a stage writes into it: the caller's logits stay as they were"""
        nonlocal out, copied
        if not copied:
            out, copied = out.clone(), True
        return out

    # logit_bias: add per (row, token) in one index_put
    rows: list[int] = []
    toks: list[int] = []
    vals: list[float] = []
    for r, inp in enumerate(inputs):
        for t, b in (inp.params.logit_bias or {}).items():
            rows.append(r)
            toks.append(int(t))
            vals.append(float(b))
    if rows:
        _check_ids(toks, V, "logit_bias")
        writable().index_put_((torch.tensor(rows, device=dev), torch.tensor(toks, device=dev)),
                          torch.tensor(vals, device=dev), accumulate=True)

    # allowed_token_ids: everything else -> -inf
    sel = [r for r, inp in enumerate(inputs) if inp.params.allowed_token_ids]
    if sel:
        allowed = [list(inputs[r].params.allowed_token_ids or []) for r in sel]
        _check_ids([t for a in allowed for t in a], V, "allowed_token_ids")
        keep = _token_mask(allowed, V, dev)
        sel_t = torch.tensor(sel, device=dev)
        out = writable()
        out[sel_t] = out[sel_t].masked_fill(~keep, _NEG_INF)

    # bad_words and min_tokens: collect (row, token) pairs to ban; only short Python lists are walked
    ban_rows: list[int] = []
    ban_toks: list[int] = []
    for r, inp in enumerate(inputs):
        made = inp.output_token_ids
        for seq in inp.bad_words_token_ids:
            n = len(seq) - 1
            if 0 <= n <= len(made) and (n == 0 or made[-n:] == seq[:-1]):
                ban_rows.append(r)
                ban_toks.append(seq[-1])
        if len(made) < inp.params.min_tokens:
            stops = set(eos_token_ids) | set(inp.params.stop_token_ids or [])
            ban_rows.extend([r] * len(stops))
            ban_toks.extend(stops)
    if ban_rows:
        keep_ok = [i for i, t in enumerate(ban_toks) if 0 <= t < V]  # a bad word / stop id beyond V cannot be sampled anyway
        writable()[torch.tensor([ban_rows[i] for i in keep_ok], dtype=torch.long, device=dev),
               torch.tensor([ban_toks[i] for i in keep_ok], dtype=torch.long, device=dev)] = _NEG_INF

    # Penalties touch only the tokens a row has seen: gather them, change them, scatter back. O(R * L),
    # not O(R * V). Rows that do not use a penalty get identity values (penalty 1, no tokens).
    if any(inp.params.repetition_penalty != 1.0 for inp in inputs):
        # repetition penalty (HF / CTRL): over prompt + output, divide positive logits, multiply negative ones
        seen_l = [inp.prompt_token_ids + inp.output_token_ids if inp.params.repetition_penalty != 1.0 else []
                  for inp in inputs]
        idx, _ = _padded_ids(seen_l, dev)
        # an empty row is padded with token 0: give it penalty 1 so the write is an identity
        pen = torch.tensor([inp.params.repetition_penalty if seen else 1.0 for inp, seen in zip(inputs, seen_l)],
                           device=dev)[:, None]
        out = writable()
        seen = out.gather(1, idx)
        out.scatter_(1, idx, torch.where(seen > 0, seen / pen, seen * pen))

    if any((inp.params.frequency_penalty != 0.0 or inp.params.presence_penalty != 0.0) and inp.output_token_ids
           for inp in inputs):
        # frequency / presence penalties (OpenAI): over output tokens only; frequency once per occurrence,
        # presence once per distinct token (duplicates in a scatter write the same value)
        idx, real = _padded_ids([inp.output_token_ids for inp in inputs], dev)
        freq = torch.tensor([inp.params.frequency_penalty for inp in inputs], device=dev)[:, None]
        pres = torch.tensor([inp.params.presence_penalty for inp in inputs], device=dev)[:, None]
        out = writable()
        out.scatter_add_(1, idx, -freq * real)
        out.scatter_(1, idx, out.gather(1, idx) - pres * real.amax(dim=1, keepdim=True))
    return out


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: Optional[torch.Tensor], top_p: Optional[torch.Tensor],
                            min_p: Optional[torch.Tensor]) -> torch.Tensor:
    """Filters on temperature-scaled logits [R, V]; removed tokens become -inf. top_k: [R] long (V = off),
    top_p: [R] (1 = off), min_p: [R] (0 = off). top-k keeps ties with the k-th value (within the k_max
    best when every row has a top-k); top-p keeps the smallest set of most likely tokens whose mass reaches
    p (on the top-k renormalised distribution); min-p drops tokens with p < min_p * p_max (on what is left)."""
    if top_k is not None or top_p is not None:
        V = logits.shape[-1]
        k_max = min(int(top_k.max()), V) if top_k is not None else V
        # when every row has a top-k, only the k_max best tokens can survive: sort just those
        vals, idx = logits.topk(k_max, dim=-1) if k_max < V else logits.sort(dim=-1, descending=True)
        if top_k is not None:
            kth = vals.gather(1, (top_k.clamp(1, k_max) - 1).unsqueeze(1))
            vals = vals.masked_fill(vals < kth, _NEG_INF)
        if top_p is not None:
            probs = vals.softmax(dim=-1)
            # keep a token while the mass of the more likely ones is still below p (the top one always stays)
            vals = vals.masked_fill(probs.cumsum(dim=-1) - probs >= top_p.unsqueeze(1), _NEG_INF)
        logits = torch.full_like(logits, _NEG_INF).scatter_(1, idx, vals)
    if min_p is not None:
        probs = logits.softmax(dim=-1)
        thresh = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < thresh, _NEG_INF)
    return logits


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmasks: list[torch.Tensor]) -> torch.Tensor:
    """logits [R, V] with each listed row's disallowed tokens at -inf (a new tensor); bitmasks[i] is rows[i]'s packed
    mask. Unpacked with shifts, so any device serves it."""
    V = logits.shape[-1]
    packed = torch.stack(bitmasks).to(logits.device)                                   # [K, W] int32
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((packed.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :V]           # [K, W * 32] -> [K, V]
    out = logits.clone()
    idx = torch.tensor(rows, device=logits.device)
    out[idx] = out[idx].masked_fill(~allowed, _NEG_INF)
    return out


# ---------------------------------------------------------------------------------------------------------
# logprobs

def _logprob_dicts(logprobs: torch.Tensor, chosen: torch.Tensor, nums: list[int]) -> list[dict[int, Logprob]]:
    """logprobs: [N, V] log_softmax; chosen: [N] token ids; nums: top-N per row. One host sync in all."""
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1))
    ranks = (logprobs > chosen_lp).sum(dim=-1) + 1
    k = min(max(nums, default=0), logprobs.shape[-1])
    top_lp, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], chosen[:, None][:, :0])
    chosen_l, chosen_lp_l, ranks_l = chosen.tolist(), chosen_lp.squeeze(1).tolist(), ranks.tolist()
    top_lp_l, top_ids_l = top_lp.tolist(), top_ids.tolist()
    out = []
    for i, n in enumerate(nums):
        d = {chosen_l[i]: Logprob(chosen_lp_l[i], ranks_l[i], None)}
        for j in range(min(n, k)):
            d.setdefault(top_ids_l[i][j], Logprob(top_lp_l[i][j], j + 1, None))
        out.append(d)
    return out


def compute_prompt_logprobs(logits: torch.Tensor, next_token_ids: list[int], num: int) -> list[dict[int, Logprob]]:
    """logits: [P, V] at prompt positions; next_token_ids[i] is the prompt token that followed position i.
    Returns per position {token: Logprob} for the actual next token plus the top-`num` (raw log_softmax)."""
    if logits.shape[0] != len(next_token_ids):
        raise ValueError(f"got {logits.shape[0]} logits rows for {len(next_token_ids)} next tokens")
    if not next_token_ids:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = torch.tensor(next_token_ids, dtype=torch.long, device=logits.device)
    return _logprob_dicts(lp, chosen, [num] * len(next_token_ids))


# ---------------------------------------------------------------------------------------------------------

def _uniform(rows: list[SamplingInput], shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """[len(rows), *shape] uniform noise in [0, 1): a seeded row's from its own generator, so its tokens do not depend
    on the batch."""
    u = torch.empty(len(rows), *shape, device=device).uniform_()
    for i, inp in enumerate(rows):
        g = inp.generator
        if g is not None:
            u[i] = torch.empty(shape, device=g.device).uniform_(generator=g).to(device)
    return u


def _race(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """A draw from softmax(logits) per row by the Gumbel-max race: with E = -log(U) ~ Exp(1), argmax(logits - log E).
    From uniform noise, the cheaper kernel on CPU; E is clamped away from 0 so a -inf token can never win."""
    return (logits - u.log().neg().clamp_min(1e-30).log()).argmax(dim=-1)


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: set[int],
                 argmax: Callable[[torch.Tensor], torch.Tensor] = lambda x: x.argmax(dim=-1)):
        """argmax: the plan's (ops.argmax), torch.argmax's rules whatever serves it."""
        self.vocab_size = vocab_size
        self.eos_token_ids = set(eos_token_ids)
        self.argmax = argmax

    def __call__(self, logits: torch.Tensor, inputs: list[SamplingInput]) -> SamplerOutput:
        """logits: [R, V] float32, one row per entry of `inputs`. Seeded rows draw their noise only from
        their own generator (make it on the logits' device), so their tokens do not depend on what else is in
        the batch. Returned logprobs are log_softmax of these raw logits, before penalties/temperature/filters
        (vLLM's default); the sampled token comes first in each dict, ranks are 1-based."""
        raw, tokens, rand, y = self._process(logits, inputs)
        dev = logits.device
        if rand:
            rand_in = [inputs[r] for r in rand]
            u = _uniform(rand_in, (logits.shape[1],), dev)
            drawn = _race(y, u)
            drafted = [i for i, inp in enumerate(rand_in) if inp.draft_probs is not None]
            if drafted:
                drawn = _verify_drafts(y, u, drawn, drafted, [rand_in[i] for i in drafted])
            tokens = tokens.index_copy(0, torch.tensor(rand, device=dev), drawn)

        lp_rows = [r for r, inp in enumerate(inputs) if inp.params.logprobs is not None]
        logprobs: list[Optional[dict[int, Logprob]]] = [None] * len(inputs)
        if lp_rows:
            lp_t = torch.tensor(lp_rows, device=dev)
            dicts = _logprob_dicts(torch.log_softmax(raw[lp_t], dim=-1), tokens[lp_t],
                                   [int(inputs[r].params.logprobs or 0) for r in lp_rows])
            for r, d in zip(lp_rows, dicts):
                logprobs[r] = d
        return SamplerOutput(tokens.tolist(), logprobs)

    def draw(self, logits: torch.Tensor, inputs: list[SamplingInput]) -> tuple[list[int], list[Optional[torch.Tensor]]]:
        """A draft model's guesses: each row's token, drawn as __call__ draws it, and the distribution it was drawn
        from ([V] float32; None for a greedy row, whose guess is certain: its argmax)."""
        _, tokens, rand, y = self._process(logits, inputs)
        probs: list[Optional[torch.Tensor]] = [None] * len(inputs)
        if rand:
            drawn = _race(y, _uniform([inputs[r] for r in rand], (logits.shape[1],), logits.device))
            tokens = tokens.index_copy(0, torch.tensor(rand, device=logits.device), drawn)
            for i, q in zip(rand, y.softmax(dim=-1)):
                probs[i] = q
        return tokens.tolist(), probs

    def _process(self, logits: torch.Tensor, inputs: list[SamplingInput]
                 ) -> tuple[torch.Tensor, torch.Tensor, list[int], Optional[torch.Tensor]]:
        """The pipeline up to the draw: the (masked) raw logits for logprobs, every row's argmax (a greedy row's
        token), the rows that sample, and their temperature-scaled, filtered logits."""
        R, V = logits.shape
        if R != len(inputs):
            raise ValueError(f"got {R} logits rows for {len(inputs)} sampling inputs")
        dev = logits.device
        raw = logits.float()
        masked = [r for r, inp in enumerate(inputs) if inp.token_bitmask is not None]
        if masked:
            raw = apply_token_bitmask(raw, masked, [inputs[r].token_bitmask for r in masked])
        x = apply_logits_processors(raw, inputs, sorted(self.eos_token_ids))
        tokens = self.argmax(x)
        rand = [r for r, inp in enumerate(inputs) if not inp.params.greedy]
        if not rand:
            return raw, tokens, rand, None
        p = [inputs[r].params for r in rand]
        y = x[torch.tensor(rand, device=dev)] / torch.tensor([q.temperature for q in p], device=dev)[:, None]
        top_k = torch.tensor([q.top_k or V for q in p], device=dev) if any(0 < q.top_k < V for q in p) else None
        top_p = torch.tensor([q.top_p for q in p], device=dev) if any(q.top_p < 1 for q in p) else None
        min_p = torch.tensor([q.min_p for q in p], device=dev) if any(q.min_p > 0 for q in p) else None
        return raw, tokens, rand, apply_top_k_top_p_min_p(y, top_k, top_p, min_p)


def _verify_drafts(y: torch.Tensor, u: torch.Tensor, drawn: torch.Tensor, rows: list[int],
                   inputs: list[SamplingInput]) -> torch.Tensor:
    """Rejection sampling of drafted guesses (Leviathan et al., Chen et al.): rows of y carry a guess d drawn from q.
    The row yields d with probability min(1, p(d)/q(d)), else a draw from max(0, p - q) normalised; in all, p exactly.
    A rejected d has p(d) < q(d), so the residual excludes it and the caller sees the rejection as a mismatch."""
    dev = y.device
    idx = torch.tensor(rows, device=dev)
    p = y[idx].softmax(dim=-1)
    q = torch.stack([inp.draft_probs for inp in inputs]).to(dev)
    d = torch.tensor([inp.draft_token for inp in inputs], dtype=torch.long, device=dev)[:, None]
    accept = (_uniform(inputs, (1,), dev) * q.gather(1, d) < p.gather(1, d)).squeeze(1)
    residual = (p - q).clamp_min(0)
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)   # p == q: nothing is rejected
    redrawn = _race(residual.log(), u[idx])
    return drawn.index_copy(0, idx, torch.where(accept, d.squeeze(1), redrawn))

