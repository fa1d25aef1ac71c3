#!/usr/bin/env python3
"""Single-stream latency of llama.cpp through llama-cpp-python (run with its venv's python), on a GGUF file.

  python peer_latency_llamacpp.py MODEL.gguf INPUT_LEN OUTPUT_LEN THREADS   -> one JSON line
"""
import json
import random
import sys
import time


def main() -> None:
    from llama_cpp import Llama
    path, n_in, n_out, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    r = random.Random(0)
    prompt = [r.randrange(100, 49052) for _ in range(n_in)]
    llm = Llama(model_path=path, n_ctx=4096, n_threads=threads, n_batch=512, verbose=False)
    llm.eval(prompt[:16])                                  # warm-up
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    tok = llm.sample(temp=0.0)
    ttft = time.perf_counter() - t0
    t = time.perf_counter()
    for _ in range(n_out - 1):
        llm.eval([tok])
        tok = llm.sample(temp=0.0)
    dt = time.perf_counter() - t
    print(json.dumps({"engine": "llama.cpp", "ttft_ms": 1000 * ttft, "decode_tok_s": (n_out - 1) / dt}))


if __name__ == "__main__":
    main()
