"""`tokenmill bench perplexity`: how well the engine's model predicts a text, to price quantised weights.

perplexity = exp(mean over scored tokens of -log p(token | the tokens before it in its window)). The text is
tokenised once, cut into windows of `context` tokens that start every `stride` tokens, and each window runs as
one prompt with prompt logprobs; a token is scored once, in the first window that holds it with a prefix (so
without overlap each window's first token, having none, goes unscored, as in transformers' strided recipe)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

DEFAULT_TEXT = "default (tokenmill/bench/data/perplexity.txt)"
_HEADER = "# "


@dataclass(frozen=True)
class PerplexityConfig:
    context: int = 512                        # tokens per window (the prefix a token can see, at most)
    stride: Optional[int] = None              # window starts this far apart; None: = context (no overlap)
    max_tokens_scored: Optional[int] = None   # stop after this many scored tokens (quick CI runs)
    windows_per_call: int = 4                 # windows per generate() call: the progress bar's step

    def __post_init__(self) -> None:
        if self.context < 2:
            raise ValueError(f"--context must be >= 2 (a token and its prefix), got {self.context}")
        if self.stride is not None and not 1 <= self.stride <= self.context:
            raise ValueError(f"--stride must be in [1, context={self.context}], got {self.stride}")
        if self.max_tokens_scored is not None and self.max_tokens_scored < 1:
            raise ValueError(f"--max-tokens-scored must be >= 1, got {self.max_tokens_scored}")
        if self.windows_per_call < 1:
            raise ValueError(f"windows_per_call must be >= 1, got {self.windows_per_call}")

    @property
    def step(self) -> int:
        return self.stride or self.context


@dataclass(frozen=True)
class Window:
    """Tokens [begin, end) go in as one prompt; those at [first_scored, end) are scored."""
    begin: int
    end: int
    first_scored: int

    @property
    def num_scored(self) -> int:
        return self.end - self.first_scored


# ---- the text ---------------------------------------------------------------------------------------------

def default_text_path() -> Path:
    return Path(str(resources.files("tokenmill.bench") / "data" / "perplexity.txt"))


def strip_header(text: str) -> str:
    """Drop the leading '# ' lines (source and licence): they are about the text, not part of it."""
    lines = text.splitlines(keepends=True)
    i = 0
    while i < len(lines) and lines[i].startswith(_HEADER):
        i += 1
    return "".join(lines[i:])


def load_text(path: Optional[str]) -> tuple[str, str]:
    """(text, label): a user's file whole, or the bundled text without its header."""
    if path is None:
        return strip_header(default_text_path().read_text(encoding="utf-8")), DEFAULT_TEXT
    text = Path(path).read_text(encoding="utf-8")
    if not text.strip():
        raise ValueError(f"{path} is empty")
    return text, str(path)


def tokenize(llm: Any, text: str) -> list[int]:
    """The engine's own tokenizer, as a text prompt would be tokenised (tokenizer.encode, its special tokens)."""
    tok = llm.get_tokenizer()
    if tok is None:
        raise ValueError("this model has no tokenizer, so it cannot read a text; give a model folder with one")
    return list(tok.encode(text))


# ---- windows ----------------------------------------------------------------------------------------------

def make_windows(num_tokens: int, cfg: PerplexityConfig) -> list[Window]:
    """Windows over num_tokens tokens. Token 0 has no prefix and is never scored; with overlap (stride < context)
    a window scores only the tokens past the previous window's end, so every token counts once."""
    windows: list[Window] = []
    scored_end, left = 0, cfg.max_tokens_scored
    for begin in range(0, max(num_tokens - 1, 0), cfg.step):
        end = min(begin + cfg.context, num_tokens)
        first = max(scored_end, begin + 1)
        if left is not None:
            end = min(end, first + left)
        if first < end:
            windows.append(Window(begin, end, first))
            if left is not None:
                left -= end - first
        scored_end = end
        if end >= num_tokens or left == 0:
            break
    return windows


def _batches(windows: Sequence[Window], n: int) -> Iterable[Sequence[Window]]:
    for i in range(0, len(windows), n):
        yield windows[i:i + n]


# ---- scoring ----------------------------------------------------------------------------------------------

def _params() -> Any:
    from tokenmill import SamplingParams

    # prompt_logprobs=0: only the actual next token's logprob per position (no top-N dicts to build);
    # one greedy token is the least the engine generates, and it is not scored
    return SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False)


