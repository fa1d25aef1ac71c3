"""`tokenmill explain`: the two phases of inference, step by step. First the tutorial's toy example by hand: four
tokens with scalar values, four hand-written attention heads, the prefill, then a decode step with and without a
KV cache. Then the same walk on a real model (the bundled one, or --model), through transformers' eager attention
(the oracle tokenmill is tested against): the prefill's K/V per layer, each decode step's new K/V row and one
head's attention over the context, and the cached logits beside a recomputation without the cache."""
from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from typing import Any, Optional

# ---- the toy example -------------------------------------------------------------------------------------------
TOY_TOKENS = ["Today", "weather", "is", "so"]
TOY_VALUES = [10.0, 20.0, 1.0, 5.0]
HEADS = ["even positions", "the last token", "the first token", "every token"]
VOCAB = ["nice", "warm", "delicious"]
# the numbers the tutorial leaves open, chosen here: the projection of the four heads' outputs onto the
# vocabulary (a column per word), and the value "nice" carries when it is decoded
PROJECTION = [[0.10, 0.10, -0.10],
              [0.20, 0.10, 0.00],
              [0.10, 0.10, 0.00],
              [0.20, 0.20, 0.05]]
NICE_VALUE = 8.0
MASKED = -math.inf


def head_scores(head: int, query: int, n: int) -> list[float]:
    """Head `head`'s written scores for the token at `query` (0-based) over positions 0..n-1: 0 where it attends,
    -inf elsewhere, and -inf past the query (causal masking). Positions count from 1 in the heads' rules."""
    def attends(p: int) -> bool:
        if head == 0:
            return (p + 1) % 2 == 0
        if head == 1:
            return p == query
        if head == 2:
            return p == 0
        return True
    return [0.0 if p <= query and attends(p) else MASKED for p in range(n)]


def softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    if m == MASKED:
        return [0.0] * len(xs)
    e = [math.exp(x - m) if x != MASKED else 0.0 for x in xs]
    return [v / sum(e) for v in e]


@dataclass
class ToyStep:
    token: str
    weights: list[list[float]]      # per head, over the context
    context: list[float]            # the heads' outputs
    logits: list[float]             # over VOCAB


def toy_attend(values: list[float], query: int) -> ToyStep:
    """The token at `query` attending over values[:query + 1] (its keys and values: the cache, or recomputed)."""
    weights = [softmax(head_scores(h, query, query + 1)) for h in range(len(HEADS))]
    context = [sum(w * v for w, v in zip(ws, values)) for ws in weights]
    logits = [sum(c * PROJECTION[h][j] for h, c in enumerate(context)) for j in range(len(VOCAB))]
    return ToyStep("", weights, context, logits)


def toy_walk() -> dict[str, Any]:
    """Prefill over the four tokens, then "nice" decoded twice: one new row against the cache, and everything
    recomputed. Returns what is printed."""
    prefill = [toy_attend(TOY_VALUES, q) for q in range(len(TOY_TOKENS))]
    last = prefill[-1]
    chosen = VOCAB[max(range(len(VOCAB)), key=lambda j: last.logits[j])]
    cache = list(TOY_VALUES)                     # what the prefill keeps: each token's key and value
    cached = toy_attend(cache + [NICE_VALUE], len(cache))       # one new row
    recomputed = [toy_attend(TOY_VALUES + [NICE_VALUE], q) for q in range(len(TOY_TOKENS) + 1)][-1]
    return {"prefill": prefill, "next": chosen, "cached": cached, "recomputed": recomputed}


def _row(xs: list[float], width: int = 7) -> str:
    return " ".join(f"{x:{width}.3f}" for x in xs)


def print_toy() -> None:
    w = toy_walk()
    print("== the toy example: 'Today weather is so' ==")
    print("tokens and their values: " + ", ".join(f"{t}={v:g}" for t, v in zip(TOY_TOKENS, TOY_VALUES)))
    print("heads (scores written by hand, 0 where a head attends and -inf elsewhere, causal; then softmax): "
          + "; ".join(f"{i + 1}: {h}" for i, h in enumerate(HEADS)))
    print("\n-- prefill: every token at once (compute-bound); each row is one query's attention weights --")
    for q, step in enumerate(w["prefill"]):
        print(f"{TOY_TOKENS[q]:>8}:")
        for h, ws in enumerate(step.weights):
            print(f"   head {h + 1} weights [{_row(ws, 5)}]  -> output {step.context[h]:g}")
    so = w["prefill"][-1]
    print(f"\ncontext of 'so' (the four heads' outputs): {', '.join(f'{c:g}' for c in so.context)}")
    print("projection onto the vocabulary (chosen here; a column per word):")
    for h, row in enumerate(PROJECTION):
        print(f"   head {h + 1}: " + "  ".join(f"{VOCAB[j]}={x:+.2f}" for j, x in enumerate(row)))
    print("logits: " + ", ".join(f"{v}={x:.3f}" for v, x in zip(VOCAB, so.logits)) + f"  -> next token: {w['next']}")
    print(f"\n-- decode: '{w['next']}' (value {NICE_VALUE:g}, chosen here) joins; one new query row --")
    c, r = w["cached"], w["recomputed"]
    for h in range(len(HEADS)):
        print(f"   head {h + 1} weights [{_row(c.weights[h], 5)}]  -> output {c.context[h]:g}")
    print(f"with the cache (1 row against 4 cached keys/values): context {', '.join(f'{x:g}' for x in c.context)}")
    print(f"recomputing all 5 rows without it:                  context {', '.join(f'{x:g}' for x in r.context)}")
    print("the same: " + str(c.context == r.context) + " (the cache is memoisation: it saves the 4 rows' work, "
          "changes nothing)")


