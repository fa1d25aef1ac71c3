"""Benchmarks and phase diagnosis: workloads, offline and serving load generators, KV arithmetic, plots.

Submodules load lazily (the engine, matplotlib and httpx only for the commands that need them):
  workload     deterministic request sets (same as ../shared/peers/workload.py) and presets
  stats        percentiles, goodput, serving summaries
  kvcalc       KV bytes per token / sequence, sequences that fit
  offline      throughput and single-stream latency on tokenmill.LLM
  serve_client Poisson streaming load generator for OpenAI-compatible servers
  diagnose     prefill-bound or decode-bound, with evidence and levers
  plots        step-latency and latency-distribution pictures
  cli          register(subparsers): `bench`, `kv-calc`, `diagnose`
"""
