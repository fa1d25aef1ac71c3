#!/usr/bin/env python3
"""How far the int8-activation route strays, tokenmill's beside llama.cpp's on the same GGUF file.

  .venv/bin/python benchmarks/int8_route_agreement.py [MODEL.gguf] [--passages 64] [--passage-len 64]
        [--prompt-len 32] [--new 32] [--threads 2] [--llamacpp-venv DIR] [--no-hf] [--out FILE.json]

The passages are consecutive stretches of the project's perplexity text (tokenmill.bench.perplexity), tokenised
by the model's tokenizer, no special tokens; every engine gets the same token ids. Two figures per route:

1. Teacher-forced top-1 agreement with the float route. Every position of every passage is scored with the same
   prefix on both sides; the float route is tokenmill in float32 with int8_activations=False (the dequantised
   weights in float32 arithmetic, token-exact with transformers in the tests). tokenmill's int8 routes score the
   passages in steps of 16 rows (max_num_batched_tokens=16), the rows its int8 kernels take, so that every position
   goes the way a decode step goes; llama.cpp scores them with logits for every position (its matmuls round the
   activations to 8 bits whatever the batch).
2. Greedy agreement with transformers (float32, the GGUF dequantised by transformers' own loader): each passage's
   first --prompt-len tokens continued for --new tokens; a passage agrees when all --new tokens are equal. Also
   the mean index of the first differing token (--new when equal). tokenmill's int8 routes decode at most 16
   requests a step, so that each decode row takes the int8 route as a lone stream's does (the prompt, more rows,
   takes the float route, as it does for a user).

Routes: tokenmill's default (the engine's default dtype for this CPU, int8 activations), tokenmill float32 with
int8 activations, tokenmill's float route itself (greedy only), llama.cpp as llama-cpp-python runs it by default.
Records the machine's CPU model and flags and the kernel variant.
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
sys.path.insert(0, str(ROOT))
PEERS = Path(os.environ.get("PEERS_DIR") or Path(os.environ.get("TMPDIR", "/tmp")) / "tokenmill-peers")

LLAMACPP = r"""
import json, sys
import numpy as np
from llama_cpp import Llama
model, threads, new = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
job = json.load(sys.stdin)
llm = Llama(model_path=model, n_ctx=2 * max(len(p) for p in job["passages"]) + 16, n_threads=threads,
            n_threads_batch=threads, logits_all=True, verbose=False)
top1 = []
for p in job["passages"]:
    llm.reset()
    llm.eval(p)
    top1.append(np.asarray(llm.scores[:len(p) - 1]).argmax(-1).tolist())
greedy = []
for p in job["prompts"]:
    llm.reset()
    llm.eval(p)
    out = []
    for _ in range(new):
        t = int(np.asarray(llm.scores[llm.n_tokens - 1]).argmax())
        out.append(t)
        llm.eval([t])
    greedy.append(out)
