"""Sampling over one step's logits for all requests at once (no per-request loop over the vocabulary).

Pipeline: grammar bitmask -> logit_bias -> allowed_token_ids -> bad_words -> min_tokens -> repetition penalty
-> frequency/presence penalties -> [greedy rows: argmax here] -> temperature -> top-k -> top-p -> min-p
-> sample (HF's warper order; vLLM v1 applies min-p before top-k/top-p, which differs only when top-p and
min-p are combined). Each stage is skipped when no row uses it, so a plain greedy batch costs one argmax.

Logprobs (params.logprobs / prompt_logprobs) are log_softmax of the *raw* model logits, before any of the
processing above but the grammar's mask, as vLLM does by default ("raw_logprobs"); ranks are 1-based in that
distribution.

No waiting on the device midway: everything a step needs from the host (per-row values, which rows do what, the
processors' token indices, grammar bitmasks, draft tokens, logprob rows) is decided from the Python params and goes
to the device in ONE copy of one buffer (pinned, non-blocking on CUDA); nothing is read back until the end, when the
sampled tokens and the logprobs come back packed in ONE copy (Sampler.sample -> PendingSample, whose result() waits).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import torch

from tokenmill.executor.transfer import BufferRef, Download, HostBuffer
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

def _check_ids(ids: Sequence[int], vocab_size: int, what: str) -> None:
    if ids and not 0 <= min(ids) <= max(ids) < vocab_size:
        raise ValueError(f"{what} has token ids outside the vocabulary [0, {vocab_size})")


@dataclass
class _Processors:
    """The logits processors' work of a step, as flat indices into [R * V] (row * V + token) decided on the host."""
    bias: Optional[tuple[BufferRef, BufferRef]] = None        # one per (row, token): index, bias
    allowed_rows: Optional[BufferRef] = None             # rows with allowed_token_ids: all their other tokens -> -inf
    allowed: Optional[BufferRef] = None                  # their allowed tokens' indices
    banned: Optional[BufferRef] = None                   # bad_words and min_tokens: indices -> -inf
    repetition: Optional[tuple[BufferRef, BufferRef]] = None  # each distinct token seen (prompt + output): index, penalty
    frequency: Optional[tuple[BufferRef, BufferRef]] = None   # each output token, once per occurrence: index, -penalty
    presence: Optional[tuple[BufferRef, BufferRef]] = None    # each distinct output token: index, penalty


def _plan_processors(buf: HostBuffer, inputs: Sequence[SamplingInput], vocab_size: int,
                     eos_token_ids: Sequence[int]) -> Optional[_Processors]:
    """What apply_logits_processors does to this batch, from the params alone; None when no row uses any of it."""
    V = vocab_size
    bias_idx: list[int] = []
    bias_val: list[float] = []
    allowed_rows: list[int] = []
    allowed: list[int] = []
    banned: list[int] = []
    rep_idx: list[int] = []
    rep_pen: list[float] = []
    freq_idx: list[int] = []
    freq_val: list[float] = []
    pres_idx: list[int] = []
    pres_val: list[float] = []
    eos = set(eos_token_ids)
    for r, inp in enumerate(inputs):
        p = inp.params
        base = r * V
        made = inp.output_token_ids
        if p.logit_bias:
            toks = [int(t) for t in p.logit_bias]
            _check_ids(toks, V, "logit_bias")
            bias_idx.extend(base + t for t in toks)
            bias_val.extend(float(b) for b in p.logit_bias.values())
        if p.allowed_token_ids:
            _check_ids(p.allowed_token_ids, V, "allowed_token_ids")
            allowed_rows.append(r)
            allowed.extend(base + t for t in p.allowed_token_ids)
        # a bad word / stop id beyond V cannot be sampled anyway
        for seq in inp.bad_words_token_ids:
            n = len(seq) - 1
            if 0 <= n <= len(made) and (n == 0 or made[-n:] == seq[:-1]) and 0 <= seq[-1] < V:
                banned.append(base + seq[-1])
        if len(made) < p.min_tokens:
            banned.extend(base + t for t in eos | set(p.stop_token_ids or []) if 0 <= t < V)
        if p.repetition_penalty != 1.0:
            # repetition penalty (HF / CTRL): over prompt + output, once per distinct token
            seen = set(inp.prompt_token_ids)
            seen.update(made)
            if seen:
                _check_ids(list(seen), V, "the token history")
                rep_idx.extend(base + t for t in seen)
                rep_pen.extend([p.repetition_penalty] * len(seen))
        if made and (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0):
            _check_ids(made, V, "the output")
            if p.frequency_penalty != 0.0:
                freq_idx.extend(base + t for t in made)
                freq_val.extend([-p.frequency_penalty] * len(made))
            if p.presence_penalty != 0.0:
                distinct = set(made)
                pres_idx.extend(base + t for t in distinct)
                pres_val.extend([p.presence_penalty] * len(distinct))
    if not (bias_idx or allowed_rows or banned or rep_idx or freq_idx or pres_idx):
        return None
    plan = _Processors()
    if bias_idx:
        plan.bias = buf.ints(bias_idx), buf.floats(bias_val)
    if allowed_rows:
        plan.allowed_rows, plan.allowed = buf.ints(allowed_rows), buf.ints(allowed)
    if banned:
        plan.banned = buf.ints(banned)
    if rep_idx:
        plan.repetition = buf.ints(rep_idx), buf.floats(rep_pen)
    if freq_idx:
        plan.frequency = buf.ints(freq_idx), buf.floats(freq_val)
    if pres_idx:
        plan.presence = buf.ints(pres_idx), buf.floats(pres_val)
    return plan


