"""`tokenmill bench perplexity`: windows, the bundled text, agreement with transformers, and the CLI end to end."""
from __future__ import annotations

import json
import math

import pytest
import torch

from tests.tiny_models import random_prompts
from tokenmill import LLM
from tokenmill.bench import perplexity as ppl
from tokenmill.bench.cli import main as cli


@torch.no_grad()
def hf_perplexity(model, ids: list[int], context: int, stride: int) -> tuple[float, int]:
    """The oracle, written apart from make_windows: transformers' documented strided loop (labels before the
    previous window's end masked), one forward per window, summed cross-entropy. Returns (perplexity, count)."""
    total, count, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + context, len(ids))
        x = torch.tensor([ids[begin:end]])
        labels = x.clone()
        labels[:, : (end - begin) - (end - prev_end)] = -100
        logits = model(x).logits[0].double()
        target = labels[0, 1:]
        total += torch.nn.functional.cross_entropy(logits[:-1], target, ignore_index=-100, reduction="sum").item()
        count += int((target != -100).sum())
        prev_end = end
        if end == len(ids):
            break
    return math.exp(total / count), count


# ---------------------------------------------------------------- windows

@pytest.mark.parametrize("n,context,stride", [(300, 64, None), (300, 64, 40), (65, 64, None), (64, 64, 1),
                                              (7, 512, None), (1000, 128, 127)])
def test_windows_score_every_token_once(n, context, stride):
    ws = ppl.make_windows(n, ppl.PerplexityConfig(context, stride))
    scored = [t for w in ws for t in range(w.first_scored, w.end)]
    # once each, in order; without overlap a window's first token has no prefix in it and goes unscored
    # (as in transformers' strided recipe), with overlap every token but the text's first is scored
    assert scored == [t for t in range(1, n) if stride is not None or t % context]
    assert all(w.end - w.begin <= context and w.begin < w.first_scored < w.end for w in ws)
    step = stride or context
    assert all(b.begin - a.begin == step for a, b in zip(ws, ws[1:]))


def test_windows_max_tokens_scored():
    cfg = ppl.PerplexityConfig(64, 32, max_tokens_scored=100)
    ws = ppl.make_windows(1000, cfg)
    assert sum(w.num_scored for w in ws) == 100
    assert [t for w in ws for t in range(w.first_scored, w.end)] == list(range(1, 101))
    assert sum(w.num_scored for w in ppl.make_windows(50, cfg)) == 49   # a short text: all of it


@pytest.mark.parametrize("kw", [dict(context=1), dict(context=64, stride=65), dict(context=64, stride=0),
                                dict(max_tokens_scored=0)])
def test_config_rejects_bad_values(kw):
    with pytest.raises(ValueError):
        ppl.PerplexityConfig(**kw)


# ---------------------------------------------------------------- the bundled text

def test_bundled_text_header_and_length(smollm2_tokenizer):
    raw = ppl.default_text_path().read_text(encoding="utf-8")
    assert raw.startswith("# ") and "licence" in raw.splitlines()[0].lower()
    text, label = ppl.load_text(None)
    assert label == ppl.DEFAULT_TEXT and not text.startswith("#") and raw.endswith(text)
    assert 3000 <= len(smollm2_tokenizer.encode(text)) <= 6000


# ---------------------------------------------------------------- agreement with transformers

@pytest.mark.parametrize("stride", [None, 40])
def test_perplexity_equals_transformers(tiny_llama, stride):
    path, model = tiny_llama
    ids = random_prompts([300], seed=5)[0]
    llm = LLM(path, dtype="float32", max_model_len=512, kv_cache_memory_gb=0.02, enable_prefix_caching=False)
    cfg = ppl.PerplexityConfig(context=64, stride=stride, windows_per_call=3)
    r = ppl.perplexity_of_ids(llm, ids, cfg, progress=False)
    want, count = hf_perplexity(model, ids, 64, stride or 64)
    assert r["tokens_scored"] == count == (len(ids) - 1 if stride else len(ids) - 5)   # 5 windows, 5 first tokens
    assert r["perplexity"] == pytest.approx(want, rel=1e-4)
    assert r["mean_nll"] == pytest.approx(math.log(want), rel=1e-4)


