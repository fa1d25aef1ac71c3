"""`tokenmill bench throughput|latency|serve|workload|perplexity`, `tokenmill kv-calc`, `tokenmill diagnose`.

register(subparsers) adds them to the main CLI; each handler takes the parsed namespace and returns an
exit code (0 ok, 2 bad input or a missing engine, with the reason on stderr)."""
from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from tokenmill.config import KV_CACHE_DTYPES

from . import workload as wl
from .stats import json_safe

Handler = Callable[[argparse.Namespace], int]


def _user_errors(fn: Handler) -> Handler:
    @functools.wraps(fn)
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except (ValueError, RuntimeError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return run


def _emit(result: dict[str, Any], args: argparse.Namespace, text: str) -> None:
    """--json prints the result as JSON, else the human text; --output also saves it for `diagnose`."""
    safe = json_safe(result)
    if getattr(args, "output", None):
        Path(args.output).write_text(json.dumps(safe, indent=1))
    print(json.dumps(safe) if args.json else text)


def _fmt_pcts(name: str, s: Optional[dict[str, Any]]) -> str:
    if not s or not s.get("n"):
        return f"{name:<5} -"
    return (f"{name:<5} mean {s['mean']:9.2f}  p50 {s['p50']:9.2f}  p90 {s['p90']:9.2f}  "
            f"p99 {s['p99']:9.2f}  ms")


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"])
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="per-step token budget (chunked prefill)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-memory-gb", type=float, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--kv-offload-memory-gb", "--kv-offloading-size", type=float, default=None,
                   dest="kv_offload_memory_gb", help="a host-memory tier of this many GB under the prefix cache")
    p.add_argument("--kv-offload-dir", default=None, help="a disk tier under the prefix cache, in this directory")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="bfloat16: half the KV cache's bytes (K/V rounded); int8 and fp8 (fp8_e4m3, fp8_e5m2): "
                        "about a quarter; int4: about a sixth")
    p.add_argument("--calculate-kv-scales", action="store_true",
                   help="fp8 caches: scales per kv head from the data (a fixed passage at start-up), not 1.0")
    p.add_argument("--int8-activations", action=argparse.BooleanOptionalAction, default=True,
                   help="Q4_K/Q5_K/Q6_K matmuls take activations rounded to int8 per 256, Q4_0/Q4_1/Q8_0 per 32, as "
                        "llama.cpp's (default)")
    p.add_argument("--threads", "-t", type=int, default=None, dest="num_threads",
                   help="compute threads (default: the cores available, fewer while other processes hold some)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s fields: {"method": "ngram", "num_speculative_tokens": 3} '
                        'or {"method": "draft_model", "model": PATH, "num_speculative_tokens": 3}')
    p.add_argument("--no-warmup", action="store_true", help="time the first (cold) call too")


def _engine_kw(args: argparse.Namespace, use_kv_cache: bool = True) -> dict[str, Any]:
    kw = dict(dtype=args.dtype, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len, kv_cache_memory_gb=args.kv_cache_memory_gb,
              kv_cache_dtype=args.kv_cache_dtype, int8_activations=args.int8_activations,
              calculate_kv_scales=args.calculate_kv_scales,
              num_threads=args.num_threads, speculative_config=args.speculative_config,
              kv_offload_memory_gb=args.kv_offload_memory_gb, kv_offload_dir=args.kv_offload_dir)
    if args.no_prefix_caching:
        kw["enable_prefix_caching"] = False
    if not use_kv_cache:
        kw["use_kv_cache"] = False
    return kw


def _add_output_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--output", "-o", default=None, metavar="PATH", help="also save the result JSON (for diagnose)")


# ---- bench throughput ----

