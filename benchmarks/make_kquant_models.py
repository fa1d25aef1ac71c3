#!/usr/bin/env python3
"""Random-weight models of real shapes (Llama 3, Gemma 3), quantised to Q4_K_M (or Q5_K_M) by llama.cpp's own
quantiser.

  .venv/bin/python benchmarks/make_kquant_models.py --shape llama-3.2-1b [--shape llama-3.1-8b] [--shape gemma-3-270m]
        [--type Q4_K_M|Q5_K_M] [--cache-dir DIR] [--keep-f16] [--llamacpp-venv DIR] [--threads N] [--plain-rope]
        [--no-check]

Per shape, in <cache-dir>/<shape>/ (default cache dir ~/.cache/tokenmill/bench-models, outside the repo):
  1. config.json: a transformers config of the model's shape (Llama-3.2-1B, Llama-3.1-8B; Gemma-3-270M's text
     model: 18 layers, 5 local of window 512 to 1 global, 4 heads over 1 kv head of 256, vocabulary 262,144);
  2. <shape>-random-F16.gguf: that model with random weights (normal, std 0.02; norms 1.0; fixed seed), written
     tensor by tensor with gguf-py (one tensor in memory at a time: the 8B one is 16 GB on disk), under
     llama.cpp's tensor names and "llama" or "gemma3" keys (Gemma's norms stored as 1 + w, as its converter
     writes them), with a byte-level BPE vocabulary of the model's size (128,256 or 262,144 tokens;
     tokenizer.ggml.model "gpt2", pre "llama-bpe") that any text tokenizes with;
  3. <shape>-random-<type>.gguf: llama.cpp's llama_model_quantize (LLAMA_FTYPE_MOSTLY_<type>), run with the
     llama-cpp-python venv's python; the F16 file is deleted afterwards unless --keep-f16;
  4. a check that llama.cpp loads the quantised file and evaluates a few tokens.
A step whose output exists is skipped. Timings: 1B ~1 min to write, a few to quantise; 8B ~16 GB written and
~10-20 min of quantising on 2 cores.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

PEERS = Path(os.environ.get("PEERS_DIR") or Path(os.environ.get("TMPDIR", "/tmp")) / "tokenmill-peers")
DEFAULT_CACHE = Path("~/.cache/tokenmill/bench-models").expanduser()

# Meta's published shapes (vocab 128,256; rope theta 500,000 with llama3 rope scaling)
SHAPES: dict[str, dict] = {
    "llama-3.2-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=64, intermediate_size=8192, tie_word_embeddings=True, rope_factor=32.0),
    "llama-3.1-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, intermediate_size=14336, tie_word_embeddings=False, rope_factor=8.0),
    # Google's gemma-3-270m (text): the config's own values; tied embeddings are most of its weights
    "gemma-3-270m": dict(family="gemma3", hidden_size=640, num_hidden_layers=18, num_attention_heads=4,
                         num_key_value_heads=1, head_dim=256, intermediate_size=2048, tie_word_embeddings=True,
                         vocab_size=262144, sliding_window=512, pattern=6),
}
VOCAB = 128256
N_SPECIAL = 256                     # Llama 3: ids 128000..128255 are special tokens (the last 256 of any vocab)
BOS, EOS, EOT = 128000, 128001, 128009
STD = 0.02
SEED = 0


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- 1. the transformers config ----------------------------------------------------------------------------
def hf_config(shape: str, plain_rope: bool):
    from transformers import LlamaConfig
    s = SHAPES[shape]
    if s.get("family") == "gemma3":
        return gemma3_config(s)
    rope_scaling = None if plain_rope else {
        "rope_type": "llama3", "factor": s["rope_factor"], "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}
    kw = dict(vocab_size=VOCAB, hidden_size=s["hidden_size"], intermediate_size=s["intermediate_size"],
              num_hidden_layers=s["num_hidden_layers"], num_attention_heads=s["num_attention_heads"],
              num_key_value_heads=s["num_key_value_heads"], head_dim=s["head_dim"], hidden_act="silu",
              max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
              tie_word_embeddings=s["tie_word_embeddings"], bos_token_id=BOS, eos_token_id=EOS,
              attention_bias=False, mlp_bias=False, torch_dtype="bfloat16", architectures=["LlamaForCausalLM"])
    try:   # transformers >= 5 keeps theta and scaling in rope_parameters
        cfg = LlamaConfig(**kw, rope_parameters={"rope_theta": 500000.0, **(rope_scaling or {"rope_type": "default"})})
    except TypeError:
        cfg = LlamaConfig(**kw, rope_scaling=rope_scaling)
    return cfg


def gemma3_config(s: dict):
    from transformers import Gemma3TextConfig
    L, n = s["num_hidden_layers"], s["pattern"]
    special = special_ids(s["vocab_size"])
    return Gemma3TextConfig(
        vocab_size=s["vocab_size"], hidden_size=s["hidden_size"], intermediate_size=s["intermediate_size"],
        num_hidden_layers=L, num_attention_heads=s["num_attention_heads"],
        num_key_value_heads=s["num_key_value_heads"], head_dim=s["head_dim"], query_pre_attn_scalar=s["head_dim"],
        sliding_window=s["sliding_window"], max_position_embeddings=32768, rms_norm_eps=1e-6,
        layer_types=["full_attention" if (i + 1) % n == 0 else "sliding_attention" for i in range(L)],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        tie_word_embeddings=True, bos_token_id=special["bos"], eos_token_id=special["eos"],
        torch_dtype="bfloat16", architectures=["Gemma3ForCausalLM"])


def special_ids(vocab: int) -> dict[str, int]:
    """The begin, end and end-of-turn ids of a vocabulary whose last N_SPECIAL ids are special (Llama 3's)."""
    first = vocab - N_SPECIAL
    return {"bos": first + BOS - 128000, "eos": first + EOS - 128000, "eot": first + EOT - 128000}


def cfg_get(cfg, name: str):
    return getattr(cfg, name)


def rope_scaling_of(cfg) -> dict | None:
    rp = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    return rp if rp.get("rope_type", rp.get("type")) == "llama3" else None


def rope_theta_of(cfg) -> float:
    rp = getattr(cfg, "rope_parameters", None) or {}
    return float(rp.get("rope_theta") or getattr(cfg, "rope_theta", 10000.0))


def llama3_rope_factors(cfg):
    """rope_freqs.weight as convert_hf_to_gguf writes it for rope_type llama3: one divisor per rotary pair."""
    import torch
    sc = rope_scaling_of(cfg)
    dim = cfg.head_dim
    freqs = 1.0 / (rope_theta_of(cfg) ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = sc["factor"], sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
    old = sc.get("original_max_position_embeddings", 8192)
    low_wl, high_wl = old / low, old / high
    out = []
    for f in freqs.tolist():
        wl = 2 * math.pi / f
        if wl < high_wl:
            out.append(1.0)
        elif wl > low_wl:
            out.append(factor)
        else:
            smooth = (old / wl - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


# ---- 2. the vocabulary -------------------------------------------------------------------------------------
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (as in transformers / tiktoken-style byte-level BPE)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def vocabulary(vocab: int = VOCAB) -> tuple[list[str], list[int], list[str]]:
    """vocab - 256 byte-level BPE tokens (the 256 bytes, then 2-, 3- and 4-character merges over letters and the
    space character "Ġ", every one reachable by the merges listed) and Llama 3's 256 special tokens."""
    byte_tokens = [bytes_to_unicode()[b] for b in range(256)]
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)] + ["Ġ"]
    tokens, merges = list(byte_tokens), []
    seen = set(tokens)
    pairs = [a + b for a in letters for b in letters]
    for p in pairs:
        merges.append(f"{p[0]} {p[1]}")
        tokens.append(p)
        seen.add(p)
    n_plain = vocab - N_SPECIAL
    stems = pairs
    while len(tokens) < n_plain:            # longer merges until the vocabulary is full
        longer = []
        for p in stems:
            for c in letters:
                if len(tokens) >= n_plain:
                    break
                t = p + c
                if t not in seen:
                    merges.append(f"{p} {c}")
                    tokens.append(t)
                    seen.add(t)
                    longer.append(t)
        stems = longer
    assert len(tokens) == n_plain, len(tokens)
    special = {0: "<|begin_of_text|>", 1: "<|end_of_text|>", 4: "<|finetune_right_pad_id|>",
               6: "<|start_header_id|>", 7: "<|end_header_id|>", 8: "<|eom_id|>", 9: "<|eot_id|>",
               10: "<|python_tag|>"}
    r = 0
    for i in range(N_SPECIAL):
        if i not in special:
            special[i] = f"<|reserved_special_token_{r}|>"
            r += 1
        tokens.append(special[i])
    types = [1] * n_plain + [3] * N_SPECIAL          # 1 normal, 3 control
    return tokens, types, merges


# ---- 3. the F16 GGUF, streamed --------------------------------------------------------------------------------
def tensor_plan(cfg, with_rope_freqs: bool) -> list[tuple[str, tuple[int, ...], str]]:
    """(llama.cpp name, torch shape (rows, cols), kind) in the order convert_hf_to_gguf writes them."""
    h, f, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    hd, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    if cfg.model_type == "gemma3_text":
        plan = [("token_embd.weight", (cfg.vocab_size, h), "mat")]
        for i in range(L):
            b = f"blk.{i}."
            plan += [(b + "attn_norm.weight", (h,), "norm"), (b + "attn_q.weight", (nh * hd, h), "mat"),
                     (b + "attn_k.weight", (nkv * hd, h), "mat"), (b + "attn_v.weight", (nkv * hd, h), "mat"),
                     (b + "attn_q_norm.weight", (hd,), "norm"), (b + "attn_k_norm.weight", (hd,), "norm"),
                     (b + "attn_output.weight", (h, nh * hd), "mat"), (b + "post_attention_norm.weight", (h,), "norm"),
                     (b + "ffn_norm.weight", (h,), "norm"), (b + "ffn_gate.weight", (f, h), "mat"),
                     (b + "ffn_up.weight", (f, h), "mat"), (b + "ffn_down.weight", (h, f), "mat"),
                     (b + "post_ffw_norm.weight", (h,), "norm")]
        return plan + [("output_norm.weight", (h,), "norm")]
    plan = [("token_embd.weight", (VOCAB, h), "mat")]
    if with_rope_freqs:
        plan.append(("rope_freqs.weight", (hd // 2,), "rope"))
    for i in range(L):
        b = f"blk.{i}."
        plan += [(b + "attn_norm.weight", (h,), "norm"),
                 (b + "ffn_down.weight", (h, f), "mat"),
                 (b + "ffn_gate.weight", (f, h), "mat"),
                 (b + "ffn_up.weight", (f, h), "mat"),
                 (b + "ffn_norm.weight", (h,), "norm"),
                 (b + "attn_k.weight", (nkv * hd, h), "mat"),
                 (b + "attn_output.weight", (h, nh * hd), "mat"),
                 (b + "attn_q.weight", (nh * hd, h), "mat"),
                 (b + "attn_v.weight", (nkv * hd, h), "mat")]
    plan.append(("output_norm.weight", (h,), "norm"))
    if not cfg.tie_word_embeddings:
        plan.append(("output.weight", (VOCAB, h), "mat"))
    return plan


def write_f16_gguf(cfg, shape: str, out: Path) -> None:
    import numpy as np
    import torch
    import gguf

    gemma = cfg.model_type == "gemma3_text"
    vocab = cfg.vocab_size
    tokens, types, merges = vocabulary(vocab)
    special = special_ids(vocab)
    tmp = out.with_suffix(".gguf.part")
    w = gguf.GGUFWriter(str(tmp), "gemma3" if gemma else "llama")
    # the keys convert_hf_to_gguf writes for a Llama 3 model
    w.add_type("model")
    w.add_name(f"{shape} (random weights, for benchmarks)")
    w.add_size_label(shape.split("-")[-1].upper())
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(1000000.0 if gemma else rope_theta_of(cfg))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    if gemma:         # the local layers' rope base (10,000) and query scale (head_dim) are llama.cpp's for Gemma 3
        w.add_sliding_window(cfg.sliding_window)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_vocab_size(vocab)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(special["bos"])
    w.add_eos_token_id(special["eos"])
    w.add_eot_token_id(special["eot"])
    w.add_add_bos_token(True)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    plan = tensor_plan(cfg, rope_scaling_of(cfg) is not None)
    for name, shp, kind in plan:   # infos first (sizes only): the data is made one tensor at a time below
        dt = np.float16 if kind == "mat" else np.float32
        n = math.prod(shp) * np.dtype(dt).itemsize
        w.add_tensor_info(name, shp, np.dtype(dt), n)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()

    total = sum(math.prod(s) * (2 if k == "mat" else 4) for _, s, k in plan)
    try:
        from tqdm import tqdm
        bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {out.name}", file=sys.stderr)
    except ImportError:
        bar = None
    g = torch.Generator().manual_seed(SEED)
    done = 0
    for name, shp, kind in plan:
        if kind == "mat":
            t = torch.randn(shp, dtype=torch.float16, generator=g).mul_(STD)
        elif kind == "norm":        # (Gemma's 1 + w with w = 0: the same ones)
            t = torch.ones(shp, dtype=torch.float32)
        else:
            t = llama3_rope_factors(cfg)
        arr = t.numpy()
        w.write_tensor_data(arr)
        done += arr.nbytes
        del t, arr
        if bar is not None:
            bar.update(math.prod(shp) * (2 if kind == "mat" else 4))
        elif name.endswith("attn_v.weight") or name in ("token_embd.weight", "output.weight"):
            log(f"  {name}: {done / 2**30:.2f} / {total / 2**30:.2f} GiB")
    if bar is not None:
        bar.close()
    w.close()
    tmp.rename(out)


# ---- 4. llama.cpp's quantiser and a load check ---------------------------------------------------------------
QUANTIZE = r"""
import ctypes, sys, llama_cpp
src, dst, nthread, ftype = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
llama_cpp.llama_backend_init()
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + ftype)
p.nthread = nthread
rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(p))
sys.exit(rc)
"""

CHECK = r"""
import json, sys, time
from llama_cpp import Llama
t = time.perf_counter()
llm = Llama(model_path=sys.argv[1], n_ctx=512, n_threads=int(sys.argv[2]), verbose=False)
load = time.perf_counter() - t
toks = llm.tokenize(b"Hello world, the quick brown fox", add_bos=True)
llm.eval(toks)
out = [int(llm.sample(temp=0.0))]
for _ in range(3):
    llm.eval(out[-1:])
    out.append(int(llm.sample(temp=0.0)))
print(json.dumps({"load_s": round(load, 2), "n_vocab": llm.n_vocab(), "prompt_tokens": toks, "greedy": out,
                  "ftype": llm.metadata.get("general.file_type")}))
"""


def run_peer(py: Path, code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(py), "-c", code, *map(str, args)], text=True, capture_output=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", action="append", choices=sorted(SHAPES), required=True,
                    help="model shape (repeatable)")
    ap.add_argument("--type", default="Q4_K_M", choices=["Q4_K_M", "Q5_K_M"], help="llama.cpp's file type")
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--keep-f16", action="store_true", help="keep the F16 intermediate")
    ap.add_argument("--llamacpp-venv", type=Path, default=PEERS / "llamacpp",
                    help="venv with llama-cpp-python (its quantiser and the load check)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="quantiser and check threads")
    ap.add_argument("--plain-rope", action="store_true", help="no llama3 rope scaling (no rope_freqs tensor)")
    ap.add_argument("--no-check", action="store_true", help="skip the llama.cpp load check")
    a = ap.parse_args()
    py = a.llamacpp_venv / "bin" / "python"
    if not py.exists():
        sys.exit(f"no llama-cpp-python venv at {a.llamacpp_venv} (benchmarks/run.py makes one; or --llamacpp-venv)")

    for shape in a.shape:
        d = a.cache_dir / shape
        d.mkdir(parents=True, exist_ok=True)
        cfg = hf_config(shape, a.plain_rope)
        cfg_path = d / "config.json"
        cfg.to_json_file(str(cfg_path))
        f16 = d / f"{shape}-random-F16.gguf"
        q4 = d / f"{shape}-random-{a.type}.gguf"
        timings: dict[str, float] = {}
        log(f"{shape}: {cfg_path}")

        if q4.exists():
            log(f"{shape}: {q4.name} exists, skipping the F16 and quantising steps")
        else:
            if f16.exists():
                log(f"{shape}: {f16.name} exists, skipping")
            else:
                t = time.perf_counter()
                write_f16_gguf(cfg, shape, f16)
                timings["write_f16_s"] = time.perf_counter() - t
                log(f"{shape}: wrote {f16} ({f16.stat().st_size / 2**30:.2f} GiB) in {timings['write_f16_s']:.0f} s")
            t = time.perf_counter()
            tmp = q4.with_suffix(".gguf.part")
            log(f"{shape}: quantising to {a.type} with llama.cpp ({a.threads} threads)")
            qlog = d / "quantize.log"
            with open(qlog, "w") as lf:     # written as it goes: `tail -f` it to follow the quantiser
                res = subprocess.run([str(py), "-c", QUANTIZE, str(f16), str(tmp), str(a.threads), a.type],
                                     stdout=lf, stderr=subprocess.STDOUT)
            if res.returncode != 0 or not tmp.exists():
                sys.exit(f"llama_model_quantize failed ({res.returncode}); see {qlog}:\n"
                         f"{qlog.read_text()[-3000:]}")
            tmp.rename(q4)
            timings["quantize_s"] = time.perf_counter() - t
            log(f"{shape}: wrote {q4} ({q4.stat().st_size / 2**30:.2f} GiB) in {timings['quantize_s']:.0f} s; "
                f"llama.cpp's log in {d / 'quantize.log'}")
            if not a.keep_f16:
                f16.unlink()
                log(f"{shape}: deleted {f16.name} (--keep-f16 keeps it)")

        if not a.no_check:
            t = time.perf_counter()
            res = run_peer(py, CHECK, q4, a.threads)
            if res.returncode != 0:
                sys.exit(f"llama.cpp could not load or run {q4}:\n{res.stderr[-3000:]}")
            timings["check_s"] = time.perf_counter() - t
            log(f"{shape}: llama.cpp loads it: {res.stdout.strip().splitlines()[-1]}")
        summary = {"shape": shape, "config": str(cfg_path), "type": a.type, "file": str(q4),
                   "file_bytes": q4.stat().st_size, **{k: round(v, 1) for k, v in timings.items()}}
        print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
