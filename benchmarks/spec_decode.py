#!/usr/bin/env python3
"""Speculative decoding against none on the bundled model, side by side in one run, in turn --pairs times:

  1. one stream over the input-grounded requests tokenmill ships (tokenmill/bench/data/grounded.json: rewrite this
     code, repeat this passage with a change), greedy, up to 256 tokens each: decode tok/s over the requests'
     decode time, and the acceptance rate;
  2. offline-64 (`tokenmill bench throughput`), where the random prompts give the lookup little to find.

  .venv/bin/python benchmarks/spec_decode.py [--k 3] [--lookup-min 2] [--lookup-max 4] [--pairs 3]
      [--out results/NAME.json]

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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STREAM = r'''
import json, sys
from tokenmill import LLM, SamplingParams
spec = json.loads(sys.argv[1])
llm = LLM(speculative_config=spec)
reqs = json.load(open("tokenmill/bench/data/grounded.json"))["requests"]
p = SamplingParams(temperature=0, max_tokens=256)
llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(max_tokens=8))      # warm-up
tokens = seconds = 0
for r in reqs:
    out = llm.chat([{"role": "user", "content": r["instruction"] + "\n\n" + r["text"]}], p)[0]
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
    return run([sys.executable, "-c", STREAM, json.dumps(spec)])


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
    rows: dict[str, list] = {"stream": [], "offline64": []}
    for i in range(args.pairs):
        order = (None, spec) if i % 2 == 0 else (spec, None)     # alternate, so drift favours neither
        r = {json.dumps(s): stream(s) for s in order}
        off, on = r["null"], r[json.dumps(spec)]
        rows["stream"].append({"off": off, "on": on, "ratio": on["decode_tok_s"] / off["decode_tok_s"]})
        print(f"stream pair {i + 1}: off {off['decode_tok_s']:.1f} tok/s, on {on['decode_tok_s']:.1f} tok/s "
              f"(ratio {rows['stream'][-1]['ratio']:.2f}, acceptance {on['acceptance_rate']:.2f}, "
              f"{on['mean_accepted_length']:.2f} tokens a verification)", flush=True)
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
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