@_user_errors
def cmd_throughput(args: argparse.Namespace) -> int:
    from .offline import build_llm, model_vocab, run_throughput

    llm = build_llm(args.model, **_engine_kw(args))
    if args.workload:
        w = wl.load(args.workload)
        if args.num_requests:
            w["requests"] = w["requests"][: args.num_requests]
    else:
        w = wl.preset(args.preset, vocab=args.vocab or model_vocab(llm), seed=args.seed, n=args.num_requests)
    r = run_throughput(llm, w, warmup=not args.no_warmup, use_tqdm=not args.no_progress and not args.json,
                       detokenize=args.detokenize, json_schema=_json_schema(args.json_schema))
    r["model"] = args.model or "default (SmolLM2-135M-Instruct)"
    text = (f"workload {r['workload']}: {r['requests']} requests, {r['prompt_tokens']:,} prompt tokens, "
            f"{r['generated_tokens']:,} generated tokens in {r['elapsed_s']:.2f} s\n"
            f"generated {r['generated_tok_s']:.1f} tok/s   total {r['total_tok_s']:.1f} tok/s\n"
            f"{_fmt_pcts('TTFT', r['ttft_ms'])}\n{_fmt_pcts('ITL', r['itl_ms'])}\n{_fmt_pcts('E2E', r['e2e_ms'])}")
    st = r.get("engine_stats", {})
    if st.get("spec_num_drafts"):
        from tokenmill.cli import spec_line
        text += "\n" + spec_line(st)
    if st.get("kv_offload_queries"):
        text += "\n" + offload_line(st)
    if r["generated_tokens"] < r["expected_generated_tokens"]:  # e.g. capped by max_model_len: not comparable
        text += (f"\nwarning: {r['generated_tokens']:,} of {r['expected_generated_tokens']:,} requested tokens were "
                 f"generated (max_model_len?); figures are not comparable with engines that ran them all")
    _emit(r, args, text)
    return 0


def offload_line(st: dict[str, Any]) -> str:
    """The offload tiers' part of a run: prompt tokens found in each, and the bytes moved."""
    mib = 2 ** 20
    return (f"KV offload: {st['kv_offload_hits_host']:,} prompt tokens from host memory, "
            f"{st['kv_offload_hits_disk']:,} from disk (of {st['kv_offload_queries']:,} looked up past the pool); "
            f"loaded {(st['kv_offload_bytes_loaded_host'] + st['kv_offload_bytes_loaded_disk']) / mib:,.1f} MiB, "
            f"stored {st['kv_offload_bytes_stored_host'] / mib:,.1f} MiB to memory and "
            f"{st['kv_offload_bytes_stored_disk'] / mib:,.1f} MiB to disk"
            + (f"; {st['kv_offload_corrupt_files']} damaged files skipped" if st["kv_offload_corrupt_files"] else ""))


def _json_schema(arg: Optional[str]) -> Optional[dict]:
    if arg is None:
        return None
    text = Path(arg).read_text() if not arg.lstrip().startswith("{") and Path(arg).is_file() else arg
    try:
        return json.loads(text)
    except ValueError as e:
        raise ValueError(f"--json-schema is neither a JSON file nor JSON: {e}") from None


# ---- bench latency ----

