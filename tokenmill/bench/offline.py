"""Offline benchmarks on the Python API: replay a workload for throughput, or time one stream's prefill
and decode steps (with the KV cache, or recomputing the whole sequence every step)."""
from __future__ import annotations

import time
from typing import Any, Optional

from .stats import summarize
from .workload import DEFAULT_VOCAB, Workload, make_requests, max_token_id

# engine counters that accumulate (diffed around a run); the rest are levels, read after
_COUNTERS = ("num_steps", "prefill_tokens", "decode_tokens", "prefill_time_s", "decode_time_s",
             "num_preemptions", "prefix_cache_queries", "prefix_cache_hits", "spec_num_drafts",
             "spec_num_draft_tokens", "spec_num_accepted_tokens")


def build_llm(model: Optional[str] = None, **engine_kw: Any) -> Any:
    """tokenmill.LLM, imported late so kv-calc and diagnose work without the engine."""
    try:
        from tokenmill import LLM
    except ImportError as e:
        raise RuntimeError(f"the tokenmill engine (tokenmill.LLM) cannot be imported: {e}") from e
    return LLM(model=model, **{k: v for k, v in engine_kw.items() if v is not None})


def _sampling(max_tokens: int, detokenize: bool = False, json_schema: Optional[dict] = None) -> Any:
    from tokenmill import SamplingParams, StructuredOutputsParams

    # token ids only, as the peers run (vLLM with detokenize=False, transformers without decoding)
    so = None if json_schema is None else StructuredOutputsParams(json=json_schema)
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=detokenize,
                          structured_outputs=so)


def model_vocab(llm: Any) -> int:
    """Token ids for synthetic prompts come from [100, vocab-100): the peers' 49152 unless the model is smaller."""
    v = getattr(getattr(llm, "model_config", None), "vocab_size", None)
    return min(DEFAULT_VOCAB, int(v)) if v else DEFAULT_VOCAB


def _stats(llm: Any) -> dict[str, Any]:
    try:
        return dict(llm.get_stats())
    except Exception:  # the counters are a nicety; a bench must not die for them
        return {}


def _stats_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    def counter(k: str) -> bool:       # the offload tiers' kv_offload_* and the transfer's kv_transfer_* too
        return k in _COUNTERS or k.startswith(("kv_offload_", "kv_transfer_"))
    return {k: (v - before.get(k, 0) if counter(k) and isinstance(v, (int, float)) else v) for k, v in after.items()}


def _warmup(llm: Any, vocab: int) -> None:
    # first calls pay for allocation and kernel selection; keep them out of the timed run
    req = make_requests(1, (16, 16), (4, 4), vocab=vocab, seed=12345)[0]
    llm.generate([{"prompt_token_ids": req["prompt_token_ids"]}], [_sampling(4)], use_tqdm=False)


def weights_label(model: Any, dtype: Any) -> str:
    """How the matrices are stored: their quantised formats (PackedWeight bits, a GGUF's block types), else the
    float dtype."""
    from tokenmill.executor.layers.quant import GGMLWeight, PackedWeight, RowParts
    formats: set[str] = set()

    def add(q: Any) -> None:
        if isinstance(q, RowParts):
            for part in q.parts:
                add(part)
        elif isinstance(q, GGMLWeight):
            formats.add(q.type_name)
        elif isinstance(q, PackedWeight):
            formats.add(f"int{q.bits}")
        elif q is not None:
            formats.add(type(q).__name__)
    for m in model.modules():
        add(getattr(m, "quant", None))
    return ", ".join(sorted(formats)) if formats else str(dtype).removeprefix("torch.")