def _run_processors(logits: torch.Tensor, plan: Optional[_Processors], buf: HostBuffer) -> torch.Tensor:
    """The planned processors on logits [R, V] (not modified): a new float32 tensor, or logits itself (as float32)
    when nothing is planned."""
    out = logits.float()
    if plan is None:
        return out
    if out.data_ptr() == logits.data_ptr() or not out.is_contiguous():
        out = out.clone(memory_format=torch.contiguous_format)     # the caller's logits stay as they were
    R, V = out.shape
    flat = out.view(-1)
    g = buf.get
    if plan.bias is not None:                       # logit_bias: one add per (row, token), no two alike
        flat.index_add_(0, g(plan.bias[0]), g(plan.bias[1]))
    if plan.allowed_rows is not None:               # allowed_token_ids, with the bans: one mask
        ban = torch.zeros(R, V, dtype=torch.bool, device=out.device)
        ban.index_fill_(0, g(plan.allowed_rows), True)
        ban.view(-1).index_fill_(0, g(plan.allowed), False)
        if plan.banned is not None:
            ban.view(-1).index_fill_(0, g(plan.banned), True)
        out.masked_fill_(ban, _NEG_INF)
    elif plan.banned is not None:                   # bad_words and min_tokens
        flat.index_fill_(0, g(plan.banned), _NEG_INF)
    # Penalties touch only the tokens a row has seen: gather them, change them, write them back. O(R * L),
    # not O(R * V).
    if plan.repetition is not None:                 # divide positive logits, multiply negative ones
        idx, pen = g(plan.repetition[0]), g(plan.repetition[1])
        seen = flat.index_select(0, idx)
        flat.index_copy_(0, idx, torch.where(seen > 0, seen / pen, seen * pen))
    if plan.frequency is not None:                  # OpenAI: once per occurrence (the same value each time)
        flat.index_add_(0, g(plan.frequency[0]), g(plan.frequency[1]))
    if plan.presence is not None:                   # once per distinct token
        idx = g(plan.presence[0])
        flat.index_copy_(0, idx, flat.index_select(0, idx) - g(plan.presence[1]))
    return out


