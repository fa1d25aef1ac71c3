#!/usr/bin/env python3
"""tokenmill against its peers, side by side in one run on this machine, reported as ratios.

  .venv/bin/python benchmarks/run.py [--skip-vllm] [--skip-hf] [--skip-llamacpp] [--llamacpp-venv DIR]
                                     [--out results/NAME.json]

--emulate-avx2 runs every engine as on an AVX2-only x86-64 machine: tokenmill's avx2 kernels
(TOKENMILL_CPU_ISA), MKL, oneDNN and ATen limited to AVX2 (their own environment variables), vLLM told by torch
that there is no AVX-512 (benchmarks/avx2/sitecustomize.py: it loads vllm._C_AVX2), and llama.cpp from a venv
built for AVX2 only (--llamacpp-venv; CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=OFF ...").

Peers (never imported by the package): vLLM's CPU build via ../shared/peers/vllm-cpu, transformers via
../shared/peers/run_hf.py, llama.cpp via llama-cpp-python (installed into $PEERS_DIR/llamacpp on first use).
All read the bundled SmolLM2-135M-Instruct: the GGUF for tokenmill and llama.cpp, the same weights converted
to a bf16 Hugging Face folder for vLLM and transformers.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared" / "peers"
PY = sys.executable
TM = [PY, "-m", "tokenmill.cli"]
PEERS = Path(os.environ.get("PEERS_DIR", "/tmp/tokenmill-peers"))


def sh(cmd: list[str], timeout: int = 3600, env: dict | None = None) -> str:
    print("$ " + " ".join(map(str, cmd)), file=sys.stderr, flush=True)
    res = subprocess.run(list(map(str, cmd)), capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, **(env or {})})
    if res.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed ({res.returncode}): {res.stderr[-2000:]}")
    return res.stdout


PREFIX_PAIRS = 3


def median_pair(pairs: list[dict]) -> dict:
    """The pair whose on/off ratio is the median (an odd count: one of the pairs as measured)."""
    return sorted(pairs, key=lambda p: p["speedup"])[len(pairs) // 2]


def last_json(out: str) -> dict:
    return json.loads([l for l in out.splitlines() if l.startswith("{")][-1])


def read_bandwidth_gbs() -> float:
    """Sustained read bandwidth with all threads: sum a 1 GiB float32 tensor."""
    code = ("import torch,time; x=torch.ones(2**28); x.sum(); t=time.perf_counter()\n"
            "for _ in range(5): x.sum()\n"
            "print(x.numel()*4*5/(time.perf_counter()-t)/1e9)")
    return float(sh([PY, "-c", code]).strip())


def weight_bytes(dtype_bytes: int) -> int:
    """Bytes of weights one decode step reads (every matrix once; the tied embedding as the LM head)."""
    code = ("from tokenmill.executor.loader import default_model_path, open_checkpoint\n"
            "ck=open_checkpoint(default_model_path()); print(sum(t.numel() for _, t in ck.tensors()))")
    return int(sh([PY, "-c", code]).strip()) * dtype_bytes


def packed_bytes_per_step() -> int:
    """Bytes of weights tokenmill's single-stream decode step reads: the GGUF blocks (codes, scales, offsets)
    where a matrix has them, dense float32 where not; embeddings read one row, so they do not count."""
    code = ("from tokenmill import LLM\n"
            "from tokenmill.executor.layers.linear import Linear\n"
            "m = LLM().llm_engine.model; n = 0\n"
            "def size(p): return p.nbytes if hasattr(p, 'nbytes') else sum(t.numel() * t.element_size() for t in (p.codes, p.scale, p.offset) if t is not None)\n"
            "for mod in m.modules():\n"
            "    if isinstance(mod, Linear):\n"
            "        n += size(mod.quant) if mod.quant is not None else mod.weight_t.numel() * 4\n"
            "print(n)")
    return int(sh([PY, "-c", code]).strip().splitlines()[-1])


def startup() -> dict:
    code = ("import time; t=time.perf_counter(); from tokenmill import LLM; llm=LLM(); "
            "print(time.perf_counter()-t)")
    return {"engine_ready_s": float(sh([PY, "-c", code]).strip().splitlines()[-1])}


def serve_first_response_s() -> float:
    import urllib.request
    port = 8765
    t = time.perf_counter()
    proc = subprocess.Popen(TM + ["serve", "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    body = json.dumps({"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": "Hello", "max_tokens": 4}).encode()
    try:
        while time.perf_counter() - t < 120:
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                             {"Content-Type": "application/json"})
                urllib.request.urlopen(req, timeout=30).read()
                return time.perf_counter() - t
            except OSError:
                time.sleep(0.2)
        return float("nan")
    finally:
        proc.terminate()
        proc.wait(30)


def ensure_llamacpp(venv: Path) -> Path | None:
    py = venv / "bin" / "python"
    if not py.exists() or subprocess.run([py, "-c", "import llama_cpp"], capture_output=True).returncode:
        print("installing llama-cpp-python into", venv, "(first use only; builds llama.cpp)", file=sys.stderr)
        subprocess.run(["python3", "-m", "venv", venv], check=True)
        if subprocess.run([venv / "bin" / "pip", "install", "-q", "llama-cpp-python==0.3.36"]).returncode:
            return None
    return py


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-llamacpp", action="store_true")
    ap.add_argument("--emulate-avx2", action="store_true", help="every engine as on an AVX2-only CPU (above)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                    help="tokenmill's dtype (default: the engine's default for this CPU)")
    ap.add_argument("--llamacpp-venv", type=Path, default=PEERS / "llamacpp",
                    help="a venv with llama-cpp-python (made with the PyPI build on first use)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / f"{time.strftime('%Y-%m-%d')}.json"))
    a = ap.parse_args()
    ours_args = ["--dtype", a.dtype] if a.dtype else []
    peer_env: dict = {}
    if a.emulate_avx2:
        os.environ.update(TOKENMILL_CPU_ISA="avx2", MKL_ENABLE_INSTRUCTIONS="AVX2", ONEDNN_MAX_CPU_ISA="AVX2",
                          ATEN_CPU_CAPABILITY="avx2")
        peer_env["PYTHONPATH"] = str(ROOT / "benchmarks" / "avx2")
    work = Path(os.environ.get("TMPDIR", "/tmp")) / "tokenmill-bench"
    work.mkdir(parents=True, exist_ok=True)
    hf_dir = work / "smollm2-hf-bf16"
    if not (hf_dir / "config.json").exists():
        sh(TM + ["convert", hf_dir, "--dtype", "bfloat16"])
    from tokenmill.executor.loader import default_model_path
    gguf = default_model_path()
    wl = work / "offline-64.json"
    sh(TM + ["bench", "workload", "offline-64", "-o", wl])
    wl_prefix = work / "shared-prefix-64.json"
    sh(TM + ["bench", "workload", "shared-prefix-64", "-o", wl_prefix])

    import torch
    from tokenmill.config import default_dtype
    from tokenmill.executor.kernels import machine_record
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), **machine_record(),
                 "tokenmill_dtype": a.dtype or str(default_dtype(torch.device("cpu"))),
                 "emulated_avx2": a.emulate_avx2}
    if not a.skip_llamacpp:
        res["llamacpp_venv"] = str(a.llamacpp_venv)
    # 1. offline throughput, offline-64
    ours = last_json(sh(TM + ["bench", "throughput", "--workload", wl, "--json", "--no-progress", *ours_args]))
    res["offline64"] = {"tokenmill": {k: ours[k] for k in ("generated_tok_s", "total_tok_s", "elapsed_s")}}
    # the same with K/V stored in bfloat16, as the peers store them (an option: not token-exact with float32)
    ours16 = last_json(sh(TM + ["bench", "throughput", "--workload", wl, "--json", "--no-progress",
                                "--kv-cache-dtype", "bfloat16", *ours_args]))
    res["offline64"]["tokenmill_kv_bf16"] = {k: ours16[k] for k in ("generated_tok_s", "total_tok_s", "elapsed_s")}
    if not a.skip_hf:
        hf = last_json(sh([PY, SHARED / "run_hf.py", hf_dir, wl, "16"]))
        res["offline64"]["transformers"] = {"generated_tok_s": hf["gen_tok_s"], "total_tok_s": hf["total_tok_s"]}
    if not a.skip_vllm:
        v = last_json(sh([SHARED / "vllm-cpu", hf_dir, wl], env=peer_env))
        res["offline64"]["vllm"] = {"generated_tok_s": v["gen_tok_s"], "total_tok_s": v["total_tok_s"]}
    # 2. single stream: 256-token prompt, 256 decode steps
    lat = last_json(sh(TM + ["bench", "latency", "--input-len", "256", "--output-len", "256", "--json", *ours_args]))
    bw = read_bandwidth_gbs()
    n_params = weight_bytes(1)
    res["single"] = {"tokenmill": {"ttft_ms": lat["ttft_ms"], "decode_tok_s": lat["decode_tok_s"]},
                     "read_bandwidth_gbs": bw,
                     "bf16_memory_limit_tok_s": bw * 1e9 / (2 * n_params),
                     "fp32_memory_limit_tok_s": bw * 1e9 / (4 * n_params)}
    ours_bytes = packed_bytes_per_step()
    res["single"]["tokenmill"].update(weight_bytes_per_step=ours_bytes, own_memory_limit_tok_s=bw * 1e9 / ours_bytes)
    if not a.skip_vllm:
        py = PEERS / "vllm" / "bin" / "python"
        res["single"]["vllm"] = last_json(sh([py, ROOT / "benchmarks" / "peer_latency_vllm.py", hf_dir, 256, 256],
                                             env={"VLLM_CPU_KVCACHE_SPACE": "4", **peer_env}))
    if not a.skip_llamacpp:
        py = ensure_llamacpp(a.llamacpp_venv)
        if py is not None:
            res["single"]["llama.cpp"] = last_json(sh([py, ROOT / "benchmarks" / "peer_latency_llamacpp.py", gguf,
                                                       256, 256, os.cpu_count()]))
    # 3. prefix caching: 64 requests sharing a 400-token system prompt, caching on vs off. Both sides are ours and
    # this is the noisiest figure (a slow stretch of the host can land on one side of a single pair), so on and
    # off alternate PREFIX_PAIRS times and the speed-up is the median of the pairs' ratios; every pair is kept.
    pairs = []
    for _ in range(PREFIX_PAIRS):
        on = last_json(sh(TM + ["bench", "throughput", "--workload", wl_prefix, "--json", "--no-progress",
                                *ours_args]))
        off = last_json(sh(TM + ["bench", "throughput", "--workload", wl_prefix, "--json", "--no-progress",
                                 "--no-prefix-caching", *ours_args]))
        pairs.append({"on_s": on["elapsed_s"], "off_s": off["elapsed_s"], "speedup": off["elapsed_s"] / on["elapsed_s"]})
    res["prefix_caching"] = {**median_pair(pairs), "pairs": pairs}
    # 4. start-up
    res["startup"] = {**startup(), "serve_first_response_s": serve_first_response_s()}

    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2))
    report(res)


def report(res: dict) -> None:
    print(f"\n{res['machine']} ({res.get('arch', '')}, {res['cores']} cores"
          f"{', emulating an AVX2-only CPU' if res.get('emulated_avx2') else ''}): tokenmill kernels "
          f"{res.get('tokenmill_kernels', '?')}, dtype {res['tokenmill_dtype']}; flags {' '.join(res.get('cpu_flags', []))}")
    o = res["offline64"]
    t = o["tokenmill"]["generated_tok_s"]
    print(f"\noffline-64 generated tok/s: tokenmill {t:.1f}")
    for peer in ("vllm", "transformers"):
        if peer in o:
            print(f"  {peer:13s} {o[peer]['generated_tok_s']:.1f}   ratio {t / o[peer]['generated_tok_s']:.2f}x")
    if "tokenmill_kv_bf16" in o:
        t16 = o["tokenmill_kv_bf16"]["generated_tok_s"]
        print(f"  tokenmill with kv_cache_dtype=bfloat16: {t16:.1f}" + "".join(
            f", {t16 / o[peer]['generated_tok_s']:.2f}x {peer}" for peer in ("vllm", "transformers") if peer in o))
    s = res["single"]
    d = s["tokenmill"]["decode_tok_s"]
    print(f"single stream: tokenmill TTFT {s['tokenmill']['ttft_ms']:.0f} ms, decode {d:.1f} tok/s; "
          f"bf16 memory limit {s['bf16_memory_limit_tok_s']:.0f} tok/s (ratio {d / s['bf16_memory_limit_tok_s']:.2f}), "
          f"fp32 limit {s['fp32_memory_limit_tok_s']:.0f}")
    if "own_memory_limit_tok_s" in s["tokenmill"]:
        print(f"  tokenmill reads {s['tokenmill']['weight_bytes_per_step'] / 1e6:.0f} MB of weights a step (GGUF "
              f"blocks): its own limit {s['tokenmill']['own_memory_limit_tok_s']:.0f} tok/s "
              f"(ratio {d / s['tokenmill']['own_memory_limit_tok_s']:.2f})")
    for peer in ("vllm", "llama.cpp"):
        if peer in s:
            print(f"  {peer:10s} TTFT {s[peer]['ttft_ms']:.0f} ms, decode {s[peer]['decode_tok_s']:.1f} tok/s "
                  f"(decode ratio {d / s[peer]['decode_tok_s']:.2f}x)")
    p = res["prefix_caching"]
    print(f"prefix caching (shared-prefix-64): on {p['on_s']:.1f}s, off {p['off_s']:.1f}s, speed-up {p['speedup']:.2f}x"
          + (" (the median of " + ", ".join(f"{q['speedup']:.2f}x" for q in p["pairs"]) + ")" if "pairs" in p else ""))
    print(f"start-up: engine ready {res['startup']['engine_ready_s']:.1f}s, "
          f"serve's first answer {res['startup']['serve_first_response_s']:.1f}s")


if __name__ == "__main__":
    main()
