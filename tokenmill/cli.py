"""`tokenmill serve | generate | info | convert | quantize | bench | kv-calc | diagnose`."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Optional, Sequence


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine options with vLLM's names, shared by every command that builds an engine."""
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16 (GPU)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when present)")
    p.add_argument("--max-model-len", "-c", "--ctx-size", type=int, default=None,
                   help="the context length (-c, --ctx-size: llama.cpp's names)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--long-prefill-token-threshold", type=int, default=None,
                   help="a prompt with more tokens than this left is long, and no request computes more in a step, "
                        "so a long prompt cannot hold a short one back for long (0: no cap; default: 64 serving on "
                        "a CPU, else 0; 0 with --max-num-partial-prefills > 1: 4%% of --max-model-len)")
    p.add_argument("--max-num-partial-prefills", type=int, default=1,
                   help="above 1: at most this many prompts left part-computed by a step (default: 1, no limit)")
    p.add_argument("--max-long-partial-prefills", type=int, default=1,
                   help="with --max-num-partial-prefills > 1: at most this many of them long; later, shorter "
                        "prompts start ahead of a long one held back (default: 1)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (PEFT folders) over the base model, mixed in one batch")
    p.add_argument("--max-loras", type=int, default=1,
                   help="with --enable-lora: adapters in use at once; requests for one more wait (vLLM's default 1)")
    p.add_argument("--max-lora-rank", type=int, default=16, help="with --enable-lora: the largest adapter rank")
    p.add_argument("--max-cpu-loras", type=int, default=None,
                   help="with --enable-lora: adapters kept loaded in memory (default: every one loaded)")
    p.add_argument("--revision", default=None, help="a hub model's branch, tag or commit (default: main)")
    p.add_argument("--gguf-file", "-hff", "--hf-file", dest="gguf_file", default=None,
                   help="one GGUF of a hub repository (or folder) of GGUFs, by file name (llama-server's -hff)")
    p.add_argument("--kv-cache-memory-gb", type=float, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="the share of the device's whole memory (on a CPU, of RAM) the engine may hold, as vLLM "
                        "sizes it: the KV cache gets what is left after the memory in use (default: a share of free "
                        "memory; --kv-cache-memory-gb wins)")
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--kv-offload-memory-gb", "--kv-offloading-size", type=float, default=None,
                   dest="kv_offload_memory_gb",
                   help="a host-memory tier under the prefix cache, of this many GB: blocks the KV pool evicts are "
                        "kept there and loaded back on a hit instead of recomputed (--kv-offloading-size: vLLM's name)")
    p.add_argument("--kv-offload-dir", default=None,
                   help="a disk tier under the prefix cache: what the host tier lets go, and at shutdown what the "
                        "pool holds, one file per block; a restart with the same directory and model finds them")
    p.add_argument("--kv-offload-disk-gb", type=float, default=None,
                   help="with --kv-offload-dir: at most this many GB on disk, oldest files out (default: no bound)")
    from tokenmill.config import KV_CACHE_DTYPES
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="auto: the model's dtype; bfloat16 halves the KV cache's bytes (K/V rounded); int8 about "
                        "quarters them (a scale per 32 values of a kv head); int4 groups of 32 with a scale and min; "
                        "fp8 (= fp8_e4m3) and fp8_e5m2 8-bit floats with a scale per kv head")
    p.add_argument("--calculate-kv-scales", action="store_true",
                   help="fp8 caches: scales per kv head from the data (a fixed passage at start-up), not 1.0")
    p.add_argument("--cpu-kernels", default="auto",
                   help="auto (TOKENMILL_CPU_ISA, else the best for this CPU) | avx512 | avx2 | neon | generic | "
                        "reference (plain torch)")
    p.add_argument("--int8-activations", action=argparse.BooleanOptionalAction, default=True,
                   help="Q4_K/Q5_K/Q6_K decode multiplies activations rounded to int8 per 256, Q4_0/Q4_1/Q8_0 per 32, "
                        "as llama.cpp does (the default); --no-int8-activations keeps them float32, exact against the dequantised model")
    p.add_argument("--threads", "-t", type=int, default=None, dest="num_threads",
                   help="compute threads (default: the cores this process may use, by affinity and cgroup quota, "
                        "fewer while other processes hold some of them)")
    p.add_argument("--pooling-type", default="LAST", choices=["LAST", "MEAN"],
                   help="what an embedding pools (vLLM's pooler config): the last prompt token's hidden state, or "
                        "the mean over the prompt")
    p.add_argument("--structured-outputs-config", type=_json_object, default=None,
                   help='structured outputs as JSON, vLLM\'s fields: {"backend": "xgrammar", "compile_timeout_s": 10}, '
                        'and "max_concurrent_compiles": N (grammar compile processes at once; default: the cores)')
    p.add_argument("--speculative-config", type=_json_object, default=None,
                   help='speculative decoding as JSON, vLLM\'s fields: {"method": "ngram", "num_speculative_tokens": 3, '
                        '"prompt_lookup_min": 1, "prompt_lookup_max": 4}, or {"method": "draft_model", "model": PATH, '
                        '"num_speculative_tokens": 3}')
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over this many ranks (processes on this machine, gloo), Megatron-style; "
                        "every family, from HF folders and GGUF files (quantised blocks split whole)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs: every GPU step runs eagerly (by default decode steps replay graphs captured "
                        "at start)")
    p.add_argument("--compilation-config", "-O", type=_json_object, default=None,
                   help='CUDA graphs as JSON, vLLM\'s fields: {"cudagraph_mode": "FULL_DECODE_ONLY" | "NONE", '
                        '"cudagraph_capture_sizes": [1, 2, 4, 8], "max_cudagraph_capture_size": 256}')
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=False,
                   help="schedule and launch each GPU step before the last one's tokens are back (they feed it on "
                        "the device); steps with requests that read their past tokens (penalties, bad words, "
                        "min_tokens, grammars) still wait (default: off)")
    p.add_argument("--quantization", "-q", default=None,
                   help="quantise a float checkpoint's matrices at load: int8 (Q8_0) | int4 (Q4_1) | q4_0 | q5_0 | "
                        "q5_1 | q8_0")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                long_prefill_token_threshold=args.long_prefill_token_threshold,
                max_num_partial_prefills=args.max_num_partial_prefills,
                max_long_partial_prefills=args.max_long_partial_prefills,
                block_size=args.block_size, kv_cache_memory_gb=args.kv_cache_memory_gb,
                enable_prefix_caching=args.enable_prefix_caching, kv_cache_dtype=args.kv_cache_dtype,
                calculate_kv_scales=args.calculate_kv_scales,
                cpu_kernels=args.cpu_kernels, quantization=args.quantization, int8_activations=args.int8_activations,
                pooling_type=args.pooling_type, num_threads=args.num_threads,
                structured_outputs_config=args.structured_outputs_config,
                speculative_config=args.speculative_config, tensor_parallel_size=args.tensor_parallel_size,
                enforce_eager=args.enforce_eager, compilation_config=args.compilation_config,
                async_scheduling=args.async_scheduling, gpu_memory_utilization=args.gpu_memory_utilization,
                revision=args.revision, gguf_file=args.gguf_file, enable_lora=args.enable_lora, max_loras=args.max_loras,
                max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras,
                kv_offload_memory_gb=args.kv_offload_memory_gb, kv_offload_dir=args.kv_offload_dir,
                kv_offload_disk_gb=args.kv_offload_disk_gb)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


