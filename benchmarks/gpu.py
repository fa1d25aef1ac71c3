#!/usr/bin/env python3
"""The GPU path's figures, in one run on one device (random weights from transformers configs: nothing is
downloaded):

  bandwidth   a device-to-device copy, bytes read and written over its time (the HBM ceiling)
  compute     a bf16 8192^3 matrix product (the compute ceiling)
  8b          a Llama-3.1-8B-shaped bf16 model: start-up (load, graph capture, graph memory); one stream's decode
              (2,048-token prompt) against the HBM limit (the weight bytes a step reads, all but the embedding
              table, over the measured bandwidth; target: at least 85%), and the GPU's busy time over that step's
              wall time (target: 95%); the first request's TTFT after start and a warm one against the compute
              limit (the matrices but the embedding for every token, the LM head for the last, causal attention);
              decode at 256 concurrent requests (128-token prompts, 256 out) against its steps' HBM limit (weights
              plus the KV each step reads; target: 18,000 tok/s)
  offline-1b  requests with in and out U(100, 512), seeded, on a Llama-3.2-1B-shaped model: tokenmill, and
              transformers with its static cache and torch.compile in batches, useful tokens a second each
              (target: tokenmill at least 5x; 1,000 requests, 300 with --quick)
  smollm2     the bundled SmolLM2 (its GGUF dequantised to bf16): one stream's decode, and offline-64
  kernels     each weight form's matmul alone at the 8B shape's four matrices (bf16, int4 and int8 in groups of 128,
              fp8; 1 and 16 rows), and the int4/int8 GEMV's configurations (tile, programs, warps, K tile) swept
              at one row
  quant       the 8B shape quantised at load: int4 (W4A16, groups of 128), int8 (W8A16) and fp8 (e4m3 weights,
              dynamic per-token activations), each one stream's ITL over bf16's from the same run (targets: int4 at
              most 0.4x, fp8 at most 0.6x)
  moe         a Mixtral-shaped model (8 experts, top 2; 8 layers, 2 with --tiny): one stream's ITL against the HBM
              limit of the weights a step reads with 2 of 8 experts active, and with all 8 (the time should follow
              the active experts)
  offload     the KV offload host tier's moves on an 8B-shaped bf16 cache (32 layers, 8 kv heads of 128): 256
              blocks of 16 tokens saved to host memory and restored (engine/kv_offload.py's BlockCodec), each as
              bytes over seconds, against the same bytes copied host-to-device from pinned and from pageable memory
              in the same run (the PCIe ceiling)

  python3 benchmarks/gpu.py [--tiny | --quick] [--skip offload 8b offline-1b smollm2 quant moe] [--eager]
      [--out FILE]

--quick is the GPU check's size (benchmarks/gpu_check.py: fewer requests, no SmolLM2, which is a wheel the GPU
machine lacks); --eager runs every step eagerly (enforce_eager) for the graphs' A/B; --tiny shrinks every model and
count so that the script runs anywhere in a minute or two, CPU included: a check of the script, not a measurement.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PARTS = ("offload", "kernels", "8b", "offline-1b", "smollm2", "quant", "moe")      # the ceilings are always measured
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192)
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192,
                tie_word_embeddings=True)
TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
            vocab_size=4096, max_position_embeddings=2048)
MIXTRAL = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=8, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=32000, num_local_experts=8, num_experts_per_tok=2,
               rope_theta=1e6, max_position_embeddings=8192)


def device_info(dev: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version()}
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        info.update(device=p.name, multiprocessors=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1),
                    cuda=torch.version.cuda)
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            info["driver"] = "unknown (no nvidia-smi)"
        try:
            import triton
            info["triton"] = triton.__version__
        except ImportError:
            info["triton"] = None
    else:
        info["device"] = platform.processor() or platform.machine()
    return info


def timed(fn: Callable[[], Any], dev: torch.device, repeat: int) -> float:
    """Median seconds of fn over repeat runs after one warm-up (device events on CUDA)."""
    fn()
    times = []
    for _ in range(repeat):
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def bandwidth(dev: torch.device, tiny: bool) -> float:
    """Bytes a second of a device-to-device copy, read and written both counted."""
    n = (64 if tiny else 2048) * 2**20
    src = torch.randn(n // 2, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / timed(lambda: dst.copy_(src), dev, 10 if tiny else 50)


def compute(dev: torch.device, tiny: bool) -> float:
    """FLOP/s of a bf16 matrix product on random data."""
    n = 512 if tiny else 8192
    a, b = (torch.randn(n, n, dtype=torch.bfloat16, device=dev) for _ in range(2))
    return 2 * n ** 3 / timed(lambda: a @ b, dev, 3 if tiny else 20)


def _cloned(q: Any) -> Any:
    """A quantised weight (a frozen dataclass) with its own copy of every tensor."""
    return dataclasses.replace(q, **{f.name: getattr(q, f.name).clone() for f in dataclasses.fields(q)
                                     if isinstance(getattr(q, f.name), torch.Tensor)})


def _nbytes(q: Any) -> int:
    return sum(getattr(q, f.name).nbytes for f in dataclasses.fields(q) if isinstance(getattr(q, f.name), torch.Tensor))


def _graph_seconds(fn: Callable[[], Any], dev: torch.device, calls: int) -> float:
    """Seconds a call of fn's `calls` calls, replayed from a captured graph on CUDA (as a decode step runs)."""
    if dev.type != "cuda":
        return timed(fn, dev, 3) / calls
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return timed(g.replay, dev, 20) / calls