def test_overlap_gives_more_context(tiny_llama):
    """Overlapping windows must change the score (every token then sees a longer prefix): the stride is used."""
    path, _ = tiny_llama
    ids = random_prompts([200], seed=6)[0]
    llm = LLM(path, dtype="float32", max_model_len=512, kv_cache_memory_gb=0.02, enable_prefix_caching=False)
    a = ppl.perplexity_of_ids(llm, ids, ppl.PerplexityConfig(context=32), progress=False)
    b = ppl.perplexity_of_ids(llm, ids, ppl.PerplexityConfig(context=32, stride=8), progress=False)
    assert (a["tokens_scored"], b["tokens_scored"]) == (199 - 6, 199)    # 7 windows' first tokens go unscored
    assert a["perplexity"] != pytest.approx(b["perplexity"], rel=1e-6)


def test_text_on_tiny_model_equals_transformers(tiny_text_model, smollm2_tokenizer, tmp_path, capsys):
    """The CLI's path with text: --text through the engine's tokenizer, scored, printed as JSON."""
    path, model = tiny_text_model
    text, _ = ppl.load_text(None)
    f = tmp_path / "t.txt"
    f.write_text(text[:3000], encoding="utf-8")
    rc = cli(["bench", "perplexity", "--model", path, "--text", str(f), "--context", "128", "--stride", "96",
              "--dtype", "float32", "--kv-cache-memory-gb", "0.05", "--json", "--no-warmup"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    ids = smollm2_tokenizer.encode(text[:3000])
    want, count = hf_perplexity(model, ids, 128, 96)
    assert r["text_tokens"] == len(ids) and r["tokens_scored"] == count
    assert r["perplexity"] == pytest.approx(want, rel=1e-4)
    assert r["text"] == str(f) and r["machine"] and isinstance(r["cpu_flags"], list)


def test_model_without_tokenizer_is_refused(tiny_llama, tmp_path, capsys):
    f = tmp_path / "t.txt"
    f.write_text("some text", encoding="utf-8")
    assert cli(["bench", "perplexity", "--model", tiny_llama[0], "--text", str(f), "--context", "64",
                "--kv-cache-memory-gb", "0.02", "--no-warmup", "--no-progress"]) == 2
    assert "no tokenizer" in capsys.readouterr().err


def test_engine_options():
    """--quantization and --(no-)int8-activations reach the engine; prefix caching is always off."""
    import argparse

    from tokenmill.bench.cli import _perplexity_engine_kw, register

    ap = argparse.ArgumentParser()
    register(ap.add_subparsers(dest="command"))
    args = ap.parse_args(["bench", "perplexity", "--cpu-kernels", "reference"])
    kw = _perplexity_engine_kw(args)
    assert kw["quantization"] is None and kw["enable_prefix_caching"] is False and kw["cpu_kernels"] == "reference"
    args = ap.parse_args(["bench", "perplexity", "--quantization", "int8"])
    assert _perplexity_engine_kw(args)["quantization"] == "int8"
    assert kw["int8_activations"] is True
    args = ap.parse_args(["bench", "perplexity", "--no-int8-activations"])
    assert _perplexity_engine_kw(args)["int8_activations"] is False


# ---------------------------------------------------------------- the bundled model, end to end

@pytest.mark.slow
def test_cli_bundled_model_short(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = cli(["bench", "perplexity", "--max-tokens-scored", "300", "--kv-cache-memory-gb", "0.1", "--json",
              "--output", str(out)])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    assert r == json.loads(out.read_text())
    assert r["tokens_scored"] == 300 and r["text"] == ppl.DEFAULT_TEXT
    # a real 135M model on plain English: far better than uniform over 49k tokens, never below 1
    assert math.isfinite(r["perplexity"]) and 1.0 < r["perplexity"] < 200.0
    assert r["perplexity"] == pytest.approx(math.exp(r["mean_nll"]))
    assert r["elapsed_s"] > 0 and r["machine"] and r["cpu_kernels"] != "auto"