def apply_logits_processors(logits: torch.Tensor, inputs: list[SamplingInput],
                            eos_token_ids: Sequence[int] = ()) -> torch.Tensor:
    """logit_bias, allowed_token_ids, bad_words, min_tokens, repetition, frequency and presence penalties.

    logits: [R, V] (not modified); returns float32 [R, V]: a new tensor, or logits itself (as float32) when no
    row uses any of these, which spares a greedy batch a copy (64 rows of a 49k vocabulary: 12 MB). Temperature
    and the top-k/p/min-p filters are applied later by the Sampler. What the processors need goes to the device
    in one copy."""
    buf = HostBuffer()
    plan = _plan_processors(buf, inputs, logits.shape[1], eos_token_ids)
    return _run_processors(logits, plan, buf.upload(logits.device))


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: Optional[torch.Tensor], top_p: Optional[torch.Tensor],
                            min_p: Optional[torch.Tensor], k_max: Optional[int] = None) -> torch.Tensor:
    """Filters on temperature-scaled logits [R, V]; removed tokens become -inf. top_k: [R] long (V = off),
    top_p: [R] (1 = off), min_p: [R] (0 = off). top-k keeps ties with the k-th value (within the k_max
    best when every row has a top-k); top-p keeps the smallest set of most likely tokens whose mass reaches
    p (on the top-k renormalised distribution); min-p drops tokens with p < min_p * p_max (on what is left).
    k_max: max(top_k), known on the host (the Sampler passes it); without it, it is read from top_k (a sync)."""
    if top_k is not None or top_p is not None:
        V = logits.shape[-1]
        if top_k is None:
            k_max = V
        elif k_max is None:
            k_max = int(top_k.max())
        k_max = min(k_max, V)
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


def _run_bitmask(logits: torch.Tensor, rows: Optional[torch.Tensor], packed: torch.Tensor) -> torch.Tensor:
    """logits [R, V] with disallowed tokens at -inf (a new tensor): packed [K, W] int32 are the masks of the K rows
    `rows` (None: every row, K = R). Unpacked with shifts, so any device serves it; bits past W * 32 allow nothing."""
    V = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((packed.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)             # [K, W * 32]
    if allowed.shape[1] < V:
        allowed = torch.nn.functional.pad(allowed, (0, V - allowed.shape[1]), value=False)
    allowed = allowed[:, :V]
    if rows is None:
        return logits.masked_fill(~allowed, _NEG_INF)
    return logits.index_copy(0, rows, logits.index_select(0, rows).masked_fill(~allowed, _NEG_INF))


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmasks: list[torch.Tensor]) -> torch.Tensor:
    """logits [R, V] with each listed row's disallowed tokens at -inf (a new tensor); bitmasks[i] is rows[i]'s packed
    mask (host int32). Rows and masks go to the device in one copy."""
    if any(m.device.type != "cpu" for m in bitmasks):       # masks already on a device: used there
        packed = torch.stack([m.reshape(-1) for m in bitmasks]).to(logits.device)
        return _run_bitmask(logits, torch.tensor(rows, dtype=torch.long).to(logits.device), packed)
    buf = HostBuffer()
    row_ref, mask_ref = buf.ints(rows), buf.words(bitmasks)
    buf.upload(logits.device)
    return _run_bitmask(logits, buf.get(row_ref), buf.get(mask_ref))


# ---------------------------------------------------------------------------------------------------------
# logprobs: computed on the device, packed with the sampled tokens, read back in the one copy

def _logprob_parts(logprobs: torch.Tensor, chosen: torch.Tensor, k: int) -> list[torch.Tensor]:
    """logprobs: [N, V] log_softmax; chosen: [N] token ids; k: the top-N to report. The chosen tokens' logprobs [N],
    their 1-based ranks [N], the top-k logprobs and ids [N * k], each to be cast to float64 (exact: ids and ranks
    are below 2^53, and float32 widens exactly)."""
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1))
    ranks = (logprobs > chosen_lp).sum(dim=-1) + 1
    if k:
        top_lp, top_ids = logprobs.topk(k, dim=-1)
    else:
        top_lp, top_ids = logprobs[:, :0], chosen[:, None][:, :0]
    return [chosen_lp.reshape(-1), ranks, top_lp.reshape(-1), top_ids.reshape(-1)]


