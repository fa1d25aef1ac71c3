"""`tokenmill bench kv-quality`: what a quantised KV cache costs, token by token, against the float cache.

A quantised cache cannot be token-exact, so its error is bounded instead. The float-cache engine continues each
prompt greedily; then both engines score the same sequences (prompt + continuation) with prompt logprobs, so every
position has the same prefix on both sides (teacher forcing: one early divergence does not make the rest
incomparable). Per generated position: does the quantised cache's top-1 token agree with the float cache's; at
agreeing positions, the gap between their logprobs of that token; where they disagree, is each side's token in
the other's top-5 (vLLM's check_logprobs_close rule).

Two texts: the model's own greedy continuations of passages (an easy text: each token is the float model's
favourite), and natural text itself (passages of the bundled text, every position after each passage's first token
compared), where the float model is less sure and a small error flips more top-1s."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

TOP = 5


@dataclass(frozen=True)
class KVQuality:
    kv_cache_dtype: str
    positions: int              # generated positions compared
    agree: int                  # where the top-1 tokens agree
    max_logprob_gap: float      # largest |logprob difference| of the agreed token
    mean_logprob_gap: float
    disagree_in_top5: int       # disagreeing positions where each side's token is in the other's top-5
    max_disagree_margin: float  # where they disagree, the float cache's own preference for its token (nats)

    @property
    def agreement(self) -> float:
        return self.agree / self.positions

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "agreement": self.agreement}


def greedy_sequences(llm, prompts: Sequence[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt followed by its greedy continuation of max_tokens tokens (EOS ignored)."""
    from tokenmill import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(p) + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]


def score(llm, sequences: Sequence[list[int]]) -> list[list[dict[int, float]]]:
    """Per sequence, per position after the first: {token: logprob} of its top-5 and of the actual token."""
    from tokenmill import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=TOP, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    return [[{t: lp.logprob for t, lp in d.items()} for d in o.prompt_logprobs[1:]] for o in outs]


def _top1(d: dict[int, float]) -> int:
    return max(d, key=d.get)


def compare(name: str, want: list[list[dict[int, float]]], got: list[list[dict[int, float]]],
            first: Sequence[int]) -> KVQuality:
    """want, got: score() of the same sequences by the float and the quantised cache; first[i]: the index in
    sequence i's scores of its first generated position."""
    positions = agree = in_top = 0
    gaps: list[float] = []
    margins: list[float] = []
    for w_seq, g_seq, f in zip(want, got, first):
        for w, g in zip(w_seq[f:], g_seq[f:]):
            positions += 1
            tw, tg = _top1(w), _top1(g)
            if tw == tg:
                agree += 1
                gaps.append(abs(w[tw] - g[tg]))
            else:
                in_top += tw in g and tg in w
                margins.append(w[tw] - w[tg] if tg in w else float("inf"))
    return KVQuality(name, positions, agree, max(gaps, default=0.0), sum(gaps) / max(len(gaps), 1), in_top,
                     max(margins, default=0.0))


@dataclass(frozen=True)
class FloatReference:
    """The float cache's side, shared by every cache dtype compared on the same model, prompts and options."""
    model: str
    prompts: list[list[int]]
    engine_args: dict[str, Any]
    sequences: list[list[int]]
    want: list[list[dict[int, float]]]


def float_reference(model: str, prompts: Sequence[list[int]], max_tokens: int = 256,
                    **engine_args: Any) -> FloatReference:
    """The float cache ('auto') continues each prompt greedily and scores the sequences."""
    from tokenmill import LLM
    kw = dict(enable_prefix_caching=False, max_model_len=max(len(p) for p in prompts) + max_tokens + 1,
              **engine_args)
    ref = LLM(model, kv_cache_dtype="auto", **kw)
    sequences = greedy_sequences(ref, prompts, max_tokens)
    return FloatReference(model, [list(p) for p in prompts], kw, sequences, score(ref, sequences))


def text_reference(model: str, passages: Sequence[list[int]], **engine_args: Any) -> FloatReference:
    """Natural text: each passage as it is, scored by the float cache ('auto'); every position after each passage's
    first token is compared."""
    from tokenmill import LLM
    kw = dict(enable_prefix_caching=False, max_model_len=max(len(p) for p in passages) + 1, **engine_args)
    ref = LLM(model, kv_cache_dtype="auto", **kw)
    sequences = [list(p) for p in passages]
    return FloatReference(model, [s[:1] for s in sequences], kw, sequences, score(ref, sequences))


def bundled_passages(tokenizer: Any, count: int, length: int, stride: int = 200) -> list[list[int]]:
    """count passages of length tokens of the bundled text (tokenmill/bench/data/perplexity.txt), stride apart."""
    from tokenmill.bench.perplexity import default_text_path, strip_header
    ids = tokenizer.encode(strip_header(default_text_path().read_text()))
    if (count - 1) * stride + length > len(ids):
        raise ValueError(f"the bundled text has {len(ids):,} tokens: {count} passages of {length}, {stride} apart, "
                         f"do not fit; ask for fewer or shorter ones")
    return [ids[i * stride:i * stride + length] for i in range(count)]


def kv_quality(model: str, kv_cache_dtype: str, prompts: Sequence[list[int]], max_tokens: int = 256,
               **engine_args: Any) -> KVQuality:
    """The float cache ('auto') against kv_cache_dtype on the same model, prompts and engine options."""
    return against_reference(float_reference(model, prompts, max_tokens, **engine_args), kv_cache_dtype)


def against_reference(ref: FloatReference, kv_cache_dtype: str, **engine_args: Any) -> KVQuality:
    """kv_cache_dtype against a float reference computed once (for several dtypes); engine_args: the quantised side's
    own options (calculate_kv_scales)."""
    from tokenmill import LLM
    got = score(LLM(ref.model, kv_cache_dtype=kv_cache_dtype, **{**ref.engine_args, **engine_args}), ref.sequences)
    return compare(kv_cache_dtype, ref.want, got, [len(p) - 1 for p in ref.prompts])
