#!/usr/bin/env python3
"""tokenmill against llama.cpp on one GGUF file, side by side in one run: load time, prefill, decode, peak RSS.

  .venv/bin/python benchmarks/quant_vs_llamacpp.py MODEL.gguf [--pairs 3] [--threads 2] [--prompt-len 256]
        [--decode-len 64] [--n-ctx 1024] [--kv-cache-memory-gb GB] [--dtype DTYPE] [--tm-opt KEY=VALUE ...]
        [--llamacpp-venv DIR] [--llamacpp-no-mmap] [--emulate-avx2] [--rss-limit-gb GB] [--timeout S]
        [--skip-warmup] [--tm-model PATH] [--out FILE.json]

Every measurement is a fresh child process, llama.cpp's (run with the llama-cpp-python venv's python) and
tokenmill's (this python), in turn: a warm-up pair (not counted; it also brings the file into the page cache),
then --pairs counted pairs, llama.cpp first in each. Each child:
  - loads the model (load_s: from the constructor call to a ready engine, tokenizer included);
  - warms up on another 16-token prompt (1 token out);
  - prefills a --prompt-len prompt of random token ids (the same ids for both; seeded) and takes the first token
    greedily: ttft_s, prefill_tok_s = prompt-len / ttft_s;
  - then decodes --decode-len more tokens greedily, EOS ignored: decode_tok_s = decode-len / their time;
  - reports VmHWM, RssAnon and RssFile from /proc/self/status at the end, the model still loaded.
The parent also takes each child's peak RSS from wait4's rusage (ru_maxrss), and a watchdog kills a child whose
RSS passes --rss-limit-gb (default: 90% of MemAvailable at the start), recording it as failed.

llama.cpp: Llama(model_path, n_ctx=--n-ctx, n_batch=512, n_threads=n_threads_batch=--threads), eval() + sample
(temp 0) as benchmarks/peer_latency_llamacpp.py does, with its default use_mmap=True (--llamacpp-no-mmap: False):
the model file's pages it touches count in its RSS (RssFile), as they would for any process reading the weights
from the mapping, and so do the copies its CPU backend repacks Q4_K and other types into for its kernels
(REPACK in llama.cpp's system info; anonymous memory, RssAnon): on a Q4_K_M file its peak RSS is ~1.75x the file.
tokenmill: LLM(model, max_model_len=--n-ctx, kv_cache_memory_gb=(--n-ctx tokens' worth), **--tm-opt), torch
threads = --threads, token-id prompts, SamplingParams(temperature=0, ignore_eos=True, detokenize=False) through
generate_stream, timed from outside the same way (wall clock around the call, first token and last token as they
arrive).

--tm-model PATH gives tokenmill another model than llama.cpp's GGUF, e.g. a GPTQ folder of the same weights
(benchmarks/gptq_vs_llamacpp.py); MODEL.gguf still sizes tokenmill's KV budget (the same shape).

Prints one JSON (and writes it to --out): the machine (CPU model and SIMD flags, as benchmarks/run.py records
it), the settings, per engine each run and the median/min/max of every figure, and the per-pair ratios
tokenmill / llama.cpp (speeds: > 1 means tokenmill is faster; RSS and load time: < 1 means tokenmill is smaller).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEERS = Path(os.environ.get("PEERS_DIR") or Path(os.environ.get("TMPDIR", "/tmp")) / "tokenmill-peers")
AVX2_ENV = {"TOKENMILL_CPU_ISA": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2",
            "ATEN_CPU_CAPABILITY": "avx2"}
FIGURES = ("load_s", "ttft_s", "prefill_tok_s", "decode_tok_s", "peak_rss_gb")
WARMUP_LEN = 16


# ---- children ------------------------------------------------------------------------------------------------
def prompts(n: int, vocab: int) -> tuple[list[int], list[int]]:
    """The measured prompt and a different warm-up prompt (no shared prefix: no prefix-cache hit)."""
    hi = min(vocab, 128000)                 # below Llama 3's special tokens
    lo = 256 if hi > 1024 else 0
    r = random.Random(0)
    main = [r.randrange(lo, hi) for _ in range(n)]
    r = random.Random(1)
    warm = [r.randrange(lo, hi) for _ in range(WARMUP_LEN)]
    if warm[0] == main[0]:
        warm[0] = lo + (warm[0] + 1 - lo) % (hi - lo)
    return main, warm


def proc_status() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[k] = int(v.split()[0]) * 1024           # kB -> bytes
    return out


def child_llamacpp(a: argparse.Namespace) -> dict:
    import llama_cpp
    from llama_cpp import Llama
    t = time.perf_counter()
    llm = Llama(model_path=a.model, n_ctx=a.n_ctx, n_batch=512, n_threads=a.threads, n_threads_batch=a.threads,
                use_mmap=not a.llamacpp_no_mmap, verbose=False)
    load = time.perf_counter() - t
    prompt, warm = prompts(a.prompt_len, llm.n_vocab())
    llm.eval(warm)                                            # warm-up
    llm.sample(temp=0.0)
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    tok = llm.sample(temp=0.0)
    ttft = time.perf_counter() - t0
    out = [int(tok)]
    t1 = time.perf_counter()
    for _ in range(a.decode_len):
        llm.eval([tok])
        tok = llm.sample(temp=0.0)
        out.append(int(tok))
    dec = time.perf_counter() - t1
    status = proc_status()                                    # while the model is still loaded
    info = llama_cpp.llama_print_system_info()
    return {"load_s": load, "ttft_s": ttft, "decode_s": dec, "tokens": out, "proc_status": status,
            "system_info": info.decode() if isinstance(info, bytes) else str(info),
            "llama_cpp_version": getattr(llama_cpp, "__version__", None)}


def kv_gb_for(model: str, n_ctx: int, opts: dict) -> float:
    """A KV budget of n_ctx tokens (+2 blocks of 16) in tokenmill's KV dtype, as llama.cpp's n_ctx sizes its own
    cache (F16 K and V): the two caches then weigh about the same in the RSS."""
    import torch
    from tokenmill.config import _DTYPES, resolve_dtype
    from tokenmill.executor.loader.gguf import open_gguf
    md = open_gguf(model).metadata
    arch = md["general.architecture"]

    def get(key, default=None):
        v = md.get(f"{arch}.{key}", default)
        return v[0] if isinstance(v, list) else v

    heads = get("attention.head_count")
    head_dim = get("attention.key_length") or get("embedding_length") // heads
    kv_dt = opts.get("kv_cache_dtype", "auto")
    dt = resolve_dtype(opts.get("dtype"), torch.device("cpu")) if kv_dt == "auto" else _DTYPES[kv_dt]
    per_token = get("block_count") * 2 * get("attention.head_count_kv", heads) * head_dim * dt.itemsize
    return per_token * (n_ctx + 32) / 2 ** 30


def source_digest() -> str:
    """A digest of tokenmill's sources as this child ran them (a working tree edited mid-run shows here)."""
    import hashlib
    h = hashlib.sha1()
    pkg = ROOT / "tokenmill"
    for f in sorted(pkg.rglob("*")):
        if f.suffix in (".py", ".c", ".h") and f.is_file():
            h.update(str(f.relative_to(pkg)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:12]


def child_tokenmill(a: argparse.Namespace) -> dict:
    import torch
    torch.set_num_threads(a.threads)
    from tokenmill import LLM, SamplingParams
    opts: dict = {"max_model_len": a.n_ctx}
    if a.dtype:
        opts["dtype"] = a.dtype
    for kv in a.tm_opt:
        k, _, v = kv.partition("=")
        try:
            opts[k] = json.loads(v)
        except json.JSONDecodeError:
            opts[k] = v
    opts.setdefault("kv_cache_memory_gb", a.kv_cache_memory_gb or kv_gb_for(a.model, a.n_ctx, opts))
    digest = source_digest()
    t = time.perf_counter()
    llm = LLM(a.tm_model or a.model, **opts)
    load = time.perf_counter() - t
    prompt, warm = prompts(a.prompt_len, llm.model_config.vocab_size)

    def params(n: int):
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)

    llm.generate([{"prompt_token_ids": warm}], params(1), use_tqdm=False)   # warm-up
    out: list[int] = []
    t0 = time.perf_counter()
    t_first = t_last = None
    for piece in llm.generate_stream({"prompt_token_ids": prompt}, params(a.decode_len + 1)):
        if piece.token_ids:
            now = time.perf_counter()
            if t_first is None:
                t_first = now
            t_last = now
            out.extend(piece.token_ids)
    if t_first is None or len(out) != a.decode_len + 1:
        raise RuntimeError(f"expected {a.decode_len + 1} tokens, got {len(out)}")
    status = proc_status()                                    # while the model is still loaded
    eng = llm.llm_engine
    return {"load_s": load, "ttft_s": t_first - t0, "decode_s": t_last - t_first, "tokens": out, "proc_status": status,
            "dtype": str(eng.config.dtype), "cpu_kernels": eng.config.cpu_kernels, "source_digest": digest,
            "engine_options": {k: v for k, v in opts.items()}}