@_user_errors
def cmd_latency(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from .offline import build_llm, run_latency

    if args.max_model_len is None and args.input_len + args.output_len > 4096:
        args.max_model_len = args.input_len + args.output_len
    modes = [not args.no_kv_cache]
    if args.plot:
        modes.append(args.no_kv_cache)  # the picture needs both: with the cache and recomputing
    runs: dict[str, dict[str, Any]] = {}
    for kv in tqdm(modes, desc="latency runs", disable=len(modes) == 1 or args.json):
        llm = build_llm(args.model, **_engine_kw(args, use_kv_cache=kv))
        res = run_latency(llm, args.input_len, args.output_len, seed=args.seed, warmup=not args.no_warmup)
        res["use_kv_cache"] = kv
        runs["kv cache" if kv else "recompute (no kv cache)"] = res
        del llm
    r = dict(next(iter(runs.values())))
    r["model"] = args.model or "default (SmolLM2-135M-Instruct)"
    lines = []
    for name, x in runs.items():
        tps = f"{x['decode_tok_s']:.1f}" if x["decode_tok_s"] else "-"
        lines.append(f"[{name}] prompt {x['input_len']} tokens, {x['output_len']} generated: "
                     f"TTFT {x['ttft_ms']:.1f} ms, decode {tps} tok/s, e2e {x['e2e_ms']:.0f} ms\n"
                     f"  {_fmt_pcts('step', x['itl_ms'])}")
    if args.plot:
        from .plots import plot_step_latency

        plot_step_latency({k: v["step_latencies_s"] for k, v in runs.items()}, args.plot,
                          f"decode step latency, {args.input_len}-token prompt")
        r["runs"] = runs
        r["plot"] = args.plot
        lines.append(f"plot: {args.plot}")
    _emit(r, args, "\n".join(lines))
    return 0


# ---- bench serve ----

@_user_errors
def cmd_serve(args: argparse.Namespace) -> int:
    from .serve_client import run

    if args.workload:
        reqs = wl.load(args.workload)["requests"]
    elif args.input_len or args.output_len:
        il, ol = args.input_len or 256, args.output_len or 128
        reqs = wl.make_requests(args.num_requests, (il, il), (ol, ol), vocab=args.vocab, seed=args.seed)
    else:
        reqs = wl.preset(args.preset, vocab=args.vocab, seed=args.seed, n=args.num_requests)["requests"]
    ms = lambda v: None if v is None else v / 1000  # noqa: E731  (SLOs are given in ms)
    r = run(args.url, reqs, rate=args.rate, num_requests=args.num_requests, model=args.model, seed=args.seed,
            max_concurrency=args.max_concurrency, duration_s=args.duration, request_timeout_s=args.request_timeout,
            slo_ttft_s=ms(args.slo_ttft), slo_tpot_s=ms(args.slo_tpot), progress=not args.no_progress and not args.json)
    slo = ", ".join(f"{k} <= {v:g} ms" for k, v in r["slo"].items() if v is not None) or "no SLO set"
    text = (f"{r['completed']}/{r['num_requests']} requests ok in {r['duration_s']:.2f} s "
            f"(rate {args.rate:g} req/s, model {r['model']})\n"
            f"throughput: {r['request_throughput']:.2f} req/s, {r['output_throughput']:.1f} output tok/s, "
            f"{r['total_token_throughput']:.1f} total tok/s\n"
            + "\n".join(_fmt_pcts(k, r[f"{k.lower()}_ms"]) for k in ("TTFT", "ITL", "TPOT", "E2E"))
            + f"\ngoodput ({slo}): {r['goodput_share']:.0%} of requests, {r['goodput_req_s']:.2f} req/s")
    if r["completed"] and not r["itl_ms"]["n"] and r["output_tokens"] > r["completed"]:
        text += ("\nwarning: the server streamed one chunk per request (empty text deltas?), so TTFT and E2E are "
                 "the same and ITL is unknown; server-side figures: `tokenmill diagnose --url`")
    if r["errors"]:
        text += "\nerrors: " + "; ".join(r["errors"])
    if args.plot:
        from .plots import plot_latency_distributions

        ok = [q for q in r["per_request"] if q["success"]]
        plot_latency_distributions({
            "TTFT": [q["ttft"] * 1000 for q in ok], "ITL": [x * 1000 for q in ok for x in q["itl"]],
            "TPOT": [q["tpot"] * 1000 for q in ok if q["tpot"] is not None],
            "E2E": [q["e2e"] * 1000 for q in ok]}, args.plot, f"{args.url} at {args.rate:g} req/s")
        r["plot"] = args.plot
        text += f"\nplot: {args.plot}"
    _emit(r, args, text)
    return 0 if r["completed"] else 1


# ---- bench workload ----

@_user_errors
def cmd_workload(args: argparse.Namespace) -> int:
    if args.n is None and args.inp is None and args.out is None:
        w = wl.preset(args.preset, vocab=args.vocab, seed=args.seed)
    else:  # same override rules as the peers' script
        spec = dict(wl.PRESETS[args.preset])
        spec.update({k: v for k, v in (("n", args.n), ("inp", args.inp), ("out", args.out)) if v is not None})
        reqs = (wl.make_shared_prefix_requests if "prefix" in spec else wl.make_requests)(
            vocab=args.vocab, seed=args.seed, **{k: tuple(v) if isinstance(v, list) else v for k, v in spec.items()})
        w = {"name": f"{args.preset}-custom", "requests": reqs}
    if args.output:
        wl.save(w, args.output)
        p, g = wl.totals(w)
        print(f"{args.output}: {len(w['requests'])} requests, {p:,} prompt tokens, {g:,} max generated tokens")
    else:
        json.dump(w, sys.stdout)
    return 0


# ---- bench perplexity ----

def _perplexity_engine_kw(args: argparse.Namespace) -> dict[str, Any]:
    kw = _engine_kw(args)
    # a prefix-cache hit skips its positions' logits, so a window's prompt logprobs would come back partial
    kw["enable_prefix_caching"] = False
    kw["cpu_kernels"] = args.cpu_kernels
    kw["quantization"] = args.quantization
    return kw


@_user_errors
def cmd_perplexity(args: argparse.Namespace) -> int:
    from .offline import build_llm
    from .perplexity import PerplexityConfig, format_report, load_text, run_perplexity

    cfg = PerplexityConfig(args.context, args.stride, args.max_tokens_scored)
    if args.max_model_len is None:   # a window and the one token generated after it: a small, quick KV cache
        args.max_model_len = args.context + 1
    text, label = load_text(args.text)
    llm = build_llm(args.model, **_perplexity_engine_kw(args))
    r = run_perplexity(llm, text, cfg, warmup=not args.no_warmup, progress=not args.no_progress and not args.json)
    r.update(model=args.model or "default (SmolLM2-135M-Instruct)", text=label, quantization=args.quantization)
    _emit(r, args, format_report(r))
    return 0


# ---- bench kv-quality ----

@_user_errors
def cmd_kv_quality(args: argparse.Namespace) -> int:
    from tokenmill.executor.kernels import machine_record
    from tokenmill.tokenizer import load_tokenizer
    from .kvquality import against_reference, bundled_passages, float_reference, text_reference
    from tokenmill.executor.loader import resolve_model_path
    model = resolve_model_path(args.model)
    kw = {k: v for k, v in {**_engine_kw(args), "cpu_kernels": args.cpu_kernels}.items()
          if v is not None and k not in ("kv_cache_dtype", "enable_prefix_caching", "max_model_len",
                                         "calculate_kv_scales")}
    tok = load_tokenizer(model)
    texts = {"natural": text_reference(model, bundled_passages(tok, args.passages, args.text_len), **kw),
             "continuations": float_reference(model, bundled_passages(tok, args.passages, args.prompt_len),
                                              args.continue_len, **kw)}
    runs = [(dtype, dtype, {}) for dtype in args.kv_cache_dtypes]
    if args.calculate_kv_scales:     # each fp8 dtype again, its scales from the data
        runs += [(f"{d}+scales", d, {"calculate_kv_scales": True}) for d in args.kv_cache_dtypes if "fp8" in d]
    from tqdm.auto import tqdm
    rows: dict[str, dict[str, Any]] = {}
    with tqdm(total=len(runs) * len(texts), desc="kv-quality", disable=args.json) as bar:
        for label, dtype, extra in runs:
            for name, ref in texts.items():
                rows.setdefault(label, {})[name] = against_reference(ref, dtype, **extra).to_dict()
                bar.update()
    r = {"model": model, "machine": machine_record(), "passages": args.passages, "text_len": args.text_len,
         "prompt_len": args.prompt_len, "continue_len": args.continue_len, "engine": json_safe(kw), "dtypes": rows}
    lines = [f"{'kv dtype':<16} {'text':<14} {'positions':>9} {'top-1 agree':>11} {'in top-5':>9} {'max gap':>8}"]
    for dtype, per in rows.items():
        for name, q in per.items():
            wrong = q["positions"] - q["agree"]
            lines.append(f"{dtype:<16} {name:<14} {q['positions']:>9,} {q['agreement']:>10.1%} "
                         f"{q['disagree_in_top5']:>4}/{wrong:<4} {q['max_logprob_gap']:>8.3f}")
    _emit(r, args, "\n".join(lines))
    return 0


# ---- kv-calc ----

@_user_errors
def cmd_kv_calc(args: argparse.Namespace) -> int:
    """`kv-calc` / `mem-plan`: the KV report for the chosen cache dtype, then the memory planner's tables."""
    from .kvcalc import format_plan, format_report, kv_calc, load_model, memory_plan, plot_plan

    src = load_model(args.model, args.config)
    r = kv_calc(src.config, args.context, args.kv_dtype, args.memory_gb)
    plan = memory_plan(src.config, args.context, args.memory_gb, args.weights, args.kv_dtype, src.gguf, args.batch)
    if args.plot:
        plot_plan(plan, args.plot, Path(src.label).name)
    r.update(model=src.label, **plan.to_dict())
    print(json.dumps(json_safe(r)) if args.json else format_report(r, src.label) + "\n\n" + format_plan(plan))
    if args.plot and not args.json:
        print(f"plot: {args.plot}")
    return 0


# ---- diagnose ----

@_user_errors
def cmd_diagnose(args: argparse.Namespace) -> int:
    from .diagnose import diagnose_file, diagnose_url

    if bool(args.result) == bool(args.url):
        raise ValueError("give either a RESULT.json from `tokenmill bench ... --output` or --url of a live server")
    d = diagnose_file(args.result) if args.result else diagnose_url(args.url)
    print(json.dumps(json_safe(d.to_dict())) if args.json else d.format())
    return 0


def register(subparsers: Any) -> None:
    """Add `bench`, `kv-calc` (alias `mem-plan`) and `diagnose` to an argparse subparsers object."""
    bench = subparsers.add_parser("bench", help="benchmarks: offline throughput, single-stream latency, serving load")
    bsub = bench.add_subparsers(dest="bench_command", metavar="{throughput,latency,serve,workload,perplexity}",
                                required=True)

    p = bsub.add_parser("throughput", help="replay a workload offline; prints tokens/s")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--workload", metavar="W.json", help="workload file ({name, requests: [{prompt_token_ids, max_tokens}]})")
    src.add_argument("--preset", default="offline-64", choices=sorted(wl.PRESETS))
    p.add_argument("--num-requests", type=int, default=None, help="only the first N requests")
    p.add_argument("--vocab", type=int, default=None, help="draw preset ids below this (default min(49152, model vocab))")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--detokenize", action="store_true",
                   help="also produce the text, as a server must (off by default, as the peers' offline runs)")
    p.add_argument("--json-schema", metavar="SCHEMA", default=None,
                   help="constrain every request to this JSON schema (a file, or the JSON itself): what structured "
                        "outputs cost")
    _add_engine_flags(p)
    _add_output_flags(p)
    p.set_defaults(func=cmd_throughput)

    p = bsub.add_parser("latency", help="single stream: TTFT and per-step decode latency")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--no-kv-cache", action="store_true", help="recompute the whole sequence every step")
    p.add_argument("--plot", metavar="OUT.png", help="draw step latency with and without the KV cache")
    p.add_argument("--seed", type=int, default=0)
    _add_engine_flags(p)
    _add_output_flags(p)
    p.set_defaults(func=cmd_latency)

    p = bsub.add_parser("serve", help="load generator for any OpenAI-compatible server")
    p.add_argument("--url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--rate", type=float, default=math.inf, help="Poisson arrival rate, req/s (default inf: all at once)")
    p.add_argument("--num-requests", type=int, default=64)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--workload", metavar="W.json", help="requests to send (cycled if fewer than --num-requests)")
    src.add_argument("--preset", default="offline-64", choices=sorted(wl.PRESETS))
    p.add_argument("--input-len", type=int, default=None, help="fixed-length random prompts instead of a preset")
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--vocab", type=int, default=wl.DEFAULT_VOCAB, help="draw prompt ids below this")
    p.add_argument("--seed", type=int, default=0, help="seeds prompts and arrival times")
    p.add_argument("--model", default=None, help="model name sent to the server (default: first of /v1/models)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--duration", type=float, default=None, metavar="S", help="send no new request after S seconds")
    p.add_argument("--request-timeout", type=float, default=600.0, metavar="S")
    p.add_argument("--slo-ttft", type=float, default=None, metavar="MS", help="goodput: TTFT limit in ms")
    p.add_argument("--slo-tpot", type=float, default=None, metavar="MS", help="goodput: TPOT limit in ms")
    p.add_argument("--plot", metavar="OUT.png", help="draw the TTFT/ITL/TPOT/E2E distributions")
    p.add_argument("--no-progress", action="store_true")
    _add_output_flags(p)
    p.set_defaults(func=cmd_serve)

    p = bsub.add_parser("workload", help="write a deterministic workload JSON (same requests as the peers' script)")
    p.add_argument("preset", nargs="?", default="offline-64", choices=sorted(wl.PRESETS))
    p.add_argument("--n", type=int)
    p.add_argument("--in", dest="inp", type=int, nargs=2, metavar=("MIN", "MAX"))
    p.add_argument("--out", type=int, nargs=2, metavar=("MIN", "MAX"))
    p.add_argument("--vocab", type=int, default=wl.DEFAULT_VOCAB)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", "-o", default=None, metavar="PATH", help="write here instead of stdout")
    p.set_defaults(func=cmd_workload)

    p = bsub.add_parser("perplexity", help="perplexity of a text (default: a bundled one): quality cost of quantising")
    p.add_argument("--text", default=None, metavar="FILE", help="UTF-8 text to score (default: the bundled text)")
    p.add_argument("--context", type=int, default=512,
                   help="tokens per window (--max-model-len defaults to this + 1, so below the model's positions)")
    p.add_argument("--stride", type=int, default=None, help="window starts this far apart (default: --context, "
                   "no overlap); with overlap only the new tokens are scored")
    p.add_argument("--max-tokens-scored", type=int, default=None, metavar="N", help="stop after N scored tokens")
    p.add_argument("--cpu-kernels", default=None, help="auto | avx512 | avx2 | neon | generic | reference")
    p.add_argument("--quantization", default=None, help="quantise a float checkpoint's matrices at load: int8 | int4 | q4_0 | q5_0 | q5_1 | q8_0")
    p.add_argument("--no-progress", action="store_true")
    _add_engine_flags(p)
    _add_output_flags(p)
    p.set_defaults(func=cmd_perplexity)

    p = bsub.add_parser("kv-quality", help="a quantised KV cache against the float one: top-1 agreement, teacher-forced, "
                                           "on natural text and on the model's own continuations")
    p.add_argument("kv_cache_dtypes", nargs="+", metavar="KV_DTYPE", choices=[d for d in KV_CACHE_DTYPES if d != "auto"])
    p.add_argument("--passages", type=int, default=16, help="passages of the bundled text (default 16)")
    p.add_argument("--prompt-len", type=int, default=32, help="continuations: tokens of each passage as the prompt")
    p.add_argument("--continue", type=int, default=256, dest="continue_len", help="continuations: greedy tokens each")
    p.add_argument("--text-len", type=int, default=256, help="natural text: tokens of each passage, all compared")
    p.add_argument("--cpu-kernels", default=None, help="auto | avx512 | avx2 | neon | generic | reference")
    _add_engine_flags(p)
    _add_output_flags(p)
    p.set_defaults(func=cmd_kv_quality)

    p = subparsers.add_parser("kv-calc", aliases=["mem-plan"],
                              help="memory planner: weight bytes by precision, KV bytes by dtype, sequences that fit")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="HF folder or .gguf (default: bundled SmolLM2-135M-Instruct)")
    src.add_argument("--config", default=None, metavar="config.json")
    p.add_argument("--context", type=int, default=4096, help="tokens per sequence")
    # validated by kvcalc (a ValueError naming the choices), which also takes aliases such as bfloat16
    p.add_argument("--kv-dtype", default="bf16", help="fp32, bf16, fp16, fp8, int8 or int4 (default bf16)")
    p.add_argument("--weights", default=None, metavar="PREC",
                   help="weight precision to highlight: fp32, bf16, Q8_0, Q6_K, Q5_K, Q4_K, Q4_0, Q4_1, Q3_K, Q2_K, "
                        "int8, int4, or gguf (default: the GGUF file's own bytes, else bf16)")
    p.add_argument("--memory-gb", type=float, default=None,
                   help="memory budget in GB (1e9 bytes): sequences that fit in it, KV only and after the weights")
    p.add_argument("--batch", type=int, default=None,
                   help="sequences drawn by --plot (default: as many as fit at the chosen weights and KV dtype)")
    p.add_argument("--plot", metavar="OUT.png", help="stacked bars of weights + KV per precision, budget line")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_kv_calc)

    p = subparsers.add_parser("diagnose", help="prefill-bound or decode-bound? evidence and levers")
    p.add_argument("result", nargs="?", metavar="RESULT.json", help="from `tokenmill bench ... --output`")
    p.add_argument("--url", default=None, help="a live server: reads its /metrics")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_diagnose)


def main(argv: Optional[list[str]] = None) -> int:
    """Standalone entry (python -m tokenmill.bench.cli ...), same commands as under `tokenmill`."""
    ap = argparse.ArgumentParser(prog="tokenmill")
    register(ap.add_subparsers(dest="command", required=True))
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
