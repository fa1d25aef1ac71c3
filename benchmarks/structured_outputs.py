#!/usr/bin/env python3
"""What structured outputs cost: offline-64 on the bundled model with every request constrained to a JSON schema,
against the same requests unconstrained, in turn --pairs times in one run (this machine's speed drifts between
minutes, so the ratio is taken within a pair and the median pair's is reported).

  .venv/bin/python benchmarks/structured_outputs.py [--pairs 3] [--out results/NAME.json]

Both arms decode greedily with ignore_eos to each request's max_tokens: the schema (an array of at least 400
records) cannot finish within 512 tokens, so both do the same work and the difference is the grammar's: compiling,
writing each step's masks beside the forward pass, applying them.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = {"type": "object", "required": ["rows"], "properties": {"rows": {
    "type": "array", "minItems": 400, "items": {
        "type": "object", "required": ["id", "name", "ok"],
        "properties": {"id": {"type": "integer", "minimum": 0}, "name": {"type": "string", "maxLength": 16},
                       "ok": {"type": "boolean"}}}}}}


def throughput(schema: bool) -> dict:
    cmd = [sys.executable, "-m", "tokenmill.cli", "bench", "throughput", "--preset", "offline-64", "--json"]
    if schema:
        cmd += ["--json-schema", json.dumps(SCHEMA)]
    print("$ " + " ".join(cmd[2:6]) + (" --json-schema ..." if schema else ""), file=sys.stderr, flush=True)
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=3600)
    if res.returncode != 0:
        raise RuntimeError(res.stderr[-2000:])
    return json.loads([line for line in res.stdout.splitlines() if line.startswith("{")][-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from tokenmill.executor.kernels import machine_record
    pairs = []
    for i in range(args.pairs):
        # alternate which arm goes first, so a drift in the machine's speed does not favour one
        order = (False, True) if i % 2 == 0 else (True, False)
        r = {schema: throughput(schema) for schema in order}
        plain, constrained = r[False], r[True]
        assert plain["generated_tokens"] == constrained["generated_tokens"], "the arms did different work"
        pairs.append({"generated_tokens": plain["generated_tokens"],
                      "plain_tok_s": plain["generated_tok_s"], "schema_tok_s": constrained["generated_tok_s"],
                      "ratio": constrained["generated_tok_s"] / plain["generated_tok_s"]})
        print(f"pair {i + 1}: plain {pairs[-1]['plain_tok_s']:.1f} tok/s, schema {pairs[-1]['schema_tok_s']:.1f} "
              f"tok/s, ratio {pairs[-1]['ratio']:.3f}", flush=True)
    ratios = sorted(p["ratio"] for p in pairs)
    res = {"date": time.strftime("%Y-%m-%d"), **machine_record(), "model": "bundled SmolLM2-135M-Instruct",
           "workload": "offline-64", "schema": SCHEMA, "pairs": pairs, "median_ratio": statistics.median(ratios)}
    print(f"median schema / plain: {res['median_ratio']:.3f} (range {ratios[0]:.3f}-{ratios[-1]:.3f})")
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
