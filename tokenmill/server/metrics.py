"""Prometheus metrics with vLLM's names under the prefix `tokenmill:`, fed from the engine thread.

Each app gets its own CollectorRegistry (several servers in one process, e.g. tests, must not collide).
Request histograms are observed once per request when it finishes, from the timings the engine recorded,
so their counts equal the number of requests served (aborted ones count only in request_success_total).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tokenmill.engine.async_engine import EngineState
from tokenmill.engine.engine import KVCacheInfo
from tokenmill.outputs import RequestOutput

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
            40.0, 80.0)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
        0.75, 1.0, 2.5)
_REQUEST = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)


class ServerMetrics:
    def __init__(self, model_name: str, kv_info: KVCacheInfo, max_loras: int = 0):
        self.registry = CollectorRegistry()
        r, m = self.registry, model_name

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"tokenmill:{name}", doc, ["model_name"], buckets=buckets, registry=r).labels(m)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"tokenmill:{name}", doc, ["model_name"], registry=r).labels(m)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"tokenmill:{name}", doc, ["model_name"], registry=r).labels(m)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token (queue + prefill).", _LATENCY)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens (decode).", _ITL)
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency.", _REQUEST)
        self.queue = hist("request_queue_time_seconds", "Time a request waited before first scheduled.", _REQUEST)
        self.prefill = hist("request_prefill_time_seconds", "Time in the prefill phase.", _REQUEST)
        self.decode = hist("request_decode_time_seconds", "Time in the decode phase.", _REQUEST)
        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Share of KV-cache blocks in use (1 = full).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that started generating.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.preemptions = counter("num_preemptions", "Requests preempted (KV blocks ran out).")
        self.pc_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.pc_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        # the offload tiers under the prefix cache (vLLM's external prefix cache counters, then per tier)
        self.ext_queries = counter("external_prefix_cache_queries", "Prompt tokens looked up in the KV offload "
                                                                    "tiers (past the pool's prefix-cache hit).")
        self.ext_hits = counter("external_prefix_cache_hits", "Prompt tokens found in the KV offload tiers.")
        self.offload_hits = Counter("tokenmill:kv_offload_hits", "Prompt tokens loaded from a KV offload tier.",
                                    ["model_name", "tier"], registry=r)
        self.offload_bytes = Counter("tokenmill:kv_offload_bytes", "KV bytes moved to or from an offload tier.",
                                     ["model_name", "tier", "direction"], registry=r)
        self.offload_corrupt = counter("kv_offload_corrupt_files", "Offloaded KV files skipped as damaged.")
        # prefill/decode disaggregation: what this instance's KV transfer moved
        self.transfer_blocks = Counter("tokenmill:kv_transfer_blocks", "KV blocks sent to or received from another "
                                       "instance, or refused (damaged, or another cache's).",
                                       ["model_name", "direction"], registry=r)
        self.transfer_bytes = Counter("tokenmill:kv_transfer_bytes", "KV bytes sent to or received from another "
                                      "instance.", ["model_name", "direction"], registry=r)
        self.transfer_failures = counter("kv_transfer_failures", "KV transfers and pairings that failed.")
        # speculative decoding, vLLM's names: verification steps of one request, tokens guessed, guesses accepted
        self.spec_drafts = counter("spec_decode_num_drafts", "Speculative verifications (one per request and step).")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Tokens guessed for verification.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Guessed tokens the model accepted.")
        # a GPU's graphs: steps replayed from a captured graph, and decode-only steps that none held (eager)
        self.graph_steps = counter("cudagraph_steps", "Steps replayed from a captured CUDA graph.")
        self.eager_decode_steps = counter("eager_decode_steps", "Decode-only steps no captured graph held (run "
                                                                "eagerly: more rows than the largest capture).")
        self._success = Counter("tokenmill:request_success", "Finished requests by reason.",
                                ["model_name", "finished_reason"], registry=r)
        # what the KV cache reserves at start, so resident memory that grows towards it is not read as a leak
        Gauge("tokenmill:cache_config_info", "The KV cache's configuration (vLLM's info metric).",
              ["model_name", "block_size", "cache_dtype", "num_gpu_blocks", "enable_prefix_caching"],
              registry=r).labels(m, str(kv_info.block_size), kv_info.cache_dtype, str(kv_info.num_blocks),
                                 str(kv_info.enable_prefix_caching)).set(1)
        gauge("kv_cache_reserved_bytes", "Bytes of memory the KV cache reserves.").set(kv_info.bytes)
        # LoRA (vLLM's info metric): the adapters of the running and the waiting requests, by name
        self.lora_info = None if not max_loras else Gauge(
            "tokenmill:lora_requests_info", "LoRA adapters in use (vLLM's info metric; the value: when set).",
            ["model_name", "max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=r)
        self._max_loras = max_loras
        self._loras: Optional[tuple] = None          # (running, waiting) adapters last shown
        self._model = m
        self._seen: dict[str, int] = {}      # request id -> tokens generated so far (engine thread only)
        self._last = EngineState()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def on_iteration(self, outputs: list[RequestOutput], aborted: list[str], state: EngineState) -> None:
        """The AsyncLLM hook (engine thread)."""
        for out in outputs:
            # a pooling (embedding) request generates nothing: only its prompt and its end count
            n = sum(len(c.token_ids) for c in out.outputs) if isinstance(out, RequestOutput) else 0
            before = self._seen.get(out.request_id)
            if before is None:
                self.prompt_tokens.inc(len(out.prompt_token_ids))
                before = 0
            self.generation_tokens.inc(n - before)
            self._seen[out.request_id] = n
            if out.finished:
                del self._seen[out.request_id]
                self._observe_finished(out)
        for rid in aborted:
            self._seen.pop(rid, None)
            self._success.labels(self._model, "abort").inc()
        self.running.set(state.num_running)
        self.waiting.set(state.num_waiting)
        self.kv_usage.set(state.kv_usage)
        last = self._last
        self.preemptions.inc(max(state.num_preemptions - last.num_preemptions, 0))
        self.pc_queries.inc(max(state.prefix_cache_queries - last.prefix_cache_queries, 0))
        self.pc_hits.inc(max(state.prefix_cache_hits - last.prefix_cache_hits, 0))
        self._offload(state, last)
        self._transfer(state, last)
        self.spec_drafts.inc(max(state.spec_num_drafts - last.spec_num_drafts, 0))
        self.spec_draft_tokens.inc(max(state.spec_num_draft_tokens - last.spec_num_draft_tokens, 0))
        self.spec_accepted.inc(max(state.spec_num_accepted_tokens - last.spec_num_accepted_tokens, 0))
        self.graph_steps.inc(max(state.num_graph_steps - last.num_graph_steps, 0))
        self.eager_decode_steps.inc(max(state.num_eager_decode_steps - last.num_eager_decode_steps, 0))
        loras = (state.running_loras, state.waiting_loras)
        if self.lora_info is not None and loras != self._loras:
            self._loras = loras
            self.lora_info.clear()
            self.lora_info.labels(self._model, str(self._max_loras), ",".join(state.waiting_loras),
                                  ",".join(state.running_loras)).set(time.time())
        self._last = dataclasses.replace(state)

    def _offload(self, state: EngineState, last: EngineState) -> None:
        if not state.kv_offload.get("kv_offload_queries"):
            return

        def d(f: str) -> int:
            return max(state.kv_offload.get(f, 0) - last.kv_offload.get(f, 0), 0)
        self.ext_queries.inc(d("kv_offload_queries"))
        self.ext_hits.inc(d("kv_offload_hits_host") + d("kv_offload_hits_disk"))
        self.offload_corrupt.inc(d("kv_offload_corrupt_files"))
        for tier in ("host", "disk"):
            self.offload_hits.labels(self._model, tier).inc(d(f"kv_offload_hits_{tier}"))
            for direction, field in (("load", "loaded"), ("store", "stored")):
                self.offload_bytes.labels(self._model, tier, direction).inc(d(f"kv_offload_bytes_{field}_{tier}"))

    def _transfer(self, state: EngineState, last: EngineState) -> None:
        if not state.kv_transfer:
            return

        def d(f: str) -> int:
            return max(state.kv_transfer.get(f"kv_transfer_{f}", 0) - last.kv_transfer.get(f"kv_transfer_{f}", 0), 0)
        for direction in ("sent", "received", "refused"):
            self.transfer_blocks.labels(self._model, direction).inc(d(f"blocks_{direction}"))
        for direction in ("sent", "received"):
            self.transfer_bytes.labels(self._model, direction).inc(d(f"bytes_{direction}"))
        self.transfer_failures.inc(d("failures"))

    def _observe_finished(self, out: RequestOutput) -> None:
        reason = (out.outputs[0].finish_reason if isinstance(out, RequestOutput) else None) or "stop"
        self._success.labels(self._model, reason).inc()
        m = out.metrics
        if m is None:
            return
        for h, v in ((self.ttft, m.time_to_first_token), (self.e2e, m.e2e_latency), (self.queue, m.queue_time),
                     (self.prefill, m.prefill_time), (self.decode, m.decode_time)):
            if v is not None:
                h.observe(max(v, 0.0))
        for v in m.inter_token_latencies:
            self.itl.observe(v)