def cmd_generate(args: argparse.Namespace) -> int:
    from tokenmill import LLM, SamplingParams
    t0 = time.perf_counter()
    llm = LLM(args.model, **engine_kwargs(args))
    print(f"[tokenmill] loaded {llm.llm_engine.config.model} ({llm.llm_engine.config.dtype}, "
          f"{llm.llm_engine.config.device}) in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                            seed=args.seed, ignore_eos=args.ignore_eos)
    prompts: list = list(args.prompts)
    if args.chat:
        from tokenmill.tokenizer import apply_chat_template
        tok = llm.get_tokenizer()
        prompts = [{"prompt": p, "prompt_token_ids": apply_chat_template(tok, [{"role": "user", "content": p}])}
                   for p in prompts]
    # all prompts run together in one batch; the terminal shows them in order: live for the first
    # unfinished one, buffered for the ones behind it
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    pending: list[list[str]] = [[] for _ in prompts]
    sent = [0] * len(prompts)
    finished: dict[int, object] = {}
    shown = 0
    _header(args.prompts[0])
    while engine.has_unfinished_requests():
        for out in engine.step():
            i = int(out.request_id)
            text = out.outputs[0].text
            pending[i].append(text[sent[i]:])
            sent[i] = len(text)
            if out.finished:
                finished[i] = out.metrics
        while shown < len(prompts):
            sys.stdout.write("".join(pending[shown]))
            sys.stdout.flush()
            pending[shown] = []
            if shown not in finished:
                break
            shown += 1
            print()
            if shown < len(prompts):
                _header(args.prompts[shown])
    _phase_report([finished[i] for i in sorted(finished)], llm)
    return 0


def _header(text: str) -> None:
    print(f"\n\033[1m>>> {text}\033[0m" if sys.stdout.isatty() else f"\n>>> {text}")


def _phase_report(metrics: list, llm) -> None:
    if not metrics:
        return
    ttft = [m.time_to_first_token for m in metrics if m.time_to_first_token is not None]
    itl = [x for m in metrics for x in m.inter_token_latencies]
    gen = sum(m.num_generation_tokens for m in metrics)
    decode_s = max((m.last_token_time or 0) for m in metrics) - min(m.first_token_time or 0 for m in metrics)
    stats = llm.get_stats()
    print("\n--- phase report " + "-" * 40, file=sys.stderr)
    print(f"prompt tokens      {sum(m.num_prompt_tokens for m in metrics)} "
          f"(prefix-cache hits {stats['prefix_cache_hits']} tokens)", file=sys.stderr)
    print(f"time to first token  p50 {1000 * statistics.median(ttft):.1f} ms   max {1000 * max(ttft):.1f} ms  "
          f"(prefill)", file=sys.stderr)
    if itl:
        print(f"decode             {gen} tokens, {(gen - len(metrics)) / max(decode_s, 1e-9):.1f} tok/s over all "
              f"requests", file=sys.stderr)
        print(f"inter-token latency  p50 {1000 * _pct(itl, 50):.1f} ms   p99 {1000 * _pct(itl, 99):.1f} ms  (decode)",
              file=sys.stderr)
    print(f"KV blocks used     {stats['max_kv_blocks_used']} of {stats['kv_blocks_total']} "
          f"(block size {llm.llm_engine.config.cache_config.block_size})", file=sys.stderr)
    if stats.get("spec_num_drafts"):
        print(spec_line(stats), file=sys.stderr)


def spec_line(stats: dict) -> str:
    """Speculative decoding's figures from the engine's counters (spec_num_drafts > 0)."""
    drafts, guessed, accepted = (stats[k] for k in ("spec_num_drafts", "spec_num_draft_tokens",
                                                     "spec_num_accepted_tokens"))
    return (f"speculative        {guessed} tokens guessed, {accepted} accepted ({100 * accepted / max(guessed, 1):.1f}%); "
            f"{1 + accepted / drafts:.2f} tokens per verification step")


def cmd_convert(args: argparse.Namespace) -> int:
    import torch
    from tokenmill.executor.loader import resolve_model_path
    from tokenmill.executor.loader.convert import gguf_to_hf
    path = resolve_model_path(args.model)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[args.dtype]
    gguf_to_hf(path, args.out, dtype)
    print(f"wrote a Hugging Face folder to {args.out}")
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    from tokenmill.executor.loader.gguf_writer import quantize_model
    t0 = time.perf_counter()
    quantize_model(args.input, args.output, args.type, force=args.force)
    size = os.path.getsize(args.output) / 2**20
    print(f"wrote {args.output} ({args.type.lower()}, {size:.1f} MiB) in {time.perf_counter() - t0:.1f}s")
    return 0


def info_lines(cpu_kernels: str = "auto", dtype: Optional[str] = None) -> list[str]:
    """The CPU, the kernel variant chosen for it and what serves each op (`tokenmill info`)."""
    import torch

    from tokenmill.config import resolve_dtype
    from tokenmill.executor.kernels import REFERENCE, choose, runnable_variants, this_cpu
    from tokenmill.executor.ops import make_ops, plan_lines
    cpu = this_cpu()
    dev = torch.device("cpu")
    torch_dtype = resolve_dtype(dtype, dev)
    ops = make_ops(dev, torch_dtype, cpu_kernels)
    chosen = choose(cpu_kernels)
    simd = cpu.simd_flags()
    return [f"cpu:       {cpu.model} ({cpu.arch}, {torch.get_num_threads()} threads)",
            f"features:  {' '.join(simd) or '(none of note)'}",
            f"kernels:   {chosen}{'' if chosen == REFERENCE else f' ({ops.kernels.path.name})'}; this CPU runs "
            f"{', '.join(runnable_variants() + [REFERENCE])}",
            f"plan:      for a {str(torch_dtype).replace('torch.', '')} model",
            *plan_lines(ops)]


def cmd_info(args: argparse.Namespace) -> int:
    print("\n".join(info_lines(args.cpu_kernels, args.dtype)))
    if args.kv_offload_dir is not None:
        from tokenmill.engine.kv_offload import disk_tier_lines
        print("\n".join(disk_tier_lines(args.kv_offload_dir)))
    from tokenmill.engine.kv_transfer import KVTransferConfig
    transfer = KVTransferConfig.of(args.kv_transfer_config, args.kv_role)
    if transfer is not None:
        print(transfer.describe())
    return 0


def cmd_download(args: argparse.Namespace) -> int:
    from tokenmill.executor.loader.hub import resolve_hub_name
    print(resolve_hub_name(args.name, args.revision, args.gguf_file))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tokenmill", description="A readable LLM inference engine.")
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for prompts, streamed, with a phase report")
    g.add_argument("prompts", nargs="+", help="one or more prompts")
    g.add_argument("--model", default=None, help="HF folder or .gguf (default: bundled SmolLM2-135M-Instruct)")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    add_engine_args(g)
    g.set_defaults(func=cmd_generate)

    i = sub.add_parser("info", help="the CPU, the kernel variant chosen for it and what serves each op")
    i.add_argument("--cpu-kernels", default="auto")
    i.add_argument("--dtype", default=None, help="the model dtype to plan for (default: this machine's)")
    i.add_argument("--kv-offload-dir", default=None,
                   help="also list what a KV offload disk tier holds: its caches (one per model, dtype and layout), "
                        "their blocks and bytes")
    i.add_argument("--kv-role", choices=("prefill", "decode", "both"), default=None,
                   help="also say what this KV transfer role (and --kv-transfer-config) would do, as serve takes them")
    i.add_argument("--kv-transfer-config", default=None, metavar="JSON", help="vLLM's KV transfer config")
    i.set_defaults(func=cmd_info)

    c = sub.add_parser("convert", help="write a GGUF model as a Hugging Face folder (for peers)")
    c.add_argument("out", help="output folder")
    c.add_argument("--model", default=None)
    c.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    c.set_defaults(func=cmd_convert)

    q = sub.add_parser("quantize", help="write a GGUF that llama.cpp loads, quantised to --type "
                                        "(from a GGUF file or a Hugging Face folder)")
    q.add_argument("input", help="a .gguf file or a Hugging Face folder (llama, qwen2, qwen3)")
    q.add_argument("output", help="the .gguf file to write")
    q.add_argument("--type", required=True,
                   help="q8_0 | q4_0 | q4_1 | q5_0 | q5_1 | f16 | bf16 | f32 (written by tokenmill); q2_k, q3_k_m, "
                        "q4_k_m, q5_k_m, q6_k, ... (llama.cpp's mixes, made by llama-cpp-python)")
    q.add_argument("--force", action="store_true", help="overwrite the output if it exists")
    q.set_defaults(func=cmd_quantize)

    d = sub.add_parser("download", help="fetch a hub model into the Hugging Face cache without serving it; prints "
                                        "its local path")
    d.add_argument("name", help="org/name, or org/name:QUANT for one GGUF of a repository of GGUFs")
    d.add_argument("--revision", default=None, help="a branch, tag or commit (default: main)")
    d.add_argument("--gguf-file", "-hff", "--hf-file", dest="gguf_file", default=None,
                   help="one GGUF of a repository of GGUFs, by file name")
    d.set_defaults(func=cmd_download)

    for mod in ("tokenmill.server.cli", "tokenmill.server.disagg", "tokenmill.bench.cli", "tokenmill.chat_cli", "tokenmill.explain"):
        try:
            module = __import__(mod, fromlist=["register"])
        except ImportError:
            continue
        module.register(sub)
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    from tokenmill.executor.kernels import KernelLibraryError
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except (ValueError, KernelLibraryError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