def _logprob_dicts(values: list[float], chosen: Sequence[int], nums: Sequence[int], k: int
                   ) -> list[dict[int, Logprob]]:
    """The dicts from the read-back values of _logprob_parts (in that order), for rows wanting nums[i] top tokens."""
    N = len(nums)
    chosen_lp, ranks = values[:N], values[N:2 * N]
    top_lp, top_ids = values[2 * N:2 * N + N * k], values[2 * N + N * k:2 * N + 2 * N * k]
    out = []
    for i, n in enumerate(nums):
        d = {chosen[i]: Logprob(chosen_lp[i], int(ranks[i]), None)}
        for j in range(min(n, k)):
            d.setdefault(int(top_ids[i * k + j]), Logprob(top_lp[i * k + j], j + 1, None))
        out.append(d)
    return out


def compute_prompt_logprobs(logits: torch.Tensor, next_token_ids: list[int], num: int) -> list[dict[int, Logprob]]:
    """logits: [P, V] at prompt positions; next_token_ids[i] is the prompt token that followed position i.
    Returns per position {token: Logprob} for the actual next token plus the top-`num` (raw log_softmax).
    One copy to the device (the next tokens) and one back (everything reported)."""
    if logits.shape[0] != len(next_token_ids):
        raise ValueError(f"got {logits.shape[0]} logits rows for {len(next_token_ids)} next tokens")
    if not next_token_ids:
        return []
    buf = HostBuffer()
    ref = buf.ints(next_token_ids)
    buf.upload(logits.device)
    lp = torch.log_softmax(logits.float(), dim=-1)
    k = min(num, lp.shape[-1])
    packed = torch.cat([t.to(torch.float64) for t in _logprob_parts(lp, buf.get(ref), k)])
    values = Download(packed).wait().tolist()
    return _logprob_dicts(values, next_token_ids, [num] * len(next_token_ids), k)


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


@dataclass
class _StepPlan:
    """A step decided from the params alone (host knowledge): which stages run, on which rows, with what values
    (refs into the step's one HostBuffer)."""
    R: int
    V: int
    masked: list[int]                            # rows with a grammar bitmask
    masked_rows: Optional[BufferRef]                  # None when every row has one
    bitmask: Union[BufferRef, torch.Tensor, None]     # packed [K, W] int32: in the buffer, or masks given on the device
    processors: Optional[_Processors]
    rand: list[int]                              # rows that sample (the others take the argmax)
    rand_rows: Optional[BufferRef]                    # None when every row samples
    temperature: Optional[BufferRef]
    top_k: Optional[BufferRef]
    k_max: int
    top_p: Optional[BufferRef]
    min_p: Optional[BufferRef]
    drafted: list[int]                           # positions in rand of rows verifying a draft model's guess
    drafted_pos: Optional[BufferRef]
    draft_tokens: Optional[BufferRef]
    lp_rows: list[int]                           # rows wanting logprobs
    lp_ref: Optional[BufferRef]                       # None when every row does
    lp_nums: list[int]
    lp_k: int