GEMV_SWEEP = [(tile, programs, warps, block_k) for block_k in (256, 512, 1024) for tile in (4096, 8192)
              for programs in (1056, 2112) for warps in (4,)]


def _gemv_key(bits: int, cfg: Any) -> str:
    return f"int{bits} tile {cfg.tile} programs {cfg.programs} warps {cfg.warps} block_k {cfg.block_k}"


def matmul_kernels(dev: torch.device, tiny: bool) -> dict[str, Any]:
    """Each weight form's matmul alone at the 8B shape's matrices, 1 and 16 rows of x: seconds a call and the
    weight bytes a second, against bf16's. Each call cycles through copies of the weight that together pass the L2
    (else it reads the cache), inside a captured graph (as a decode step runs), so launches are not counted.
    FP8 runs twice: its activations quantised by the GPU plan's one kernel, and by torch. Then the int4 and int8
    GEMV's configurations (tile, programs, warps, K tile) swept at one row: the sum over the four matrices (one
    layer's) for each, against the module's defaults."""
    from tokenmill.executor.loader.quantize import quantize_fp8, quantize_groups
    from tokenmill.executor.ops import triton_fp8, triton_quant as tq
    from tokenmill.executor.ops.fp8 import fp8_linear
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    if tiny:
        shapes = {"o": (256, 256)}
    rows: list[dict[str, Any]] = []
    sweep: dict[str, dict[str, float]] = {}
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, dtype=torch.bfloat16, device=dev) * 0.02
        copies = max(2, -(-512 * 2 ** 20 // w.nbytes)) if not tiny else 2
        g4, g8, f8 = quantize_groups(w, 4, 128, symmetric=False), quantize_groups(w, 8, 128, symmetric=False), \
            quantize_fp8(w)
        fp8_kernel = (lambda x, v: fp8_linear(x, v, quantize=triton_fp8.quantize_rows))
        # distinct copies: each call reads memory, not the L2
        forms = {"bf16": ([w.clone() for _ in range(copies)], lambda x, v: x @ v.t(), w.nbytes),
                 "int4_g128": ([_cloned(g4) for _ in range(copies)], tq.group_matmul, _nbytes(g4)),
                 "int8_g128": ([_cloned(g8) for _ in range(copies)], tq.group_matmul, _nbytes(g8)),
                 "fp8": ([_cloned(f8) for _ in range(copies)], fp8_kernel, _nbytes(f8)),
                 "fp8_torch_quantiser": ([_cloned(f8) for _ in range(copies)], fp8_linear, _nbytes(f8))}
        for m in (1, 16):
            x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
            base = None
            for form, (ws, fn, b) in forms.items():
                try:
                    sec = _graph_seconds(lambda: [fn(x, v) for v in ws], dev, len(ws))
                except Exception as e:          # a form this device cannot run: said, not fatal
                    rows.append({"matrix": name, "rows": m, "form": form, "error": f"{type(e).__name__}: {e}"[:300]})
                    continue
                base = sec if form == "bf16" else base
                rows.append({"matrix": name, "n": n, "k": k, "rows": m, "form": form, "us": 1e6 * sec,
                             "weight_gbs": b / sec / 1e9, "over_bf16": sec / base if base else None})
        x = torch.randn(1, k, dtype=torch.bfloat16, device=dev)
        for bits, form in ((4, "int4_g128"), (8, "int8_g128")):
            ws = forms[form][0]
            for cfg in (tq.GemvConfig(*c) for c in (GEMV_SWEEP[:2] if tiny else GEMV_SWEEP)):
                key = _gemv_key(bits, cfg)
                try:
                    sec = _graph_seconds(lambda: [tq.launch(x, v.codes, v.scale, v.zero, v.bits, v.group, cfg)
                                                  for v in ws], dev, len(ws))
                except Exception as e:
                    sweep.setdefault(key, {})["error"] = f"{type(e).__name__}: {e}"[:300]
                    continue
                sweep.setdefault(key, {})[name] = 1e6 * sec
        del forms, w
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    totals = {key: sum(v.values()) for key, v in sweep.items() if "error" not in v and len(v) == len(shapes)}
    best = {}
    for bits in (4, 8):
        mine = {key: t for key, t in totals.items() if key.startswith(f"int{bits} ")}
        default = _gemv_key(bits, tq.GEMV[bits])
        if mine:
            top = min(mine, key=mine.get)
            best[f"int{bits}"] = {"best": top, "best_layer_us": mine[top], "default": default,
                                  "default_layer_us": mine.get(default)}
    return {"rows": rows, "gemv_sweep": sweep, "gemv_best": best}


def random_checkpoint(shape: dict, folder: Path, dev: torch.device, family: str = "llama") -> tuple[str, int]:
    """A Llama (or Mixtral) of this shape with random bf16 weights (drawn on the device, saved in shards):
    (path, parameters)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig
    cls, arch = (MixtralConfig, "MixtralForCausalLM") if family == "mixtral" else (LlamaConfig, "LlamaForCausalLM")
    cfg = cls(**shape, eos_token_id=None, bos_token_id=None, pad_token_id=None, torch_dtype="bfloat16",
              architectures=[arch])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    cfg.save_pretrained(folder)
    shard, size, total, weight_map = {}, 0, 0, {}
    shapes = {k: v.shape for k, v in model.state_dict().items()
              if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    for k in [k for k in shapes if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        del shapes[k]            # transformers' fused experts, written as the per-expert tensors checkpoints hold
        h, i = cfg.hidden_size, cfg.intermediate_size
        for e in range(cfg.num_local_experts):
            parts = (("gate_proj", (i, h)), ("up_proj", (i, h))) if k.endswith("gate_up_proj") else \
                (("down_proj", (h, i)),)
            shapes.update({f"{k.rsplit('.', 1)[0]}.{e}.{p}.weight": torch.Size(sh) for p, sh in parts})
    names = list(shapes)

    def flush() -> None:
        file = f"model-{len(set(weight_map.values())):05d}.safetensors"
        save_file(shard, str(folder / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in shard})
    for name in names:
        shape_ = shapes[name]
        t = torch.ones(shape_) if name.endswith("norm.weight") else torch.randn(shape_, device=dev) * 0.02
        shard[name] = t.to(torch.bfloat16).cpu()
        size += shard[name].nbytes
        total += shard[name].numel()
        if size > 2 * 2**30:
            flush()
            shard, size = {}, 0
    if shard:
        flush()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return str(folder), total


def workload(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    r = random.Random(seed)
    return [([r.randrange(100, vocab) for _ in range(r.randint(lo, hi))], r.randint(lo, hi)) for _ in range(n)]


def engine(path: str, dev: torch.device, max_model_len: int, **kw) -> Any:
    """An engine, and the seconds its start took (load, KV sizing, kernels compiled, graphs captured)."""
    from tokenmill.engine.engine import LLMEngine
    t = time.perf_counter()
    eng = LLMEngine(path, dtype="bfloat16", device=dev.type, max_model_len=max_model_len, **kw)
    return eng, time.perf_counter() - t


def start_up(eng: Any, seconds: float) -> dict[str, Any]:
    r = eng.runner
    return {"start_s": seconds, "capture_s": getattr(r, "capture_seconds", 0.0),
            "graph_memory_gib": getattr(r, "graph_memory_bytes", 0) / 2 ** 30,
            "graph_sizes": len(getattr(r, "graphs", {})), "kv_cache": eng.kv_cache_info().describe()}


def run_one(eng: Any, prompt: list[int], out: int) -> tuple[float, list[float]]:
    """One request alone through the engine's steps: its TTFT and the gaps between its tokens (seconds)."""
    from tokenmill import SamplingParams
    eng.add_request(str(time.monotonic()), {"prompt_token_ids": prompt},
                    SamplingParams(temperature=0, max_tokens=out, ignore_eos=True))
    stamps = [time.perf_counter()]
    while eng.has_unfinished_requests():
        eng.step()
        stamps.append(time.perf_counter())
    return stamps[1] - stamps[0], [b - a for a, b in zip(stamps[1:], stamps[2:])]


def host_profile(fn: Callable[[], Any], top: int = 30, sort: str = "tottime") -> list[str]:
    """Where fn spends host time: cProfile's functions, the heaviest first (what to cut when the busy fraction is
    low)."""
    import cProfile
    import io
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats(sort).print_stats(top)
    return [line for line in buf.getvalue().splitlines() if line.strip()]


def kernel_table(eng: Any, steps: int, top: int = 15) -> dict[str, Any]:
    """steps engine steps under torch's profiler: the device's busy share of their wall time, and the kernels that
    took the most device time (name, launches, milliseconds in all)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    by_name: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            acc = by_name.setdefault(e.name[:90], [0, 0.0])
            acc[0] += 1
            acc[1] += e.device_time / 1e3
    busy = sum(ms for _, ms in by_name.values()) / 1e3 / wall
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {"steps": steps, "wall_ms": 1e3 * wall, "busy": busy,
            "kernels": [{"name": k, "launches": n, "ms": round(ms, 3)} for k, (n, ms) in rows]}


def batch_profile(eng: Any, dev: torch.device, n: int, prompt: int, vocab: int) -> dict[str, Any]:
    """n requests decoding together: where a step's time goes on the device (kernel table) and on the host."""
    from tokenmill import SamplingParams
    r = random.Random(7)
    for i in range(n):
        eng.add_request(f"prof{i}", {"prompt_token_ids": [r.randrange(100, vocab) for _ in range(prompt)]},
                        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    before = eng.stats.decode_tokens
    while eng.stats.decode_tokens - before < 2 * n:        # every prompt in, two decode steps made
        eng.step()
    res = kernel_table(eng, 8) if dev.type == "cuda" else {}
    res["host_profile"] = host_profile(lambda: [eng.step() for _ in range(8)])
    while eng.has_unfinished_requests():
        eng.step()
    return res


def busy_fraction(eng: Any, dev: torch.device, prompt: list[int], steps: int) -> Optional[float]:
    """The device's kernel time over the wall time of a single stream's decode steps (torch's profiler)."""
    if dev.type != "cuda":
        return None
    from tokenmill import SamplingParams
    eng.add_request("busy", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=steps + 8,
                                                                         ignore_eos=True))
    for _ in range(4):                       # the prompt, then decode steps in their steady state
        eng.step()
    busy = kernel_table(eng, steps)["busy"]
    while eng.has_unfinished_requests():
        eng.step()
    return busy


def single_stream(eng: Any, dev: torch.device, prompt: int, out: int) -> dict[str, Any]:
    """The first request's TTFT after start, then a warm TTFT and the inter-token latency of one request alone,
    and the device's busy fraction of its decode steps; again with async scheduling where the runner has it."""
    res: dict[str, Any] = {}
    res["first_ttft_s"], _ = run_one(eng, list(range(100, 100 + prompt)), 2)
    ttft, gaps = run_one(eng, list(range(200, 200 + prompt)), out)
    # the first prompt of another length (not a multiple of 16), under cProfile: whether a new length costs a
    # first-use price again, and where it goes
    odd: list = []
    res["odd_profile"] = host_profile(lambda: odd.append(run_one(eng, list(range(600, 600 + prompt - 37)), 2)), 25,
                                      "cumtime")
    res["odd_ttft_s"] = odd[0][0]
    gaps.sort()
    res.update(ttft_s=ttft, itl_s=gaps[len(gaps) // 2], graph_steps=eng.stats.num_graph_steps)
    res["busy"] = busy_fraction(eng, dev, list(range(300, 300 + prompt)), 32)
    res["host_profile"] = host_profile(lambda: run_one(eng, list(range(350, 350 + prompt)), 32))
    if getattr(eng.runner, "supports_async", False):       # the same engine, each step launched ahead
        with async_scheduling(eng):
            _, gaps = run_one(eng, list(range(400, 400 + prompt)), out)
            gaps.sort()
            res["async_itl_s"] = gaps[len(gaps) // 2]
            res["async_busy"] = busy_fraction(eng, dev, list(range(500, 500 + prompt)), 32)
    return res


@contextlib.contextmanager
def async_scheduling(eng: Any) -> Iterator[None]:
    sc = eng.config.scheduler_config
    eng.config = dataclasses.replace(eng.config, scheduler_config=dataclasses.replace(sc, async_scheduling=True))
    try:
        yield
    finally:
        eng.config = dataclasses.replace(eng.config, scheduler_config=sc)


def decode_batch(eng: Any, n: int, prompt: int, out: int, vocab: int) -> dict[str, Any]:
    """n requests at once: tokens a second of the steps that only decode (the engine's counters over this run)."""
    from tokenmill import SamplingParams
    r = random.Random(5)
    before = dataclasses.replace(eng.stats)
    for i in range(n):
        eng.add_request(f"batch{i}", {"prompt_token_ids": [r.randrange(100, vocab) for _ in range(prompt)]},
                        SamplingParams(temperature=0, max_tokens=out, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    st = eng.stats
    return {"requests": n, "decode_tok_s": (st.decode_tokens - before.decode_tokens)
            / (st.decode_time_s - before.decode_time_s), "graph_steps": st.num_graph_steps - before.num_graph_steps,
            "eager_decode_steps": st.num_eager_decode_steps - before.num_eager_decode_steps,
            "preemptions": st.num_preemptions - before.num_preemptions, "mean_context": prompt + out / 2}


def quant_itl(eng: Any, prompt: int, out: int) -> float:
    """One warm request's median inter-token latency, in seconds."""
    run_one(eng, list(range(100, 100 + prompt)), 2)
    _, gaps = run_one(eng, list(range(200, 200 + prompt)), out)
    return sorted(gaps)[len(gaps) // 2]


def offline(path: str, dev: torch.device, reqs: list[tuple[list[int], int]], **kw) -> float:
    """Generated tokens a second of tokenmill over the whole workload."""
    from tokenmill import LLM, SamplingParams
    llm = LLM(path, dtype="bfloat16", device=dev.type, **kw)
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)


def transformers_offline(path: str, dev: torch.device, reqs: list[tuple[list[int], int]], batch: int) -> float:
    """Useful generated tokens a second of transformers: batches of similar prompt length, left-padded, its static
    cache and torch.compile; a batch runs to its longest output, the rest of each row counted as waste. Its cache
    length follows each batch's longest prompt and output, so the compiled step may be rebuilt per batch: the
    first batch is untimed, the rest are counted as they come."""
    from transformers import AutoModelForCausalLM, StaticCache
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(dev).eval()
    # one static cache of one shape for every batch, so that the decoding step generate() compiles on a GPU
    # (torch.compile) is built once; the last batch is padded to full size with copies (not counted)
    longest = max(len(p) for p, _ in reqs) + max(n for _, n in reqs)
    cache = StaticCache(config=model.config, max_cache_len=longest, max_batch_size=batch)
    order = sorted(range(len(reqs)), key=lambda i: len(reqs[i][0]))
    useful, t = 0, None
    for b0 in range(0, len(order), batch):
        rows = [reqs[i] for i in order[b0:b0 + batch]]
        real = len(rows)
        rows += [rows[-1]] * (batch - real)
        width = max(len(p) for p, _ in rows)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in rows], device=dev)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in rows], device=dev)
        with torch.no_grad():
            if t is None:                # the first batch compiles: not timed
                cache.reset()
                model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                               past_key_values=cache)
                t = time.perf_counter()
            cache.reset()
            model.generate(ids, attention_mask=mask, max_new_tokens=max(n for _, n in rows), do_sample=False,
                           pad_token_id=0, eos_token_id=None, past_key_values=cache)
        useful += sum(n for _, n in rows[:real])
    return useful / (time.perf_counter() - t)


def offload_moves(dev: torch.device, tiny: bool) -> dict[str, Any]:
    """The host tier's save and restore of 256 blocks, and the raw host-to-device copy of as many bytes."""
    from tokenmill.engine.kv_offload import BlockCodec
    from tokenmill.executor.kv_cache import LayerKV
    layers, heads, dim, blocks = (4, 2, 64, 32) if tiny else (32, 8, 128, 256)
    bs = 16
    caches = [LayerKV.allocate(2 * blocks * bs, heads, dim, "bfloat16", dev) for _ in range(layers)]
    for c in caches:
        c.k.normal_()
        c.v.normal_()
    codec = BlockCodec([t for c in caches for t in c.slot_tensors()], bs)
    ids = list(range(0, 2 * blocks, 2))
    nbytes = codec.nbytes * blocks
    payloads = codec.read(ids)
    save = timed(lambda: codec.read(ids), dev, 3)
    restore = timed(lambda: codec.write(ids, payloads), dev, 3)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    pinned = pageable.pin_memory() if dev.type == "cuda" else pageable
    raw_pinned = timed(lambda: pinned.to(dev, non_blocking=True, copy=True), dev, 3)
    raw_pageable = timed(lambda: pageable.to(dev, copy=True), dev, 3)
    gbs = lambda t: nbytes / t / 1e9     # noqa: E731
    return {"blocks": blocks, "bytes": nbytes, "save_gbs": gbs(save), "restore_gbs": gbs(restore),
            "pinned_h2d_gbs": gbs(raw_pinned), "pageable_h2d_gbs": gbs(raw_pageable),
            "restore_over_pinned": raw_pinned / restore}


def kv_bytes_per_token(shape: dict) -> int:
    """bf16 K and V of every layer."""
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    return 2 * 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * head_dim


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--eager", action="store_true", help="every step eager (enforce_eager): the graphs' A/B")
    ap.add_argument("--skip", nargs="*", default=[], choices=PARTS)
    ap.add_argument("--quant", default="int4,int8,fp8", help="the quant part's methods, comma-separated")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.quick:
        a.skip = sorted(set(a.skip) | {"smollm2"})
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    res: dict[str, Any] = {"machine": device_info(dev), "tiny": a.tiny, "quick": a.quick, "eager": a.eager}
    kw = {"enforce_eager": True} if a.eager else {}
    print(json.dumps(res["machine"]), flush=True)
    bw = bandwidth(dev, a.tiny)
    flops = compute(dev, a.tiny)
    res.update(bandwidth_gbs=bw / 1e9, compute_tflops=flops / 1e12)
    print(f"bandwidth {bw / 1e9:,.0f} GB/s; bf16 matmul {flops / 1e12:,.1f} TFLOP/s", flush=True)

    def save() -> None:
        if a.out:
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(json.dumps(res, indent=1))
    if "kernels" not in a.skip:
        res["matmul_kernels"] = matmul_kernels(dev, a.tiny)
        for r in res["matmul_kernels"]["rows"]:
            print(f"kernel: {r}", flush=True)
        print(f"gemv sweep: {res['matmul_kernels']['gemv_best']}", flush=True)
        save()
    if "offload" not in a.skip:
        res["offload"] = offload_moves(dev, a.tiny)
        print(f"offload: {res['offload']}", flush=True)
        save()
    with tempfile.TemporaryDirectory() as tmp:
        shape = TINY if a.tiny else LLAMA_8B
        prompt, out = (128, 32) if a.tiny else (2048, 128)
        if "8b" not in a.skip or "quant" not in a.skip:
            t = time.perf_counter()
            path, params = random_checkpoint(shape, Path(tmp) / "8b", dev)
            res["checkpoint_s"] = time.perf_counter() - t
        if "8b" not in a.skip:
            n, p_len, n_out = (16, 32, 32) if a.tiny else (256, 128, 256)
            # one engine for both: no prefix caching (each prompt computed whole), room for the 256 requests
            eng, seconds = engine(path, dev, max(prompt + out, p_len + n_out) + 16, enable_prefix_caching=False,
                                  max_num_seqs=n, kv_cache_memory_gb=1 if a.tiny else 16, **kw)
            s = {**start_up(eng, seconds), **single_stream(eng, dev, prompt, out)}
            table = shape["vocab_size"] * shape["hidden_size"]        # the embedding (decode reads one row)
            head = 0 if shape.get("tie_word_embeddings") else table    # the LM head: the last token only
            weights = 2 * (params - table)                              # bf16 weights read once a step
            limit = weights / bw
            heads, layers = shape["num_attention_heads"], shape["num_hidden_layers"]
            head_dim = shape["hidden_size"] // heads
            attention = 2 * layers * heads * head_dim * prompt * prompt    # q.k and p.v, causal (half of 4)
            ttft_limit = (2 * (params - table - head) * prompt + 2 * table + attention) / flops
            res["8b"] = {"params": params, **s, "itl_ms": 1e3 * s["itl_s"], "hbm_limit_ms": 1e3 * limit,
                         "of_limit": limit / s["itl_s"], "prompt": prompt, "ttft_ms": 1e3 * s["ttft_s"],
                         "first_ttft_ms": 1e3 * s["first_ttft_s"], "first_over_warm": s["first_ttft_s"] / s["ttft_s"],
                         "compute_limit_ms": 1e3 * ttft_limit, "ttft_of_limit": ttft_limit / s["ttft_s"]}
            if "async_itl_s" in s:
                res["8b"]["async_of_limit"] = limit / s["async_itl_s"]
            print(f"8b: {res['8b']}", flush=True)
            save()
            d = decode_batch(eng, n, p_len, n_out, shape["vocab_size"])
            step = n / d["decode_tok_s"]
            step_limit = (weights + n * d["mean_context"] * kv_bytes_per_token(shape)) / bw
            res["decode_256"] = {**d, "step_ms": 1e3 * step, "hbm_limit_ms": 1e3 * step_limit,
                                 "of_limit": step_limit / step}
            save()
            if getattr(eng.runner, "supports_async", False):
                with async_scheduling(eng):
                    da = decode_batch(eng, n, p_len, n_out, shape["vocab_size"])
                res["decode_256"]["async_decode_tok_s"] = da["decode_tok_s"]
                res["decode_256"]["async_of_limit"] = step_limit / (n / da["decode_tok_s"])
            res["decode_256"]["profile"] = batch_profile(eng, dev, n, p_len, shape["vocab_size"])
            print(f"decode {n}: {res['decode_256']}", flush=True)
            save()
            del eng
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        if "quant" not in a.skip:
            res["quant"] = {}
            bf16_itl = res.get("8b", {}).get("itl_ms")
            if bf16_itl is None:         # the 8B part skipped: bf16's ITL from this run all the same
                eng, _ = engine(path, dev, prompt + out + 16, enable_prefix_caching=False, max_num_seqs=4,
                                kv_cache_memory_gb=1 if a.tiny else 4, **kw)
                bf16_itl = 1e3 * quant_itl(eng, prompt, out)
                del eng
            for method in a.quant.split(","):
                try:
                    eng, seconds = engine(path, dev, prompt + out + 16, enable_prefix_caching=False, max_num_seqs=4,
                                          kv_cache_memory_gb=1 if a.tiny else 4, quantization=method, **kw)
                except ValueError as e:          # fp8 before compute capability 8.9: refused, and said why
                    res["quant"][method] = {"refused": str(e)}
                    continue
                itl = 1e3 * quant_itl(eng, prompt, out)
                res["quant"][method] = {"start_s": seconds, "itl_ms": itl, "bf16_itl_ms": bf16_itl,
                                        "over_bf16": itl / bf16_itl, "plan": eng.model.ops.describe().get("linear")}
                print(f"quant {method}: {res['quant'][method]}", flush=True)
                del eng
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            save()
        if "moe" not in a.skip:
            mshape = {**TINY, "num_hidden_layers": 2, "num_local_experts": 8, "num_experts_per_tok": 2} if a.tiny \
                else MIXTRAL
            mpath, mparams = random_checkpoint(mshape, Path(tmp) / "moe", dev, "mixtral")
            eng, seconds = engine(mpath, dev, prompt + out + 16, enable_prefix_caching=False, max_num_seqs=4,
                                  kv_cache_memory_gb=1 if a.tiny else 4, **kw)
            itl = quant_itl(eng, prompt, out)
            h, layers = mshape["hidden_size"], mshape["num_hidden_layers"]
            expert = 3 * h * mshape["intermediate_size"] * 2                    # bf16 bytes of one expert
            experts, k = mshape["num_local_experts"], mshape["num_experts_per_tok"]
            table = mshape["vocab_size"] * h
            rest = 2 * (mparams - table) - layers * experts * expert              # attention, norms, router, head
            active = (rest + layers * k * expert) / bw
            total = (rest + layers * experts * expert) / bw
            res["moe"] = {"params": mparams, "start_s": seconds, "itl_ms": 1e3 * itl, "active_limit_ms": 1e3 * active,
                          "total_limit_ms": 1e3 * total, "of_active_limit": active / itl,
                          "fused_moe": eng.model.ops.describe().get("fused_moe"),
                          "eager_decode_steps": eng.stats.num_eager_decode_steps}
            print(f"moe: {res['moe']}", flush=True)
            del eng
            save()
        if "offline-1b" not in a.skip:
            path, _ = random_checkpoint(TINY if a.tiny else LLAMA_1B, Path(tmp) / "1b", dev)
            count = 20 if a.tiny else 300 if a.quick else 1000
            reqs = workload(count, 10 if a.tiny else 100, 40 if a.tiny else 512,
                            TINY["vocab_size"] if a.tiny else LLAMA_1B["vocab_size"])
            ours = offline(path, dev, reqs, max_model_len=1100, kv_cache_memory_gb=1 if a.tiny else 40, **kw)
            res["offline_1b"] = {"requests": count, "tokenmill_tok_s": ours}
            save()
            peer = transformers_offline(path, dev, reqs, 8 if a.tiny else 64)
            res["offline_1b"].update(transformers_tok_s=peer, ratio=ours / peer)
            print(f"offline-1b: {res['offline_1b']}", flush=True)
            save()
        if "smollm2" not in a.skip:
            from tokenmill.executor.loader import default_model_path
            path = default_model_path()
            eng, _ = engine(path, dev, 64 + 256 + 16, enable_prefix_caching=False, kv_cache_memory_gb=1, **kw)
            s = single_stream(eng, dev, 64, 32 if a.tiny else 256)
            reqs = workload(64, 16, 64 if a.tiny else 256, 40000, seed=1)
            res["smollm2"] = {"itl_ms": 1e3 * s["itl_s"], "decode_tok_s": 1 / s["itl_s"],
                              "offline_64_tok_s": offline(path, dev, reqs, max_model_len=600, kv_cache_memory_gb=2,
                                                          **kw)}
            print(f"smollm2: {res['smollm2']}", flush=True)
    save()
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