print(json.dumps({"top1": top1, "greedy": greedy}))
"""


def passages(tokenizer, n: int, length: int) -> list[list[int]]:
    from tokenmill.bench.perplexity import default_text_path, strip_header
    ids = tokenizer.encode(strip_header(default_text_path().read_text()))
    if len(ids) < n * length:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than {n} passages of {length}")
    step = len(ids) // n
    return [ids[i * step:i * step + length] for i in range(n)]


def engine(model: str, **kw):
    from tokenmill import LLM
    return LLM(model, max_model_len=1024, kv_cache_memory_gb=0.2, enable_prefix_caching=False, **kw)


def tokenmill_top1(model: str, texts: list[list[int]], **kw) -> list[list[int]]:
    """Per passage, the top-1 token after each of its first len - 1 positions (teacher forcing)."""
    from tokenmill.bench.kvquality import score
    return [[max(d, key=d.get) for d in passage] for passage in score(engine(model, **kw), texts)]


def tokenmill_greedy(model: str, prompts: list[list[int]], new: int, **kw) -> list[list[int]]:
    from tokenmill.bench.kvquality import greedy_sequences
    return [s[len(p):] for p, s in zip(prompts, greedy_sequences(engine(model, **kw), prompts, new))]


def hf_greedy(model: str, prompts: list[list[int]], new: int) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM
    path = Path(model)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            g = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                            eos_token_id=None, pad_token_id=0)
            out.append(g[0, len(p):].tolist())
    return out


def top1_agreement(got: list[list[int]], want: list[list[int]]) -> dict:
    pos = sum(len(w) for w in want)
    agree = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
    return {"positions": pos, "agree": agree, "agreement": agree / pos}


def greedy_agreement(got: list[list[int]], want: list[list[int]]) -> dict:
    firsts = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(w)) for g, w in zip(got, want)]
    return {"prompts": len(want), "equal": sum(f == len(w) for f, w in zip(firsts, want)),
            "mean_first_difference": sum(firsts) / len(firsts)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", help="a GGUF file (default: the bundled model)")
    ap.add_argument("--passages", type=int, default=64)
    ap.add_argument("--passage-len", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llamacpp-venv", type=Path, default=PEERS / "llamacpp")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' greedy continuations")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    import torch
    torch.set_num_threads(a.threads)
    from tokenmill.config import default_dtype
    from tokenmill.executor.kernels import machine_record
    from tokenmill.executor.loader import default_model_path
    from tokenmill.tokenizer import load_tokenizer
    model = a.model or str(default_model_path())
    texts = passages(load_tokenizer(model), a.passages, a.passage_len)
    prompts = [p[:a.prompt_len] for p in texts]
    dtype = str(default_dtype(torch.device("cpu"))).replace("torch.", "")
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), **machine_record(), "model": model,
                 "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items() if k != "out"}
                 | {"default_dtype": dtype}}

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    log("float route: teacher-forced top-1")
    want = tokenmill_top1(model, texts, dtype="float32", int8_activations=False)
    routes = {"tokenmill default": dict(dtype=dtype), "tokenmill float32 int8": dict(dtype="float32")}
    res["teacher_forced"] = {}
    for name, kw in routes.items():
        log(f"{name}: teacher-forced top-1, 16-row steps")
        res["teacher_forced"][name] = top1_agreement(tokenmill_top1(model, texts, max_num_batched_tokens=16, **kw),
                                                     want)
    py = a.llamacpp_venv / "bin" / "python"
    peer = None
    if py.exists():
        log("llama.cpp: teacher-forced top-1 and greedy")
        run = subprocess.run([str(py), "-c", LLAMACPP, model, str(a.threads), str(a.new)], text=True,
                             input=json.dumps({"passages": texts, "prompts": prompts}), capture_output=True)
        if run.returncode:
            raise SystemExit(f"llama.cpp failed:\n{run.stderr[-3000:]}")
        peer = json.loads(run.stdout.strip().splitlines()[-1])
        res["teacher_forced"]["llama.cpp"] = top1_agreement(peer["top1"], want)
        res["llamacpp_venv"] = str(a.llamacpp_venv)
    # at most 16 requests a step: a decode step of more rows takes the float route (issue 47, item 4)
    greedy = {name: tokenmill_greedy(model, prompts, a.new, max_num_seqs=16, **kw) for name, kw in routes.items()}
    greedy["tokenmill float route"] = tokenmill_greedy(model, prompts, a.new, dtype="float32",
                                                       int8_activations=False)
    if peer is not None:
        greedy["llama.cpp"] = peer["greedy"]
    if not a.no_hf:
        log("transformers: greedy")
        hf = hf_greedy(model, prompts, a.new)
        res["greedy_vs_transformers"] = {name: greedy_agreement(g, hf) for name, g in greedy.items()}
    res["greedy_vs_float_route"] = {name: greedy_agreement(g, greedy["tokenmill float route"])
                                    for name, g in greedy.items() if name != "tokenmill float route"}
    print(json.dumps(res, indent=1))
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
