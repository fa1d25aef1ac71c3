"""Is this load prefill-bound or decode-bound? Reads a bench result (throughput / latency / serve) or a live
server's Prometheus /metrics, gathers the evidence, and names the levers that fit.

Slow to start = prefill-bound (compute: every prompt token goes through every weight once, attention grows
with the prompt). Slow to stream = decode-bound (memory: every step reads all weights and the whole KV
cache for one token per sequence, so batch size is the lever)."""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

PREFILL_BOUND, DECODE_BOUND = "prefill-bound", "decode-bound"


@dataclass
class Evidence:
    source: str
    prefill_s: Optional[float] = None      # time spent computing prompts (summed over requests or steps)
    queue_s: Optional[float] = None        # time waiting to be scheduled (counts on the first-token side)
    decode_s: Optional[float] = None
    ttft_ms: Optional[float] = None        # means
    itl_ms: Optional[float] = None
    prompt_tokens: Optional[float] = None  # totals
    output_tokens: Optional[float] = None
    num_requests: Optional[float] = None
    mean_batch_size: Optional[float] = None
    kv_usage: Optional[float] = None       # peak share of KV blocks in use, 0..1
    preemptions: Optional[float] = None
    prefix_cache_hit_rate: Optional[float] = None
    kv_cache_dtype: Optional[str] = None   # the cache's dtype and its bytes per token (all layers, K and V)
    kv_bytes_per_token: Optional[int] = None
    weights: Optional[str] = None          # how the matrices are stored: "Q4_1", "int8", "float32", ...
    max_num_seqs: Optional[int] = None     # the batch limits the run had
    max_num_batched_tokens: Optional[int] = None
    snapshot: bool = False                 # batch size and KV usage read at one instant (live /metrics)


@dataclass
class Diagnosis:
    verdict: str
    prefill_share: float
    evidence: list[str] = field(default_factory=list)
    levers: list[str] = field(default_factory=list)
    numbers: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def format(self) -> str:
        out = [f"verdict: {self.verdict} ({self.prefill_share:.0%} of request time before the first token)",
               "evidence:"] + [f"  - {e}" for e in self.evidence] + ["levers:"] + [f"  - {x}" for x in self.levers]
        return "\n".join(out)


# ---- Prometheus ----