def kv_record(llm: Any) -> dict[str, Any]:
    """What the diagnosis weighs its levers against: the KV cache's dtype and bytes per token (all layers, K and V,
    scales included), how the weights are stored, and the batch limits."""
    eng = getattr(llm, "llm_engine", None)
    if eng is None:
        return {}
    cfg = eng.config
    # a hybrid cache's block holds one group's layers: a token within every window costs a block of each group
    return {"kv_cache_dtype": cfg.kv_cache_dtype,
            "kv_bytes_per_token": eng.runner.kv_bytes_per_block(cfg) * eng.kv.num_groups // cfg.cache_config.block_size,
            "weights": weights_label(eng.model, cfg.dtype), "max_num_seqs": cfg.scheduler_config.max_num_seqs,
            "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens}


def run_throughput(llm: Any, workload: Workload, warmup: bool = True, use_tqdm: bool = True,
                   detokenize: bool = False, json_schema: Optional[dict] = None) -> dict[str, Any]:
    """Replay every request greedily with ignore_eos; tokens/s over the wall time of one generate() call.
    detokenize: also produce the text, as a server must (the peers' offline runs do not).
    json_schema: constrain every request to it (a schema the outputs cannot finish early keeps the work equal)."""
    reqs = workload["requests"]
    vocab = getattr(getattr(llm, "model_config", None), "vocab_size", None)
    top = max_token_id(workload)
    if vocab and top >= vocab:
        raise ValueError(f"workload has token id {top} but the model's vocabulary is {vocab}; "
                         f"regenerate it with --vocab {min(vocab, DEFAULT_VOCAB)}")
    if warmup:
        _warmup(llm, model_vocab(llm))
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} if r.get("prompt_token_ids") else r["prompt"]
               for r in reqs]
    params = [_sampling(r["max_tokens"], detokenize, json_schema) for r in reqs]
    before = _stats(llm)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - t
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt = sum(len(o.prompt_token_ids or []) for o in outs)
    ms = [o.metrics for o in outs if getattr(o, "metrics", None) is not None]
    return {
        "kind": "throughput", "workload": workload.get("name", ""), "requests": len(outs),
        "prompt_tokens": prompt, "generated_tokens": gen, "expected_generated_tokens": sum(p.max_tokens for p in params),
        "elapsed_s": elapsed,
        "generated_tok_s": gen / elapsed, "total_tok_s": (prompt + gen) / elapsed,
        "ttft_ms": summarize((m.time_to_first_token for m in ms), 1000),
        "itl_ms": summarize((x for m in ms for x in m.inter_token_latencies), 1000),
        "e2e_ms": summarize((m.e2e_latency for m in ms), 1000),
        "engine_stats": _stats_delta(before, _stats(llm)), **kv_record(llm),
    }


def run_latency(llm: Any, input_len: int = 256, output_len: int = 256, seed: int = 0,
                warmup: bool = True) -> dict[str, Any]:
    """One request alone: time to first token (prefill), then per-step decode latency."""
    if input_len < 1 or output_len < 1:
        raise ValueError("--input-len and --output-len must be >= 1")
    vocab = model_vocab(llm)
    req = make_requests(1, (input_len, input_len), (output_len, output_len), vocab=vocab, seed=seed)[0]
    if warmup:
        _warmup(llm, vocab)
    t = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": req["prompt_token_ids"]}], [_sampling(output_len)], use_tqdm=False)[0]
    wall = time.perf_counter() - t
    m = getattr(out, "metrics", None)
    steps = list(getattr(m, "inter_token_latencies", None) or [])
    ttft = m.time_to_first_token if m is not None and m.time_to_first_token is not None else None
    n = len(out.outputs[0].token_ids)
    decode = sum(steps) if steps else None
    if ttft is None:  # no engine timestamps: whatever the decode steps did not take
        ttft = wall - (decode or 0.0)
    return {
        "kind": "latency", "use_kv_cache": bool(getattr(llm, "use_kv_cache", True)), **kv_record(llm),
        "input_len": input_len, "output_len": n,
        "ttft_ms": ttft * 1000,
        "decode_tok_s": len(steps) / decode if decode else None,
        "e2e_ms": wall * 1000, "itl_ms": summarize(steps, 1000), "step_latencies_s": steps,
    }
