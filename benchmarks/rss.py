#!/usr/bin/env python3
"""Peak resident memory of the bundled model, tokenmill against llama.cpp, side by side in one run: each a fresh
process that loads the bundled GGUF with its defaults, generates 8 tokens greedily, and reports its peak RSS
(VmHWM) and its anonymous and file-backed RSS at the end, each over its own bare interpreter's.

  .venv/bin/python benchmarks/rss.py [--pairs 3] [--idle-s 20] [--llamacpp-venv DIR] [--tokenmill-root DIR]
      [--out FILE.json]

tokenmill: LLM() with every default (the KV budget a share of free memory, as a user gets it), torch threads 2.
Its breakdown, from the same process: torch and tokenmill imported, the model's tensors (weights and the kernels'
layouts of them), the KV cache's planes made resident (PageToucher's offset), and the rest. llama.cpp:
llama_cpp.Llama(model_path) with its defaults (n_ctx 512, mmap), n_threads 2. --tokenmill-root runs another
checkout's tokenmill (a before/after pair).

Served: `tokenmill serve` with its defaults, one completion of 8 tokens through HTTP, then --idle-s seconds idle (a
server faults its KV cache in between requests), its peak RSS read from /proc at the end."""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PEERS = Path(os.environ.get("PEERS_DIR") or Path(os.environ.get("TMPDIR", "/tmp")) / "tokenmill-peers")
PROMPT = "The capital of France is"

CHILD = r'''
import json, sys, dataclasses
def status():
    keys = ("VmHWM", "VmRSS", "RssAnon", "RssFile")
    return {l.split(":")[0]: int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(keys)}
which, gguf, prompt = sys.argv[1:4]
if which == "bare":
    print("RESULT", json.dumps(status()))
    sys.exit()
if which == "llamacpp":
    from llama_cpp import Llama
    m = Llama(model_path=gguf, n_threads=2, verbose=False)
    text = m(prompt, max_tokens=8, temperature=0)["choices"][0]["text"]
    print("RESULT", json.dumps({**status(), "text": text}))
    sys.exit()
import torch
torch.set_num_threads(2)
imported_torch = status()["VmRSS"]
from tokenmill import LLM, SamplingParams
imported = status()["VmRSS"]
llm = LLM()
out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
runner = llm.llm_engine.runner
storages = {}
def add(t):
    if isinstance(t, torch.Tensor) and t.device.type == "cpu":
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    elif dataclasses.is_dataclass(t) and not isinstance(t, type):
        for f in dataclasses.fields(t):
            add(getattr(t, f.name))
    elif isinstance(t, (list, tuple)):
        for x in t:
            add(x)
for m in runner.model.modules():
    for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)) + list(vars(m).values()):
        add(t)
pages = runner.kv_pages
print("RESULT", json.dumps({**status(), "text": out[0].outputs[0].text, "torch_imported": imported_torch,
                            "tokenmill_imported": imported, "model_tensors": sum(storages.values()),
                            "kv_budget": pages.total * len(pages.tensors), "kv_touched": pages.resident_bytes}))
'''


def child(python: str, which: str, gguf: str, env: dict) -> dict:
    p = subprocess.run([python, "-c", CHILD, which, gguf, PROMPT], capture_output=True, text=True, env=env, timeout=600)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if p.returncode or line is None:
        raise RuntimeError(f"{which} failed ({p.returncode}): {p.stderr[-2000:]}")
    return json.loads(line[7:])


def served(env: dict, idle_s: float) -> dict:
    """`tokenmill serve`'s peak RSS after one request and idle_s seconds idle, and its RSS then."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-c", "from tokenmill.cli import main; main()", "serve", "--port",
                             str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("tokenmill serve did not come up") from None
                time.sleep(0.5)
        with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
            model = json.loads(r.read())["data"][0]["id"]
        body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}).encode()
        req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            text = json.loads(r.read())["choices"][0]["text"]
        time.sleep(idle_s)
        st = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in open(f"/proc/{proc.pid}/status")
              if ln.startswith(("VmHWM", "VmRSS", "RssAnon", "RssFile"))}
        return {**st, "text": text, "idle_s": idle_s}
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> None:
    from tokenmill.executor.kernels import machine_record
    from tokenmill.executor.loader import default_model_path
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--llamacpp-venv", type=Path, default=PEERS / "llamacpp")
    ap.add_argument("--tokenmill-root", type=Path, default=ROOT)
    ap.add_argument("--idle-s", type=float, default=20.0)
    ap.add_argument("--out")
    a = ap.parse_args()
    gguf = str(default_model_path())
    llama_py = str(a.llamacpp_venv / "bin" / "python")
    tm_env = {**os.environ, "PYTHONPATH": str(a.tokenmill_root)}
    runs: dict[str, list[dict]] = {"tokenmill": [], "llamacpp": []}
    bare = {"tokenmill": child(sys.executable, "bare", gguf, tm_env), "llamacpp": child(llama_py, "bare", gguf,
                                                                                         dict(os.environ))}
    for i in range(a.pairs):
        runs["llamacpp"].append(child(llama_py, "llamacpp", gguf, dict(os.environ)))
        runs["tokenmill"].append(child(sys.executable, "tokenmill", gguf, tm_env))
        over = {k: (runs[k][-1]["VmHWM"] - bare[k]["VmHWM"]) / 2 ** 20 for k in runs}
        print(f"pair {i + 1}: peak RSS over the bare interpreter: tokenmill {over['tokenmill']:.0f} MiB, llama.cpp "
              f"{over['llamacpp']:.0f} MiB ({over['tokenmill'] / over['llamacpp']:.2f}x)", flush=True)
    med = {k: statistics.median(r["VmHWM"] - bare[k]["VmHWM"] for r in v) / 2 ** 20 for k, v in runs.items()}
    last = runs["tokenmill"][-1]
    mib = {k: last[k] / 2 ** 20 for k in ("torch_imported", "tokenmill_imported", "model_tensors", "kv_budget",
                                          "kv_touched", "VmHWM")}
    parts = {"torch imported": mib["torch_imported"] - bare["tokenmill"]["VmRSS"] / 2 ** 20,
             "tokenmill imported": mib["tokenmill_imported"] - mib["torch_imported"],
             "model tensors": mib["model_tensors"], "KV cache made resident": mib["kv_touched"]}
    parts["the rest"] = mib["VmHWM"] - bare["tokenmill"]["VmHWM"] / 2 ** 20 - sum(parts.values())
    res_served = served(tm_env, a.idle_s)
    served_over = (res_served["VmHWM"] - bare["tokenmill"]["VmHWM"]) / 2 ** 20
    print(f"served, after one request and {a.idle_s:.0f} s idle: peak RSS over the bare interpreter "
          f"{served_over:.0f} MiB ({served_over / med['llamacpp']:.2f}x llama.cpp's in-process figure)", flush=True)
    res = {**machine_record(), "model": gguf, "served": res_served, "served_over_bare_mib": served_over,
           "tokenmill_root": str(a.tokenmill_root), "bare": bare, "runs": runs,
           "median_over_bare_mib": med, "ratio": med["tokenmill"] / med["llamacpp"], "tokenmill_parts_mib": parts,
           "kv_budget_mib": mib["kv_budget"]}
    print(f"median peak RSS over the bare interpreter: tokenmill {med['tokenmill']:.0f} MiB, llama.cpp "
          f"{med['llamacpp']:.0f} MiB: {res['ratio']:.2f}x")
    print(f"tokenmill's, from its last run (KV budget {mib['kv_budget']:.0f} MiB): " +
          ", ".join(f"{k} {v:.0f}" for k, v in parts.items()))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