class PendingSample:
    """A step's sampling, enqueued on the device. token_ids_device: the sampled token ids, int64 [R] on the logits'
    device, to feed a next step without a host round trip (on CPU, possibly the very tensor result() reads: do not
    write into it before then). result() waits for the one device-to-host copy of everything (tokens, logprobs) and
    builds the SamplerOutput (once); done() says whether it would wait."""

    def __init__(self, token_ids_device: torch.Tensor, packed: torch.Tensor, lp_rows: list[int], lp_nums: list[int],
                 lp_k: int, keep: Any = None):
        self.token_ids_device = token_ids_device
        self._download = Download(packed)
        self._R = token_ids_device.shape[0]
        self._lp_rows, self._lp_nums, self._lp_k = lp_rows, lp_nums, lp_k
        self._keep = keep                        # host buffers the step's copies read from
        self._result: Optional[SamplerOutput] = None

    def done(self) -> bool:
        """Whether the result is on the host already (result() would not wait)."""
        return self._result is not None or self._download.done()

    def result(self) -> SamplerOutput:
        if self._result is None:
            values = self._download.wait().tolist()          # the one read of the step's results
            self._keep = self._download = None
            R = self._R
            tokens = values[:R] if not self._lp_rows else [int(v) for v in values[:R]]
            logprobs: list[Optional[dict[int, Logprob]]] = [None] * R
            if self._lp_rows:
                dicts = _logprob_dicts(values[R:], [tokens[r] for r in self._lp_rows], self._lp_nums, self._lp_k)
                for r, d in zip(self._lp_rows, dicts):
                    logprobs[r] = d
            self._result = SamplerOutput(tokens, logprobs)
        return self._result


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
        return self.sample(logits, inputs).result()

    def sample(self, logits: torch.Tensor, inputs: list[SamplingInput]) -> PendingSample:
        """__call__'s work enqueued without waiting for the device: what the step needs from the host goes in one
        copy, nothing is read back midway, and the results come back in one copy that PendingSample.result() waits
        for."""
        plan, buf = self._plan(logits, inputs, verify=True)
        raw, tokens, y = self._process(logits, plan, buf)
        dev = logits.device
        if plan.rand:
            rand_in = [inputs[r] for r in plan.rand]
            u = _uniform(rand_in, (plan.V,), dev)
            drawn = _race(y, u)
            if plan.drafted:
                drawn = _verify_drafts(y, u, drawn, buf.get(plan.drafted_pos), buf.get(plan.draft_tokens),
                                       [rand_in[i] for i in plan.drafted])
            tokens = drawn if tokens is None else tokens.index_copy(0, buf.get(plan.rand_rows), drawn)
        packed = tokens
        if plan.lp_rows:
            sel = buf.get(plan.lp_ref)
            lp = torch.log_softmax(raw if sel is None else raw.index_select(0, sel), dim=-1)
            chosen = tokens if sel is None else tokens.index_select(0, sel)
            packed = torch.cat([t.to(torch.float64) for t in [tokens, *_logprob_parts(lp, chosen, plan.lp_k)]])
        return PendingSample(tokens, packed, plan.lp_rows, plan.lp_nums, plan.lp_k, buf)

    def draw(self, logits: torch.Tensor, inputs: list[SamplingInput]) -> tuple[list[int], list[Optional[torch.Tensor]]]:
        """A draft model's guesses: each row's token, drawn as __call__ draws it, and the distribution it was drawn
        from ([V] float32 on the device; None for a greedy row, whose guess is certain: its argmax). One copy each
        way."""
        plan, buf = self._plan(logits, inputs, verify=False)
        _, tokens, y = self._process(logits, plan, buf)
        probs: list[Optional[torch.Tensor]] = [None] * len(inputs)
        if plan.rand:
            drawn = _race(y, _uniform([inputs[r] for r in plan.rand], (plan.V,), logits.device))
            tokens = drawn if tokens is None else tokens.index_copy(0, buf.get(plan.rand_rows), drawn)
            for i, q in zip(plan.rand, y.softmax(dim=-1).unbind(0)):
                probs[i] = q
        return PendingSample(tokens, tokens, [], [], 0, buf).result().token_ids, probs

    def _plan(self, logits: torch.Tensor, inputs: list[SamplingInput], verify: bool
              ) -> tuple[_StepPlan, HostBuffer]:
        """Decide the step from the params (no device reads) and send what it needs to the device in one copy."""
        R, V = logits.shape
        if R != len(inputs):
            raise ValueError(f"got {R} logits rows for {len(inputs)} sampling inputs")
        buf = HostBuffer()
        masked = [r for r, inp in enumerate(inputs) if inp.token_bitmask is not None]
        masked_rows = None
        bitmask: Union[BufferRef, torch.Tensor, None] = None
        if masked:
            masked_rows = buf.ints(masked) if len(masked) < R else None
            masks = [inputs[r].token_bitmask for r in masked]
            if all(m.device.type == "cpu" for m in masks):
                bitmask = buf.words(masks)
            else:               # masks on the device already (not what the engine makes): used where they are
                bitmask = torch.stack([m.reshape(-1) for m in masks]).to(logits.device)
        processors = _plan_processors(buf, inputs, V, sorted(self.eos_token_ids))
        rand = [r for r, inp in enumerate(inputs) if not inp.params.greedy]
        rand_rows = temperature = top_k = top_p = min_p = drafted_pos = draft_tokens = None
        k_max = V
        drafted: list[int] = []
        if rand:
            p = [inputs[r].params for r in rand]
            rand_rows = buf.ints(rand) if len(rand) < R else None
            temperature = buf.floats([q.temperature for q in p], (len(p), 1))
            if any(0 < q.top_k < V for q in p):
                ks = [q.top_k or V for q in p]
                top_k, k_max = buf.ints(ks), min(max(ks), V)
            if any(q.top_p < 1 for q in p):
                top_p = buf.floats([q.top_p for q in p])
            if any(q.min_p > 0 for q in p):
                min_p = buf.floats([q.min_p for q in p])
            if verify:
                drafted = [i for i, r in enumerate(rand) if inputs[r].draft_probs is not None]
                if drafted:
                    drafted_pos = buf.ints(drafted)
                    draft_tokens = buf.ints([inputs[rand[i]].draft_token for i in drafted], (len(drafted), 1))
        lp_rows = [r for r, inp in enumerate(inputs) if inp.params.logprobs is not None] if verify else []
        lp_nums = [int(inputs[r].params.logprobs or 0) for r in lp_rows]
        lp_ref = buf.ints(lp_rows) if lp_rows and len(lp_rows) < R else None
        lp_k = min(max(lp_nums, default=0), V)
        buf.upload(logits.device)
        return _StepPlan(R, V, masked, masked_rows, bitmask, processors, rand, rand_rows, temperature, top_k, k_max,
                         top_p, min_p, drafted, drafted_pos, draft_tokens, lp_rows, lp_ref, lp_nums, lp_k), buf

    def _process(self, logits: torch.Tensor, plan: _StepPlan, buf: HostBuffer
                 ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The pipeline up to the draw: the (masked) raw logits for logprobs, every row's argmax (a greedy row's
        token; None when every row samples), and the sampling rows' temperature-scaled, filtered logits."""
        raw = logits.float()
        if plan.masked:
            packed = plan.bitmask if isinstance(plan.bitmask, torch.Tensor) else buf.get(plan.bitmask)
            raw = _run_bitmask(raw, buf.get(plan.masked_rows), packed)
        x = _run_processors(raw, plan.processors, buf)
        tokens = self.argmax(x) if len(plan.rand) < plan.R or plan.R == 0 else None
        if not plan.rand:
            return raw, tokens, None
        rows = buf.get(plan.rand_rows)
        y = (x if rows is None else x.index_select(0, rows)) / buf.get(plan.temperature)
        y = apply_top_k_top_p_min_p(y, buf.get(plan.top_k), buf.get(plan.top_p), buf.get(plan.min_p), plan.k_max)
        return raw, tokens, y


def _verify_drafts(y: torch.Tensor, u: torch.Tensor, drawn: torch.Tensor, idx: torch.Tensor, d: torch.Tensor,
                   inputs: list[SamplingInput]) -> torch.Tensor:
    """Rejection sampling of drafted guesses (Leviathan et al., Chen et al.): rows idx of y carry a guess d [K, 1]
    drawn from q. The row yields d with probability min(1, p(d)/q(d)), else a draw from max(0, p - q) normalised; in
    all, p exactly. A rejected d has p(d) < q(d), so the residual excludes it and the caller sees the rejection as a
    mismatch."""
    dev = y.device
    p = y.index_select(0, idx).softmax(dim=-1)
    q = torch.stack([inp.draft_probs for inp in inputs]).to(dev)
    accept = (_uniform(inputs, (1,), dev) * q.gather(1, d) < p.gather(1, d)).squeeze(1)
    residual = (p - q).clamp_min(0)
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)   # p == q: nothing is rejected
    redrawn = _race(residual.log(), u.index_select(0, idx))
    return drawn.index_copy(0, idx, torch.where(accept, d.squeeze(1), redrawn))