# ---- a real model -------------------------------------------------------------------------------------------------
def print_model(model: Optional[str], prompt: str, steps: int, head: int, layer: int,
                plot: Optional[str]) -> dict[str, Any]:
    """The walk on a real model through transformers (eager attention). Returns the figures printed (tests)."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    from tokenmill.executor.loader import resolve_model_path
    path = resolve_model_path(model)
    with tempfile.TemporaryDirectory() as tmp:
        if path.endswith(".gguf"):       # transformers reads the GGUF's weights through a float folder
            from tokenmill.executor.loader.convert import gguf_to_hf
            gguf_to_hf(path, tmp, dtype=torch.float32)
            path = tmp
        tok = AutoTokenizer.from_pretrained(path)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    cfg = hf.config
    layer = layer % cfg.num_hidden_layers
    print(f"\n== {model or 'the bundled model'}: {cfg.num_hidden_layers} layers, {cfg.num_attention_heads} heads, "
          f"{cfg.num_key_value_heads} kv heads ==")
    print(f"prompt: {prompt!r} -> {ids.shape[1]} tokens: {tok.convert_ids_to_tokens(ids[0].tolist())}")
    out: dict[str, Any] = {"steps": []}
    with torch.no_grad():
        hf(ids, use_cache=False)              # a first call pays for warming up: not timed
        cache = DynamicCache(config=cfg)
        t0 = time.perf_counter()
        res = hf(ids, cache=cache, use_cache=True, output_attentions=True)
        prefill_s = time.perf_counter() - t0
        k = cache.layers[0].keys
        per_token = 2 * cfg.num_hidden_layers * k.shape[1] * k.shape[3] * k.element_size()
        print(f"\n-- prefill: {ids.shape[1]} tokens in one pass, {1000 * prefill_s:.1f} ms --")
        print(f"K and V of each layer: [batch, kv heads, tokens, head dim] = {list(k.shape)}, "
              f"{per_token} bytes a token over {cfg.num_hidden_layers} layers: "
              f"{per_token * ids.shape[1] / 1024:.1f} KiB cached")
        seq = ids
        next_id = res.logits[:, -1].argmax(-1, keepdim=True)
        for s in range(steps):
            seq = torch.cat([seq, next_id], dim=1)
            t0 = time.perf_counter()
            step = hf(next_id, cache=cache, use_cache=True, output_attentions=True)
            decode_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            full = hf(seq, use_cache=False)
            recompute_s = time.perf_counter() - t0
            cached_logits, full_logits = step.logits[0, -1], full.logits[0, -1]
            diff = (cached_logits - full_logits).abs().max().item()
            weights = step.attentions[layer][0, head, -1]
            row = cache.layers[layer].keys[0, :, -1]
            word = tok.convert_ids_to_tokens(next_id[0].tolist())[0]
            print(f"\n-- decode step {s + 1}: {word!r}, {1000 * decode_s:.1f} ms with the cache, "
                  f"{1000 * recompute_s:.1f} ms recomputing {seq.shape[1]} tokens --")
            print(f"new K row of layer {layer}: {list(row.shape)} (kv heads x head dim), the cache now "
                  f"{cache.layers[layer].keys.shape[2]} tokens")
            context = tok.convert_ids_to_tokens(seq[0].tolist())
            top = sorted(range(len(context)), key=lambda i: -weights[i].item())[:5]
            print(f"layer {layer} head {head} attends most to: " +
                  ", ".join(f"{context[i]!r}@{i} {weights[i].item():.3f}" for i in top))
            print("logits, cached | recomputed (top 3): " + "  ".join(
                f"{tok.convert_ids_to_tokens([i])[0]!r} {cached_logits[i].item():.4f} | {full_logits[i].item():.4f}"
                for i in cached_logits.topk(3).indices.tolist()) + f"   largest difference {diff:.2e}")
            out["steps"].append({"token": word, "max_abs_diff": diff, "weights_sum": weights.sum().item(),
                                 "same_next": int(cached_logits.argmax()) == int(full_logits.argmax())})
            next_id = step.logits[:, -1].argmax(-1, keepdim=True)
    if plot and steps:
        _plot(plot, step.attentions[layer][0, head].numpy(), context, per_token)
        print(f"\nattention map and cache growth: {plot}")
    return out


def _plot(path: str, weights: Any, context: list[str], per_token: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.bar(range(len(context)), weights[-1])
    a.set_xticks(range(len(context)), context, rotation=90, fontsize=7)
    a.set_title("the last token's attention weights (one head)")
    n = list(range(1, len(context) + 1))
    b.plot(n, [per_token * i / 1024 for i in n])
    b.set_xlabel("tokens")
    b.set_ylabel("KV cache, KiB")
    b.set_title("the cache grows by one row per token")
    fig.tight_layout()
    fig.savefig(path)


def cmd_explain(args: argparse.Namespace) -> int:
    print_toy()
    if not args.toy_only:
        print_model(args.model, args.prompt, args.steps, args.head, args.layer, args.plot)
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("explain", help="the two phases of inference, step by step: a toy example by hand, then a "
                                       "real model's prefill, cache and decode")
    p.add_argument("--model", default=None, help="HF folder, .gguf or hub name (default: the bundled model)")
    p.add_argument("--prompt", default="Today the weather is so")
    p.add_argument("--steps", type=int, default=3, help="decode steps to show")
    p.add_argument("--layer", type=int, default=-1, help="the layer whose head is shown (default: the last)")
    p.add_argument("--head", type=int, default=0, help="the attention head shown")
    p.add_argument("--plot", default=None, help="a PNG of the attention weights and the cache's growth")
    p.add_argument("--toy-only", action="store_true", help="the toy example alone")
    p.set_defaults(func=cmd_explain)