def child_main(a: argparse.Namespace) -> None:
    res = child_llamacpp(a) if a.child == "llamacpp" else child_tokenmill(a)
    res["prefill_tok_s"] = a.prompt_len / res["ttft_s"]
    res["decode_tok_s"] = a.decode_len / res["decode_s"]
    print("RESULT " + json.dumps(res), flush=True)
    os._exit(0)                                               # no teardown of the engines: nothing to time there


# ---- parent --------------------------------------------------------------------------------------------------
def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 8 * 2 ** 30


def rss_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_child(engine: str, a: argparse.Namespace, py: str, env: dict) -> dict:
    """One child: its RESULT line, plus its peak RSS from wait4; a failure is recorded, not raised."""
    cmd = [py, str(Path(__file__).resolve()), a.model, "--child", engine, "--threads", str(a.threads),
           "--prompt-len", str(a.prompt_len), "--decode-len", str(a.decode_len), "--n-ctx", str(a.n_ctx)]
    if a.kv_cache_memory_gb:
        cmd += ["--kv-cache-memory-gb", str(a.kv_cache_memory_gb)]
    if a.llamacpp_no_mmap:
        cmd += ["--llamacpp-no-mmap"]
    if a.tm_model:
        cmd += ["--tm-model", a.tm_model]
    if a.dtype:
        cmd += ["--dtype", a.dtype]
    for kv in a.tm_opt:
        cmd += ["--tm-opt", kv]
    limit = int(a.rss_limit_gb * 2 ** 30)
    load_before = os.getloadavg()[0]           # other work on the machine shows here (and in a low cpu_s / wall_s)
    with tempfile.TemporaryFile("w+") as out:
        t = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT))
        why: list[str] = []
        done = threading.Event()

        def watch() -> None:
            while not done.wait(0.1):
                if rss_of(p.pid) > limit:
                    why.append(f"RSS passed --rss-limit-gb {a.rss_limit_gb:.1f}")
                elif time.perf_counter() - t > a.timeout:
                    why.append(f"ran past --timeout {a.timeout} s")
                else:
                    continue
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except OSError:
                    pass
                return

        w = threading.Thread(target=watch, daemon=True)
        w.start()
        try:
            _, status, ru = os.wait4(p.pid, 0)
        except BaseException:                                 # interrupted: take the child down too
            p.kill()
            raise
        done.set()
        w.join()
        p.returncode = os.waitstatus_to_exitcode(status)      # reaped here, so Popen must not wait again
        wall = time.perf_counter() - t
        out.seek(0)
        text = out.read()
    res: dict = {"engine": engine, "wall_s": wall, "exit": p.returncode,
                 "peak_rss_gb": ru.ru_maxrss * 1024 / 2 ** 30,          # Linux: ru_maxrss in KiB
                 "cpu_s": ru.ru_utime + ru.ru_stime, "loadavg_1m_before": load_before}
    lines = [l for l in text.splitlines() if l.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        res["error"] = (why[0] + "; " if why else "") + f"exit {p.returncode}: " + text[-2000:]
        return res
    r = json.loads(lines[-1][len("RESULT "):])
    st = r.pop("proc_status")
    res.update(r)
    res["vm_hwm_gb"] = st.get("VmHWM", 0) / 2 ** 30
    res["rss_anon_end_gb"] = st.get("RssAnon", 0) / 2 ** 30
    res["rss_file_end_gb"] = st.get("RssFile", 0) / 2 ** 30
    return res


def summary(vals: list[float]) -> dict:
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)} if vals else {}


