"""Deterministic benchmark workloads, in the format every engine can replay.

Format: {"name": str, "requests": [{"prompt_token_ids": [int, ...], "max_tokens": int}, ...]}
(a request may carry "prompt": str instead of token ids, for text-only servers).

`make_requests` draws from random.Random(seed) in exactly the order of ../shared/peers/workload.py,
so "offline-64" here and there are the same 64 requests. We never import that script at run time.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Optional

Request = dict[str, Any]
Workload = dict[str, Any]

DEFAULT_VOCAB = 49152  # SmolLM2's vocabulary: the peers' default

PRESETS: dict[str, dict[str, Any]] = {
    # 64 requests, prompts U(100, 512), outputs U(100, 512): the CPU-sized nano-vllm workload
    "offline-64": dict(n=64, inp=(100, 512), out=(100, 512)),
    # one request: TTFT of a 256-token prompt, then 256 decode steps
    "single-256": dict(n=1, inp=(256, 256), out=(256, 256)),
    # 64 requests sharing a 400-token system prefix then a short unique suffix: prefix caching
    "shared-prefix-64": dict(n=64, prefix=400, inp=(16, 64), out=(32, 128)),
}


def make_requests(n: int, inp: tuple[int, int], out: tuple[int, int], vocab: int = DEFAULT_VOCAB,
                  seed: int = 0) -> list[Request]:
    """n requests with prompt length U(inp) and max_tokens U(out); same draws as the peers' script."""
    _check_vocab(vocab)
    r = random.Random(seed)
    reqs = []
    for _ in range(n):
        plen = r.randint(*inp)
        reqs.append({"prompt_token_ids": [r.randrange(100, vocab - 100) for _ in range(plen)],
                     "max_tokens": r.randint(*out)})
    return reqs


def make_shared_prefix_requests(n: int, prefix: int, inp: tuple[int, int], out: tuple[int, int],
                                vocab: int = DEFAULT_VOCAB, seed: int = 0) -> list[Request]:
    """n requests = one common `prefix`-token head + a unique suffix of U(inp) tokens."""
    _check_vocab(vocab)
    r = random.Random(seed)
    head = [r.randrange(100, vocab - 100) for _ in range(prefix)]
    reqs = []
    for _ in range(n):
        slen = r.randint(*inp)
        reqs.append({"prompt_token_ids": head + [r.randrange(100, vocab - 100) for _ in range(slen)],
                     "max_tokens": r.randint(*out)})
    return reqs


def preset(name: str, vocab: int = DEFAULT_VOCAB, seed: int = 0, n: Optional[int] = None) -> Workload:
    """The named preset as a workload dict; `n` overrides the request count (same seed stream)."""
    if name not in PRESETS:
        raise ValueError(f"unknown workload preset {name!r}; choose one of {sorted(PRESETS)}")
    spec = dict(PRESETS[name])
    if n is not None:
        spec["n"] = n
    if "prefix" in spec:
        reqs = make_shared_prefix_requests(vocab=vocab, seed=seed, **spec)
    else:
        reqs = make_requests(vocab=vocab, seed=seed, **spec)
    return {"name": name, "requests": reqs}


def validate(w: Any, source: str = "workload") -> Workload:
    """Check the format and return it; a ValueError says what is wrong and where."""
    if not isinstance(w, dict) or not isinstance(w.get("requests"), list):
        raise ValueError(f"{source}: expected {{\"name\": ..., \"requests\": [...]}}")
    if not w["requests"]:
        raise ValueError(f"{source}: 'requests' is empty")
    for i, r in enumerate(w["requests"]):
        if not isinstance(r, dict):
            raise ValueError(f"{source}: request {i} must be an object")
        ids, text = r.get("prompt_token_ids"), r.get("prompt")
        if ids is None and not isinstance(text, str):
            raise ValueError(f"{source}: request {i} needs 'prompt_token_ids' (list of int) or 'prompt' (str)")
        if ids is not None and (not isinstance(ids, list) or not ids
                                or not all(isinstance(t, int) and t >= 0 for t in ids)):
            raise ValueError(f"{source}: request {i} 'prompt_token_ids' must be a non-empty list of ints >= 0")
        mt = r.get("max_tokens")
        if not isinstance(mt, int) or mt < 1:
            raise ValueError(f"{source}: request {i} 'max_tokens' must be an int >= 1, got {mt!r}")
    w.setdefault("name", source)
    return w


def read_json(path: str | Path) -> Any:
    """A JSON file, or a ValueError naming the file (shared by the bench tools)."""
    if not Path(path).is_file():
        raise ValueError(f"{path}: no such file")
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None


def load(path: str | Path) -> Workload:
    return validate(read_json(path), str(path))


def save(w: Workload, path: str | Path) -> None:
    Path(path).write_text(json.dumps(w))


def max_token_id(w: Workload) -> int:
    return max((max(r["prompt_token_ids"]) for r in w["requests"] if r.get("prompt_token_ids")), default=-1)


def totals(w: Workload) -> tuple[int, int]:
    """(prompt tokens, generated tokens) if every request runs to max_tokens (ignore_eos)."""
    return (sum(len(r.get("prompt_token_ids") or []) for r in w["requests"]),
            sum(r["max_tokens"] for r in w["requests"]))


def _check_vocab(vocab: int) -> None:
    if vocab <= 200:  # ids are drawn from [100, vocab - 100) to stay clear of special tokens
        raise ValueError(f"vocab must be > 200 to draw token ids from [100, vocab-100), got {vocab}")