def _window_nll(out: Any, ids: Sequence[int], w: Window) -> list[float]:
    """-log p of each scored token of w, read from the engine's prompt logprobs (entry j: token begin+j)."""
    lps = out.prompt_logprobs
    if lps is None or len(lps) != w.end - w.begin:
        # e.g. a prefix-cache hit skips the cached positions' logits: refuse a silently partial score
        raise RuntimeError(f"the engine returned {0 if lps is None else len(lps)} prompt logprobs for a "
                           f"{w.end - w.begin}-token window")
    nll = []
    for pos in range(w.first_scored, w.end):
        entry = lps[pos - w.begin]
        tok = ids[pos]
        if entry is None or tok not in entry:
            raise RuntimeError(f"no logprob for token {tok} at position {pos}")
        nll.append(-entry[tok].logprob)
    return nll


def score_windows(llm: Any, ids: Sequence[int], windows: Sequence[Window], cfg: PerplexityConfig,
                  progress: bool = True) -> list[float]:
    """Negative log-likelihood of every scored token, in text order."""
    from tqdm.auto import tqdm

    params = _params()
    nll: list[float] = []
    with tqdm(total=sum(w.num_scored for w in windows), desc="perplexity", unit="tok", disable=not progress,
              dynamic_ncols=True) as bar:
        for batch in _batches(windows, cfg.windows_per_call):
            prompts = [{"prompt_token_ids": list(ids[w.begin:w.end])} for w in batch]
            for out, w in zip(llm.generate(prompts, params, use_tqdm=False), batch):
                nll.extend(_window_nll(out, ids, w))
                bar.update(w.num_scored)
    return nll


def perplexity_of_ids(llm: Any, ids: Sequence[int], cfg: PerplexityConfig, progress: bool = True) -> dict[str, Any]:
    """Score token ids on an engine: tokens scored, mean NLL (nats), perplexity, seconds."""
    windows = make_windows(len(ids), cfg)
    if not windows:
        raise ValueError(f"the text has {len(ids)} token(s); perplexity needs at least 2")
    t = time.perf_counter()
    nll = score_windows(llm, ids, windows, cfg, progress)
    elapsed = time.perf_counter() - t
    mean = math.fsum(nll) / len(nll)
    return {"kind": "perplexity", "text_tokens": len(ids), "tokens_scored": len(nll), "windows": len(windows),
            "context": cfg.context, "stride": cfg.step, "mean_nll": mean, "perplexity": math.exp(mean),
            "elapsed_s": elapsed, "tok_s": len(nll) / elapsed if elapsed > 0 else None}


# ---- the machine ------------------------------------------------------------------------------------------

def machine_info(llm: Any) -> dict[str, Any]:
    """What the result depends on besides the model: the machine record, the device and dtype that ran."""
    from tokenmill.executor.kernels import machine_record

    cfg = getattr(getattr(llm, "llm_engine", None), "config", None)
    rec = machine_record(getattr(cfg, "cpu_kernels", "auto"))
    return {**rec, "device": str(getattr(cfg, "device", "")) or None,
            "dtype": str(getattr(cfg, "dtype", "")).removeprefix("torch.") or None,
            "cpu_kernels": rec["tokenmill_kernels"]}


# ---- the command --------------------------------------------------------------------------------------------

def run_perplexity(llm: Any, text: str, cfg: PerplexityConfig, warmup: bool = True,
                   progress: bool = True) -> dict[str, Any]:
    """Tokenise text with the engine's tokenizer and score it; the result carries the machine it ran on."""
    ids = tokenize(llm, text)
    if warmup:
        from .offline import _warmup, model_vocab

        _warmup(llm, model_vocab(llm))   # first calls pay for allocation; keep them out of the seconds
    r = perplexity_of_ids(llm, ids, cfg, progress)
    r.update(machine_info(llm))
    return r


def format_report(r: dict[str, Any]) -> str:
    windows = f"{r['windows']} window{'s' if r['windows'] != 1 else ''}"
    return (f"text {r['text']}: {r['text_tokens']:,} tokens, {r['tokens_scored']:,} scored in {windows} "
            f"(context {r['context']}, stride {r['stride']})\n"
            f"mean NLL {r['mean_nll']:.4f} nats/token   perplexity {r['perplexity']:.4f}   "
            f"{r['elapsed_s']:.2f} s\n"
            f"model {r['model']}, dtype {r['dtype']}, kernels {r['cpu_kernels']} on {r['machine']}")