def machine() -> dict:
    from tokenmill.executor.kernels import machine_record
    return {**machine_record(), "mem_total_gb": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30}


def gguf_summary(path: str) -> dict:
    from collections import Counter
    from tokenmill.executor.loader.gguf import open_gguf
    f = open_gguf(path)
    types = Counter(t.type_name for t in f.tensors.values())
    nbytes: Counter = Counter()
    for t in f.tensors.values():
        nbytes[t.type_name] += t.n_bytes
    md = f.metadata
    return {"file": os.path.abspath(path), "file_bytes": os.path.getsize(path),
            "architecture": md.get("general.architecture"), "name": md.get("general.name"),
            "file_type": md.get("general.file_type"),
            "tensor_types": dict(types), "tensor_bytes_by_type": dict(nbytes),
            "block_count": md.get("llama.block_count"), "embedding_length": md.get("llama.embedding_length")}


def tm_model_summary(path: str) -> dict:
    """--tm-model: a GGUF's summary, or a HF folder's bytes on disk and quantization_config."""
    if path.endswith(".gguf"):
        return gguf_summary(path)
    files = [f for f in Path(path).iterdir() if f.is_file()]
    cfg = json.loads((Path(path) / "config.json").read_text())
    return {"folder": path, "safetensors_bytes": sum(f.stat().st_size for f in files if f.suffix == ".safetensors"),
            "quantization_config": cfg.get("quantization_config")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a GGUF file")
    ap.add_argument("--pairs", type=int, default=3, help="counted pairs after the warm-up pair")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--decode-len", type=int, default=64, help="tokens decoded after the first")
    ap.add_argument("--n-ctx", type=int, default=1024, help="llama.cpp's n_ctx and tokenmill's max_model_len")
    ap.add_argument("--kv-cache-memory-gb", type=float, default=None,
                    help="tokenmill's KV cache budget (default: --n-ctx tokens in its KV dtype, as llama.cpp's n_ctx)")
    ap.add_argument("--dtype", default=None, help="tokenmill's dtype (default: the engine's default for this CPU)")
    ap.add_argument("--tm-opt", action="append", default=[], metavar="KEY=VALUE",
                    help="another LLM(...) option for tokenmill (VALUE parsed as JSON when it parses)")
    ap.add_argument("--llamacpp-venv", type=Path, default=None,
                    help=f"venv with llama-cpp-python (default {PEERS}/llamacpp, or llamacpp-avx2 with --emulate-avx2)")
    ap.add_argument("--llamacpp-no-mmap", action="store_true",
                    help="llama.cpp with use_mmap=False (reads the weights into its own buffers)")
    ap.add_argument("--emulate-avx2", action="store_true",
                    help="as benchmarks/run.py: tokenmill's avx2 kernels, MKL/oneDNN/ATen at AVX2, "
                         "llama.cpp's AVX2 build")
    ap.add_argument("--rss-limit-gb", type=float, default=None,
                    help="kill a child past this RSS (default: 90%% of MemAvailable now)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds a child may run")
    ap.add_argument("--skip-warmup", action="store_true", help="no warm-up pair")
    ap.add_argument("--tm-model", default=None,
                    help="tokenmill's model, if not the GGUF (a HF folder, e.g. GPTQ, of the same weights)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--child", choices=["llamacpp", "tokenmill"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child_main(a)
        return

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed run takes its running child with it
    a.model = os.path.abspath(a.model)
    if a.tm_model:
        a.tm_model = os.path.abspath(a.tm_model)
    venv = a.llamacpp_venv or PEERS / ("llamacpp-avx2" if a.emulate_avx2 else "llamacpp")
    peer_py = venv / "bin" / "python"
    if not peer_py.exists():
        sys.exit(f"no llama-cpp-python at {peer_py}: benchmarks/run.py installs it there, or pass --llamacpp-venv")
    if a.rss_limit_gb is None:
        a.rss_limit_gb = 0.9 * mem_available() / 2 ** 30
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    if a.emulate_avx2:
        env.update(AVX2_ENV)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))

    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), **machine(), "model": gguf_summary(a.model),
                 "settings": {"pairs": a.pairs, "threads": a.threads, "prompt_len": a.prompt_len,
                              "decode_len": a.decode_len, "n_ctx": a.n_ctx, "llamacpp_n_batch": 512,
                              "llamacpp_use_mmap": not a.llamacpp_no_mmap,
                              "tokenmill_kv_cache_memory_gb": a.kv_cache_memory_gb or "n_ctx tokens",
                              "tokenmill_dtype": a.dtype, "tokenmill_opts": a.tm_opt,
                              "emulated_avx2": a.emulate_avx2, "tokenmill_model": a.tm_model or a.model,
                              "llamacpp_venv": str(venv), "rss_limit_gb": a.rss_limit_gb},
                 "notes": ["llama.cpp runs with use_mmap=True (its default) unless --llamacpp-no-mmap: the model "
                           "file's pages it touched count in its RSS (rss_file_end_gb), and so do the copies its CPU "
                           "backend repacks some weight types into (REPACK, anonymous memory: rss_anon_end_gb)",
                           "peak_rss_gb: the child's ru_maxrss from wait4; vm_hwm_gb: VmHWM read by the child at "
                           "its end",
                           "ratios are tokenmill / llama.cpp per pair: speeds > 1 and RSS or load time < 1 favour "
                           "tokenmill"]}
    if a.tm_model:
        res["tokenmill_model"] = tm_model_summary(a.tm_model)
    engines = {"llama.cpp": ("llamacpp", str(peer_py)), "tokenmill": ("tokenmill", sys.executable)}
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    pairs: list[dict] = []
    schedule = ([] if a.skip_warmup else [True]) + [False] * a.pairs
    for i, warm in enumerate(schedule):
        pair = {}
        for name, (kind, py) in engines.items():
            label = "warm-up" if warm else f"pair {i + (1 if a.skip_warmup else 0)}/{a.pairs}"
            print(f"[{time.strftime('%H:%M:%S')}] {label}: {name} ...", file=sys.stderr, flush=True)
            r = run_child(kind, a, py, env)
            r["warmup"] = warm
            if "error" in r:
                print(f"  {name} FAILED: {r['error'][-600:]}", file=sys.stderr, flush=True)
            else:
                print(f"  {name}: load {r['load_s']:.1f} s, TTFT {r['ttft_s'] * 1000:.0f} ms "
                      f"({r['prefill_tok_s']:.1f} tok/s), decode {r['decode_tok_s']:.2f} tok/s, "
                      f"peak RSS {r['peak_rss_gb']:.2f} GiB (file {r['rss_file_end_gb']:.2f}, "
                      f"anon {r['rss_anon_end_gb']:.2f} at the end); cpu/wall {r['cpu_s'] / r['wall_s']:.2f}, "
                      f"load average before {r['loadavg_1m_before']:.1f}", file=sys.stderr, flush=True)
            runs[name].append(r)
            pair[name] = r
        if not warm:
            pairs.append(pair)

    res["runs"] = runs
    res["summary"] = {}
    for name in engines:
        ok = [r for r in runs[name] if not r["warmup"] and "error" not in r]
        res["summary"][name] = {k: summary([r[k] for r in ok]) for k in FIGURES}
        res["summary"][name]["failed_runs"] = sum(1 for r in runs[name] if not r["warmup"] and "error" in r)
    ratios: dict[str, list[float]] = {k: [] for k in FIGURES}
    for p in pairs:
        x, y = p["tokenmill"], p["llama.cpp"]
        if "error" in x or "error" in y:
            continue
        for k in FIGURES:
            ratios[k].append(x[k] / y[k])
    res["ratios_tokenmill_over_llamacpp"] = {k: {**summary(v), "pairs": v} for k, v in ratios.items()}
    infos = {r["system_info"] for r in runs["llama.cpp"] if r.get("system_info")}
    res["llamacpp_system_info"] = sorted(infos)
    if a.emulate_avx2 and any("AVX512 = 1" in i for i in infos):
        res["notes"].append(f"--emulate-avx2, but the llama.cpp in {venv} reports AVX512 = 1: it is not an "
                            "AVX2-only build (CMAKE_ARGS=\"-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=OFF\")")
    digests = {r.get("source_digest") for r in runs["tokenmill"] if r.get("source_digest")}
    res["tokenmill_source_digests"] = sorted(digests)
    if len(digests) > 1:
        res["notes"].append("tokenmill's sources changed during the run (several source digests): the runs "
                            "did not all time the same code")
    res["same_greedy_tokens"] = {n: len({tuple(r["tokens"]) for r in runs[n] if "tokens" in r}) == 1 for n in engines}
    if all(runs[n] and "tokens" in runs[n][0] for n in engines):
        a_, b_ = runs["llama.cpp"][0]["tokens"], runs["tokenmill"][0]["tokens"]
        res["first_tokens_agree"] = next((i for i, (u, v) in enumerate(zip(a_, b_)) if u != v), len(a_))
    m = res["ratios_tokenmill_over_llamacpp"]
    if all(m[k].get("n") for k in ("decode_tok_s", "prefill_tok_s", "peak_rss_gb")):
        res["targets"] = {"peak_rss_at_most_1.15x": m["peak_rss_gb"]["median"] <= 1.15,
                          "decode_at_least_1x": m["decode_tok_s"]["median"] >= 1.0,
                          "prefill_at_least_1x": m["prefill_tok_s"]["median"] >= 1.0}
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