def parse_metrics(text: str) -> dict[str, float]:
    """Flatten Prometheus text to {name: value}: the 'tokenmill:' / 'vllm:' prefix dropped, labelled series
    summed, histogram buckets dropped (their _sum and _count stay)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith(("_bucket", "_created")):
                continue
            name = s.name.split(":", 1)[-1]
            out[name] = out.get(name, 0.0) + float(s.value)
    return out


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def evidence_from_metrics(m: dict[str, float], source: str = "metrics") -> Evidence:
    g = m.get
    n = g("e2e_request_latency_seconds_count") or g("time_to_first_token_seconds_count")
    ev = Evidence(source=source, num_requests=n, prompt_tokens=g("prompt_tokens_total"),
                  output_tokens=g("generation_tokens_total"), preemptions=g("num_preemptions_total"),
                  prefix_cache_hit_rate=_ratio(g("prefix_cache_hits_total"), g("prefix_cache_queries_total")),
                  mean_batch_size=g("num_requests_running"), kv_usage=g("kv_cache_usage_perc"), snapshot=True)
    ttft_sum = g("time_to_first_token_seconds_sum")
    ev.ttft_ms = _ms(_ratio(ttft_sum, g("time_to_first_token_seconds_count")))
    ev.itl_ms = _ms(_ratio(g("inter_token_latency_seconds_sum"), g("inter_token_latency_seconds_count")))
    if g("request_prefill_time_seconds_sum") is not None and g("request_decode_time_seconds_sum") is not None:
        ev.prefill_s, ev.decode_s = g("request_prefill_time_seconds_sum"), g("request_decode_time_seconds_sum")
        ev.queue_s = g("request_queue_time_seconds_sum")
    elif ttft_sum is not None and g("e2e_request_latency_seconds_sum") is not None:
        ev.prefill_s, ev.decode_s = ttft_sum, g("e2e_request_latency_seconds_sum") - ttft_sum
    return ev


def _ms(s: Optional[float]) -> Optional[float]:
    return None if s is None else s * 1000


def _mean(summary: Any) -> Optional[float]:
    return summary.get("mean") if isinstance(summary, dict) else None


def evidence_from_result(r: dict[str, Any]) -> Evidence:
    kind = r.get("kind")
    if kind == "metrics":
        return evidence_from_metrics(r["metrics"], r.get("source", "metrics"))
    if kind == "serve":
        server = r.get("server") or {}
        deltas = server.get("deltas") or {}
        if deltas.get("request_prefill_time_seconds_sum"):  # the server split the phases for us
            ev = evidence_from_metrics(deltas, "serve result + server /metrics")
        else:  # client's view: TTFT holds queue + prefill, the rest of the request is decode
            reqs = [q for q in r.get("per_request", []) if q.get("success")]
            ev = Evidence(source="serve result (client timings)", num_requests=len(reqs),
                          prefill_s=sum(q["ttft"] for q in reqs),
                          decode_s=sum(q["e2e"] - q["ttft"] for q in reqs),
                          preemptions=deltas.get("num_preemptions_total"),
                          prefix_cache_hit_rate=_ratio(deltas.get("prefix_cache_hits_total"),
                                                       deltas.get("prefix_cache_queries_total")))
        gauges = server.get("gauges") or {}
        ev.snapshot = False
        ev.mean_batch_size = (gauges.get("num_requests_running") or {}).get("mean")
        ev.kv_usage = (gauges.get("kv_cache_usage_perc") or {}).get("max")
        # the client's clock where it saw tokens; the server's histograms where it did not (empty deltas)
        if (r.get("itl_ms") or {}).get("n") or ev.ttft_ms is None:
            ev.ttft_ms = _mean(r.get("ttft_ms"))
        ev.itl_ms = _mean(r.get("itl_ms")) or ev.itl_ms
        ev.prompt_tokens, ev.output_tokens = r.get("prompt_tokens"), r.get("output_tokens")
        return ev
    if kind == "throughput":
        st = r.get("engine_stats") or {}
        blocks = st.get("kv_blocks_total")
        return Evidence(
            source="throughput result (engine counters)" if "prefill_time_s" in st else "throughput result",
            prefill_s=st.get("prefill_time_s"), decode_s=st.get("decode_time_s"),
            ttft_ms=_mean(r.get("ttft_ms")), itl_ms=_mean(r.get("itl_ms")),
            prompt_tokens=r.get("prompt_tokens"), output_tokens=r.get("generated_tokens"),
            num_requests=r.get("requests"), mean_batch_size=st.get("mean_batch_size"),
            kv_usage=_ratio(st.get("max_kv_blocks_used"), blocks), preemptions=st.get("num_preemptions"),
            prefix_cache_hit_rate=_ratio(st.get("prefix_cache_hits"), st.get("prefix_cache_queries")),
            kv_cache_dtype=r.get("kv_cache_dtype"), kv_bytes_per_token=r.get("kv_bytes_per_token"),
            weights=r.get("weights"), max_num_seqs=r.get("max_num_seqs"),
            max_num_batched_tokens=r.get("max_num_batched_tokens"))
    if kind == "latency":
        steps = r.get("step_latencies_s") or []
        return Evidence(source="latency result (single stream)", prefill_s=r["ttft_ms"] / 1000,
                        decode_s=sum(steps), ttft_ms=r["ttft_ms"], itl_ms=_mean(r.get("itl_ms")),
                        prompt_tokens=r.get("input_len"), output_tokens=r.get("output_len"), num_requests=1,
                        mean_batch_size=1.0, kv_cache_dtype=r.get("kv_cache_dtype"),
                        kv_bytes_per_token=r.get("kv_bytes_per_token"), weights=r.get("weights"),
                        max_num_seqs=r.get("max_num_seqs"), max_num_batched_tokens=r.get("max_num_batched_tokens"))
    raise ValueError(f"not a tokenmill bench result (kind={kind!r}); expected throughput, latency, serve or metrics")


def diagnose(ev: Evidence, prefill_threshold: float = 0.5) -> Diagnosis:
    first = (ev.prefill_s or 0.0) + (ev.queue_s or 0.0)
    total = first + (ev.decode_s or 0.0)
    if total <= 0:
        raise ValueError(f"{ev.source}: no phase timings to judge (did any request finish?)")
    share = first / total
    verdict = PREFILL_BOUND if share >= prefill_threshold else DECODE_BOUND
    d = Diagnosis(verdict, share, numbers=asdict(ev))
    e, lv = d.evidence, d.levers
    q = f" (queue {ev.queue_s / total:.0%}, prefill {(ev.prefill_s or 0) / total:.0%})" if ev.queue_s else ""
    e.append(f"time share: {share:.0%} before the first token{q}, {1 - share:.0%} decoding  [{ev.source}]")
    if ev.ttft_ms is not None and ev.itl_ms:
        e.append(f"TTFT {ev.ttft_ms:.1f} ms vs ITL {ev.itl_ms:.2f} ms: the first token costs "
                 f"{ev.ttft_ms / ev.itl_ms:.0f} decode steps")
    if ev.prompt_tokens and ev.output_tokens:
        per = (f"; per request {ev.prompt_tokens / ev.num_requests:.0f} in, {ev.output_tokens / ev.num_requests:.0f} out"
               if ev.num_requests else "")
        e.append(f"tokens: {ev.prompt_tokens:,.0f} prompt, {ev.output_tokens:,.0f} generated{per}")
    if ev.mean_batch_size is not None:
        e.append(f"batch size: {ev.mean_batch_size:.1f} running sequences {'now' if ev.snapshot else 'on average'}")
    if ev.kv_cache_dtype is not None:
        per = f", {ev.kv_bytes_per_token:,} bytes per token" if ev.kv_bytes_per_token else ""
        e.append(f"KV cache dtype: {ev.kv_cache_dtype}{per}")
    if ev.kv_usage is not None:
        e.append(f"KV cache usage: {ev.kv_usage:.0%} {'now' if ev.snapshot else 'at peak'}")
    if ev.preemptions is not None:
        e.append(f"preemptions: {ev.preemptions:.0f}")
    if ev.prefix_cache_hit_rate is not None:
        e.append(f"prefix cache hit rate: {ev.prefix_cache_hit_rate:.0%}")

    if ev.weights is not None:
        e.append(f"weights: {ev.weights}")
    # each lever is offered only where the evidence says it can help (and not where the run already uses it)
    quantised_weights = ev.weights is not None and not ev.weights.startswith(("float", "bfloat16"))
    low_bit_weights = ev.weights is not None and any(_bits(f) <= 4 for f in ev.weights.split(", "))
    quantised_kv = (ev.kv_cache_dtype or "").startswith(("int", "fp8"))
    kv_tight = (ev.preemptions or 0) > 0 or (ev.kv_usage or 0) > 0.9
    at_limit = ev.max_num_seqs is not None and ev.mean_batch_size is not None and \
        ev.mean_batch_size >= 0.9 * ev.max_num_seqs
    if ev.queue_s and first and ev.queue_s / first > 0.5:
        lv.append("most of TTFT is queueing: the server is past capacity; lower the arrival rate, raise "
                  "max_num_seqs, or give the KV cache more memory")
    if verdict == PREFILL_BOUND:
        mean_prompt = ev.prompt_tokens / ev.num_requests if ev.prompt_tokens and ev.num_requests else None
        if ev.max_num_batched_tokens is None or mean_prompt is None or mean_prompt > ev.max_num_batched_tokens:
            lv.append("chunked-prefill budget: raise max_num_batched_tokens so prompts finish in fewer steps "
                      "(lower it instead if streams stall while long prompts are prefilled)")
        if ev.prefix_cache_hit_rate is None or ev.prefix_cache_hit_rate < 0.5:
            lv.append("prefix caching: keep it on and put shared text (system prompt, few-shot examples) first "
                      "so repeated prefixes are computed once")
        lv.append("shorter prompts: prefill work grows with prompt length, attention quadratically")
        if ev.weights is None or ev.weights == "float32":
            lv.append("precision: prefill is compute-bound; bfloat16 over float32, int8/fp8 matmuls raise FLOP/s")
    else:
        if (ev.mean_batch_size is None or ev.mean_batch_size < 32) and not kv_tight:
            lv.append("batch size: a decode step reads every weight once whatever the batch; run more sequences "
                      "at once (" + ("raise max_num_seqs: the batch stayed at its limit" if at_limit else
                                     "send more concurrent requests") + ")")
        if not low_bit_weights:
            lv.append("quantisation: decode is memory-bandwidth-bound; " +
                      ("4-bit weights halve the bytes the current ones read per step" if quantised_weights else
                       "8- or 4-bit weights cut the bytes read per step"))
        if not quantised_kv and (ev.kv_usage is None or ev.kv_usage > 0.5 or kv_tight):
            lv.append("KV dtype fp8/int8: halves KV bytes read per step and fits twice the sequences")
        lv.append("shorter outputs: cap max_tokens; each generated token is a full pass")
    if kv_tight:
        lv.append("KV memory is tight (preemptions recompute work): more KV memory" +
                  ("" if quantised_kv else ", KV dtype fp8/int8,") + " or a lower max_num_seqs")
    return d


def _bits(fmt: str) -> int:
    """The bits a weight format stores per value, roughly (Q4_K -> 4, int8 -> 8, float32 -> 32)."""
    m = re.search(r"(\d+)", fmt)
    return int(m.group(1)) if m else 16


def diagnose_file(path: str | Path) -> Diagnosis:
    from .workload import read_json
    data = read_json(path)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object from `tokenmill bench ... --output`")
    return diagnose(evidence_from_result(data))


def diagnose_url(url: str, timeout_s: float = 10.0) -> Diagnosis:
    import httpx

    url = url.rstrip("/")
    r = httpx.get(url if url.endswith("/metrics") else f"{url}/metrics", timeout=timeout_s)
    if r.status_code != 200:
        raise ValueError(f"{url}/metrics answered HTTP {r.status_code}")
    return diagnose(evidence_from_metrics(parse_metrics(r.text), f"{url}/metrics"))
