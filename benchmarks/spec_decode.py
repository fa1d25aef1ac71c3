#!/usr/bin/env python3
"""Speculative decoding against none on the bundled model, side by side in one run, in turn --pairs times:

  1. one stream over the input-grounded requests tokenmill ships (tokenmill/bench/data/grounded.json: rewrite this
     code, repeat this passage with a change), greedy, up to 256 tokens each: decode tok/s over the requests'
     decode time, and the acceptance rate;
  2. offline-64 (`tokenmill bench throughput`), where the random prompts give the lookup little to find.

  .venv/bin/python benchmarks/spec_decode.py [--k 3] [--lookup-min 2] [--lookup-max 4] [--pairs 3]
      [--llama-server PATH] [--out results/NAME.json]

The peers, on the same GGUF and the same prompt tokens, off and on in the same pairs (ratios are each engine's own):
  - llama.cpp's prompt lookup as Python users call it: llama-cpp-python's LlamaPromptLookupDecoding, k tokens a
    guess from suffixes of up to --lookup-max tokens (peer_spec_llamacpp.py; the venv is made on first use, as
    run.py makes it);
  - with --llama-server, a llama-server binary built from llama.cpp: --spec-type ngram-simple, a lookup of
    --lookup-min tokens and guesses of k.

Guesses come from the n-gram lookup, or with --draft PATH from a draft model; --draft-layers N cuts one from the
bundled model (its first N layers, make_layer_draft.py), and --draft self uses the bundled model as its own draft.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from run import PEERS, ensure_llamacpp
from spec_ceiling import grounded_texts

ROOT = Path(__file__).resolve().parent.parent
STREAM = r'''
import json, sys
from tokenmill import LLM, SamplingParams
spec, texts = json.loads(sys.argv[1]), json.loads(sys.argv[2])
llm = LLM(speculative_config=spec)
p = SamplingParams(temperature=0, max_tokens=256)
llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(max_tokens=8))      # warm-up
tokens = seconds = 0
for text in texts:
    out = llm.chat([{"role": "user", "content": text}], p)[0]
    m = out.metrics
    tokens += len(out.outputs[0].token_ids) - 1
    seconds += m.last_token_time - m.first_token_time
st = llm.llm_engine.stats
print(json.dumps({"decode_tok_s": tokens / seconds, "decode_tokens": tokens,
                  "acceptance_rate": st.spec_acceptance_rate, "mean_accepted_length": st.spec_mean_accepted_length}))
'''


def run(cmd: list[str]) -> dict:
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=3600)
    if res.returncode != 0:
        raise RuntimeError(res.stderr[-2000:])
    return json.loads([line for line in res.stdout.splitlines() if line.startswith("{")][-1])


def stream(spec: dict | None) -> dict:
    return run([sys.executable, "-c", STREAM, json.dumps(spec), json.dumps(grounded_texts())])


def grounded_prompts(path: Path) -> dict:
    """The stream's prompts as token ids (the bundled model's chat template) and its stop ids, for the peers."""
    from tokenmill import LLM
    from tokenmill.tokenizer import apply_chat_template
    llm = LLM()
    ids = [apply_chat_template(llm.get_tokenizer(), [{"role": "user", "content": t}]) for t in grounded_texts()]
    spec = {"prompts": ids, "stop": sorted(llm.model_config.eos_token_ids)}
    path.write_text(json.dumps(spec))
    return spec


def llamacpp_stream(py: Path, gguf: str, prompts: Path, k: int, ngram: int) -> dict:
    return run([str(py), str(ROOT / "benchmarks" / "peer_spec_llamacpp.py"), gguf, str(prompts), "256", "2", str(k),
                str(ngram)])


def server_stream(binary: str, gguf: str, prompts: dict, k: int, ngram: int, port: int = 8137) -> dict:
    """llama-server, one request at a time; decode tok/s from its own timings (predicted_n over predicted_ms)."""
    spec_args = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(ngram),
                 "--spec-ngram-simple-size-m", str(k)] if k else []
    proc = subprocess.Popen([binary, "-m", gguf, "-t", "2", "-c", "4096", "--port", str(port), *spec_args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if urllib.request.urlopen(url + "/health", timeout=5).status == 200:
                    break
            except OSError:
                time.sleep(0.1)
        tokens, ms, drafted, accepted = 0, 0.0, 0, 0
        for ids in prompts["prompts"]:
            body = json.dumps({"prompt": ids, "n_predict": 256, "temperature": 0, "cache_prompt": False}).encode()
            req = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
            t = json.loads(urllib.request.urlopen(req, timeout=600).read())["timings"]
            tokens, ms = tokens + t["predicted_n"], ms + t["predicted_ms"]
            drafted, accepted = drafted + t.get("draft_n", 0), accepted + t.get("draft_n_accepted", 0)
        return {"decode_tok_s": 1e3 * tokens / ms, "decode_tokens": tokens,
                "acceptance_rate": accepted / drafted if drafted else 0.0}
    finally:
        proc.terminate()
        proc.wait(30)


def offline(spec: dict | None) -> dict:
    cmd = [sys.executable, "-m", "tokenmill.cli", "bench", "throughput", "--preset", "offline-64", "--json"]
    return run(cmd + (["--speculative-config", json.dumps(spec)] if spec else []))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--lookup-min", type=int, default=2, help="prompt_lookup_min: the shortest suffix looked up")
    ap.add_argument("--lookup-max", type=int, default=4, help="prompt_lookup_max")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--skip-offline", action="store_true")
    ap.add_argument("--draft", default=None, help="a draft model's path, or 'self'")
    ap.add_argument("--draft-layers", type=int, default=None, help="a draft of the bundled model's first N layers")
    ap.add_argument("--skip-llamacpp", action="store_true", help="no llama-cpp-python peer")
    ap.add_argument("--llamacpp-venv", type=Path, default=PEERS / "llamacpp",
                    help="a venv with llama-cpp-python (made with the PyPI build on first use)")
    ap.add_argument("--llama-server", default=None, help="a llama-server binary built from llama.cpp: a second peer")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from tokenmill.executor.kernels import machine_record
    from tokenmill.executor.loader import resolve_model_path
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.lookup_min,
            "prompt_lookup_max": args.lookup_max}
    draft = args.draft
    if args.draft_layers is not None:
        from make_layer_draft import cut_layers
        bundled = resolve_model_path(None)
        if Path(bundled).is_dir():
            bundled = str(next(Path(bundled).glob("*.gguf")))
        draft = str(Path(tempfile.mkdtemp()) / f"draft-{args.draft_layers}-layers.gguf")
        cut_layers(bundled, draft, args.draft_layers)
    if draft is not None:
        spec = {"method": "draft_model", "num_speculative_tokens": args.k,
                "model": resolve_model_path(None) if draft == "self" else draft}
    gguf = resolve_model_path(None)
    if Path(gguf).is_dir():
        gguf = str(next(Path(gguf).glob("*.gguf")))
    prompts_path = Path(tempfile.mkdtemp()) / "grounded-ids.json"
    prompts = grounded_prompts(prompts_path)
    peers = {}     # name -> (off, on) callables; the peers guess by n-gram lookup, so only beside it
    py = None if args.skip_llamacpp or draft is not None else ensure_llamacpp(args.llamacpp_venv)
    if py is not None:
        peers["llama-cpp-python"] = tuple(
            (lambda k=k: llamacpp_stream(py, gguf, prompts_path, k, args.lookup_max)) for k in (0, args.k))
    if args.llama_server and draft is None:
        peers["llama-server"] = tuple(
            (lambda k=k: server_stream(args.llama_server, gguf, prompts, k, args.lookup_min)) for k in (0, args.k))
    rows: dict[str, list] = {"stream": [], "offline64": []}
    for i in range(args.pairs):
        order = (None, spec) if i % 2 == 0 else (spec, None)     # alternate, so drift favours neither
        r = {json.dumps(s): stream(s) for s in order}
        off, on = r["null"], r[json.dumps(spec)]
        row = {"off": off, "on": on, "ratio": on["decode_tok_s"] / off["decode_tok_s"], "peers": {}}
        rows["stream"].append(row)
        print(f"stream pair {i + 1}: off {off['decode_tok_s']:.1f} tok/s, on {on['decode_tok_s']:.1f} tok/s "
              f"(ratio {row['ratio']:.2f}, acceptance {on['acceptance_rate']:.2f}, "
              f"{on['mean_accepted_length']:.2f} tokens a verification)", flush=True)
        for name, arms in peers.items():
            got = {j: arms[j]() for j in ((0, 1) if i % 2 == 0 else (1, 0))}
            p_off, p_on = got[0], got[1]
            row["peers"][name] = {"off": p_off, "on": p_on, "ratio": p_on["decode_tok_s"] / p_off["decode_tok_s"]}
            print(f"  {name}: off {p_off['decode_tok_s']:.1f} tok/s, on {p_on['decode_tok_s']:.1f} tok/s "
                  f"(ratio {row['peers'][name]['ratio']:.2f})", flush=True)
        if not args.skip_offline:
            r = {json.dumps(s): offline(s) for s in order}
            off, on = r["null"], r[json.dumps(spec)]
            st = on["engine_stats"]
            rows["offline64"].append({"off_tok_s": off["generated_tok_s"], "on_tok_s": on["generated_tok_s"],
                                      "ratio": on["generated_tok_s"] / off["generated_tok_s"],
                                      "draft_tokens": st.get("spec_num_draft_tokens"),
                                      "accepted_tokens": st.get("spec_num_accepted_tokens")})
            print(f"offline-64 pair {i + 1}: off {off['generated_tok_s']:.1f}, on {on['generated_tok_s']:.1f} tok/s "
                  f"(ratio {rows['offline64'][-1]['ratio']:.3f}; {st.get('spec_num_accepted_tokens')} of "
                  f"{st.get('spec_num_draft_tokens')} guesses accepted)", flush=True)
    res = {"date": time.strftime("%Y-%m-%d"), **machine_record(), "model": "bundled SmolLM2-135M-Instruct",
           "speculative_config": spec, "draft": args.draft, "draft_layers": args.draft_layers, **rows}
    for name in ("stream", "offline64"):
        if rows[name]:
            res[f"{name}_median_ratio"] = statistics.median(p["ratio"] for p in rows[name])
            print(f"{name}: median on / off {res[f'{name}_median_ratio']:.3f}")
    for name in peers:
        res[f"{name}_median_ratio"] = statistics.median(p["peers"][name]["ratio"] for p in rows["stream"])
        print(f"{name}: median on / off {res[f'{name}_median_ratio']:.3f}")
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
