#!/usr/bin/env python3
"""How far n-gram speculation can go on the grounded stream, on this machine: measured, then replayed.

Runs the grounded requests of benchmarks/spec_decode.py (greedy, one at a time) with speculation off and on,
interleaved in one process, and fits the cost of a step: a for its first row, b for each guessed row
(decode time off = a * tokens; on = a * steps + b * guesses). The outputs are equal token for token, so the same
text can be replayed under other guessing rules with that cost:

  lookup k     the engine's own NgramIndex with k guesses;
  ceiling k    a lookup that knows, at every step, which earlier occurrence of the text's last 1..8 tokens the
               model will follow and for how long, and guesses just that run (at most k): no guess is ever
               wrong, so no lookup rule does better at that b.

For each k it prints the predicted speed-up (off time / on time) and the guessed row's cost b / a at which the
ceiling would reach 2x.

  .venv/bin/python benchmarks/spec_ceiling.py [--k 3] [--lookup-min 2] [--lookup-max 4] [--rounds 3]
      [--out results/NAME.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from tokenmill import LLM, SamplingParams
from tokenmill.engine.spec_decode import NgramIndex

ROOT = Path(__file__).resolve().parent.parent
GROUNDED = ROOT / "tokenmill" / "bench" / "data" / "grounded.json"
CEILING_MAX_N = 8          # the longest suffix the ceiling looks up
MAX_TOKENS = 256           # each request's, as in spec_decode.py


def grounded_texts() -> list[str]:
    """The grounded requests as the stream's user messages: the instruction, a blank line, the text."""
    return [r["instruction"] + "\n\n" + r["text"] for r in json.loads(GROUNDED.read_text())["requests"]]


def stream(llm: LLM, prompts: list[str]) -> tuple[list[tuple[list[int], list[int]]], float, dict]:
    """(prompt ids, output ids) per request, the decode seconds, and the engine's counters over these requests."""
    st = llm.llm_engine.stats
    d0, g0, a0 = st.spec_num_drafts, st.spec_num_draft_tokens, st.spec_num_accepted_tokens
    texts, seconds = [], 0.0
    for prompt in prompts:
        out = llm.chat([{"role": "user", "content": prompt}], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0]
        texts.append((list(out.prompt_token_ids), list(out.outputs[0].token_ids)))
        seconds += out.metrics.last_token_time - out.metrics.first_token_time
    return texts, seconds, {"drafts": st.spec_num_drafts - d0, "guesses": st.spec_num_draft_tokens - g0,
                            "accepted": st.spec_num_accepted_tokens - a0}


def replay(texts: list[tuple[list[int], list[int]]], guess, max_tokens: int = MAX_TOKENS) -> tuple[int, int]:
    """Steps and guessed rows to decode texts' outputs (after each first token) when guess(tokens, room, state)
    gives each step's guesses, room being what the engine allows (guess_room); state starts as
    {"full": the request's whole text}."""
    steps = rows = 0
    for prompt, output in texts:
        j, state = 1, {"full": prompt + output}
        while j < len(output):
            g = guess(prompt + output[:j], max_tokens - j - 1, state)
            ok = 0
            while ok < len(g) and j + ok < len(output) and g[ok] == output[j + ok]:
                ok += 1
            steps, rows, j = steps + 1, rows + len(g), j + ok + 1
    return steps, rows


def lookup(k: int, lo: int, hi: int):
    def guess(tokens: list[int], room: int, state: dict) -> list[int]:
        index = state.setdefault("index", NgramIndex(lo, hi))
        return index.propose(tokens, min(k, room)) if room > 0 else []
    return guess


def ceiling(k: int):
    """Guesses the longest run that any earlier occurrence of a 1..CEILING_MAX_N-token suffix continues with and the
    output agrees with (the answer is in state["full"])."""
    def guess(tokens: list[int], room: int, state: dict) -> list[int]:
        if room <= 0:
            return []
        truth, best = state["full"][len(tokens):len(tokens) + min(k, room)], 0
        for n in range(1, min(CEILING_MAX_N, len(tokens) - 1) + 1):
            suffix = tokens[-n:]
            for end in range(n, len(tokens)):
                if tokens[end - n:end] == suffix:
                    ok = 0
                    while ok < len(truth) and end + ok < len(tokens) and tokens[end + ok] == truth[ok]:
                        ok += 1
                    best = max(best, ok)
        return truth[:best]
    return guess


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens of the measured run")
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3, help="off/on pairs measured; the fit takes their medians")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from tokenmill.executor.kernels import machine_record
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.lookup_min,
            "prompt_lookup_max": args.lookup_max}
    prompts = grounded_texts()
    runs: dict[str, list] = {"off": [], "on": []}
    for i in range(args.rounds):
        for name in (("off", "on") if i % 2 == 0 else ("on", "off")):
            # a fresh engine each time, warmed up as the benchmark's: a prompt met again would hit the prefix cache
            # and be computed in other pieces, which may change the greedy text
            llm = LLM(speculative_config=spec if name == "on" else None)
            llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(max_tokens=8))
            runs[name].append(stream(llm, prompts))
            del llm
    texts = runs["off"][0][0]
    if any(r[0] != texts for r in runs["off"] + runs["on"]):
        raise SystemExit("speculation changed the greedy outputs: the replay below would not be about the same text")
    tokens = sum(len(o) - 1 for _, o in texts)
    counts = runs["on"][0][2]
    steps_on = tokens - counts["accepted"]
    a = statistics.median(r[1] for r in runs["off"]) / tokens
    on_s = statistics.median(r[1] for r in runs["on"])
    b = (on_s - a * steps_on) / counts["guesses"]
    measured = a * tokens / on_s
    print(f"measured: {tokens} tokens, off {1e3 * a:.2f} ms a token; on {steps_on} steps with {counts['guesses']} "
          f"guesses, {counts['accepted']} accepted: on / off {measured:.3f}; a guessed row costs b = "
          f"{1e3 * b:.2f} ms, b / a = {b / a:.3f}")
    rows = []
    for k in range(1, 9):
        res = {"k": k}
        for name, rule in (("lookup", lookup(k, args.lookup_min, args.lookup_max)), ("ceiling", ceiling(k))):
            steps, guessed = replay(texts, rule)
            res[name] = {"steps": steps, "guesses": guessed, "speedup": tokens / (steps + guessed * b / a)}
        # the b / a at which the ceiling's steps and guesses give 2x: tokens / (steps + x * guesses) = 2
        c = res["ceiling"]
        res["ceiling_b_over_a_for_2x"] = (tokens / 2 - c["steps"]) / c["guesses"] if c["guesses"] else None
        rows.append(res)
        need = res["ceiling_b_over_a_for_2x"]
        print(f"k={k}: lookup {res['lookup']['speedup']:.2f} ({res['lookup']['steps']} steps, "
              f"{res['lookup']['guesses']} guesses); ceiling {c['speedup']:.2f} ({c['steps']} steps, {c['guesses']} "
              f"guesses), 2x at b / a <= {need:.3f}" if need is not None and need > 0 else
              f"k={k}: lookup {res['lookup']['speedup']:.2f}; ceiling {c['speedup']:.2f}, 2x out of reach at any b")
    res = {"date": time.strftime("%Y-%m-%d"), **machine_record(), "model": "bundled SmolLM2-135M-Instruct",
           "speculative_config": spec, "tokens": tokens, "a_ms": 1e3 * a, "b_ms": 1e3 * b,
           "measured_speedup": measured, "measured": counts, "replays": rows}
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
