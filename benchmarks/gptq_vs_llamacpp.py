#!/usr/bin/env python3
"""A GPTQ 4-bit checkpoint on tokenmill's CPU path against llama.cpp's Q4_K_M of the same float weights: decode speed
on a Llama-3.2-1B-shaped model, and perplexity on the bundled SmolLM2-135M.

  .venv/bin/python benchmarks/gptq_vs_llamacpp.py [--part speed|ppl|all] [--pairs 3] [--threads 2]
        [--cache-dir DIR] [--llamacpp-venv DIR] [--speed-out FILE.json] [--ppl-out FILE.json]

Needs llama-cpp-python in --llamacpp-venv (default ${PEERS_DIR:-/tmp/tokenmill-peers}/llamacpp; benchmarks/run.py
makes one) for the Q4_K_M files and the speed peer, and tests/quant_tools.py for the GPTQ writers (its
llm-compressor tool venv is built on first use). Files go to --cache-dir (default ~/.cache/tokenmill/bench-models),
outside the repo; a step whose output exists is skipped.

speed (benchmarks/results/2026-11-27-gptq-1b.json):
  1. benchmarks/make_kquant_models.py --shape llama-3.2-1b --keep-f16: random weights (std 0.02) as an F16 GGUF,
     and llama.cpp's quantiser's Q4_K_M of it;
  2. that F16 GGUF as a float16 HF folder (tokenmill's gguf_to_hf: the GGUF reader's tensors under HF names);
  3. a GPTQ folder of it in the legacy GPTQ v1 format (qweight/qzeros/scales/g_idx; 4 bits, group 128,
     symmetric as GPTQ's default, or --asym; desc_act off), by round-to-nearest (tests/quant_tools.py's
     write_gptq_legacy): a random model has nothing for GPTQ's error feedback to fit, and the speed depends on
     the format, not on the rounding;
  4. benchmarks/quant_vs_llamacpp.py Q4_K_M --tm-model GPTQ-folder: llama.cpp on the Q4_K_M, tokenmill on the GPTQ
     folder, fresh processes, a warm-up pair and --pairs counted ones, token-id prompts (256 in, 64 out).

ppl (benchmarks/results/2026-11-27-gptq-ppl.json), on the bundled SmolLM2-135M-Instruct (a Q4_1 GGUF):
  1. its weights dequantised to a float32 HF folder (the "float" model: Q4_1's values exactly);
  2. GPTQ W4A16 of that folder by llm-compressor's GPTQModifier (real GPTQ: Hessians from calibration text,
     asymmetric, compressed-tensors pack-quantized), calibrated on the GPL-3/GPL-2/Apache-2.0 licence texts in
     /usr/share/common-licenses (not the scored text). SmolLM2-135M's hidden size is 576, which is not a multiple
     of 128, so group 128 cannot be made for its q/k/v/gate/up rows (576 = 4.5 x 128); groups 64 and 192 (the
     nearest sizes that divide both 576 and 1536) bracket it. Also an RTN legacy-GPTQ g64 folder, for scale;
  3. Q4_K_M of the same float folder (tokenmill quantize -> llama.cpp's quantiser), and a Q4_0 (tokenmill's own
     writer) as a plain 4-bit reference, since rows of 576 make most of the "Q4_K_M" Q5_0 and Q8_0;
  4. `tokenmill bench perplexity` on each (the bundled text, context 512, no overlap): float; GPTQ both with
     --no-int8-activations (the exact route) and the default (activations rounded to int8 per block, as
     llama.cpp does); Q4_K_M (default route); and the bundled Q4_1 file for reference.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PEERS = Path(os.environ.get("PEERS_DIR") or Path(os.environ.get("TMPDIR", "/tmp")) / "tokenmill-peers")
DEFAULT_CACHE = Path("~/.cache/tokenmill/bench-models").expanduser()
SHAPE = "llama-3.2-1b"
CALIBRATION_TEXTS = ["/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/GPL-2",
                     "/usr/share/common-licenses/Apache-2.0"]
CALIB_SEQ, CALIB_SAMPLES = 256, 32


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def quant_tools():
    sys.path.insert(0, str(ROOT / "tests"))
    import quant_tools
    return quant_tools


def float_folder(gguf: Path, out: Path, dtype: str) -> Path:
    """The GGUF's weights (dequantised if quantised) as a HF folder, by tokenmill's own converter."""
    if not (out / "model.safetensors").exists():
        import torch
        from tokenmill.executor.loader.convert import gguf_to_hf
        log(f"writing {out} ({dtype}) from {gguf.name}")
        gguf_to_hf(str(gguf), str(out), getattr(torch, dtype))
    return out


def legacy_gptq(src: Path, out: Path, group: int, sym: bool = False) -> Path:
    """Round-to-nearest GPTQ v1 folder (4 bits, no act order)."""
    if not (out / "model.safetensors").exists():
        log(f"writing {out} (legacy GPTQ v1, RTN, 4 bits, group {group}, {'symmetric' if sym else 'asymmetric'})")
        t = time.perf_counter()
        quant_tools().write_gptq_legacy(src, out, bits=4, group_size=group, sym=sym)
        log(f"  {time.perf_counter() - t:.0f} s")
    return out


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def llamacpp_info(venv: Path) -> dict:
    code = ("import json, llama_cpp; i = llama_cpp.llama_print_system_info(); "
            "print(json.dumps({'version': llama_cpp.__version__, 'system_info': i.decode() if isinstance(i, bytes) "
            "else str(i)}))")
    p = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True)
    return json.loads(p.stdout) if p.returncode == 0 else {"error": p.stderr[-500:]}


# ---- speed -----------------------------------------------------------------------------------------------------
def part_speed(a: argparse.Namespace) -> None:
    d = a.cache_dir / SHAPE
    f16, q4 = d / f"{SHAPE}-random-F16.gguf", d / f"{SHAPE}-random-Q4_K_M.gguf"
    if not q4.exists() or not f16.exists():
        if q4.exists():                               # make_kquant_models skips everything once the Q4_K_M exists
            sys.path.insert(0, str(ROOT / "benchmarks"))
            import make_kquant_models as mk
            mk.write_f16_gguf(mk.hf_config(SHAPE, False), SHAPE, f16)
        else:
            subprocess.run([sys.executable, str(ROOT / "benchmarks" / "make_kquant_models.py"), "--shape", SHAPE,
                            "--keep-f16", "--cache-dir", str(a.cache_dir), "--llamacpp-venv", str(a.llamacpp_venv),
                            "--threads", str(os.cpu_count())], check=True)
    hf = float_folder(f16, d / "hf-f16", "float16")
    sym = not a.asym
    gptq = legacy_gptq(hf, d / f"gptq-w4-g128-rtn{'-sym' if sym else ''}", 128, sym)
    log(f"GPTQ folder {folder_bytes(gptq) / 2**30:.2f} GiB, Q4_K_M {q4.stat().st_size / 2**30:.2f} GiB")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "quant_vs_llamacpp.py"), str(q4), "--tm-model", str(gptq),
           "--threads", str(a.threads), "--pairs", str(a.pairs), "--llamacpp-venv", str(a.llamacpp_venv),
           "--out", str(a.speed_out)]
    log(" ".join(cmd))
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    res = json.loads(Path(a.speed_out).read_text())
    res["gptq"] = {"folder": str(gptq), "made_by": "round-to-nearest (tests/quant_tools.write_gptq_legacy), "
                   f"legacy GPTQ v1 format, 4 bits, group 128, {'symmetric' if sym else 'asymmetric'}, "
                   "desc_act off",
                   "from": str(f16), "safetensors_bytes": folder_bytes(gptq)}
    Path(a.speed_out).write_text(json.dumps(res, indent=1) + "\n")
    s, r = res["summary"], res["ratios_tokenmill_over_llamacpp"]
    for k in ("decode_tok_s", "ttft_s", "prefill_tok_s", "peak_rss_gb", "load_s"):
        log(f"{k}: tokenmill {s['tokenmill'][k].get('median')}, llama.cpp {s['llama.cpp'][k].get('median')}, "
            f"ratio {r[k].get('median')} ({r[k].get('pairs')})")


# ---- perplexity ------------------------------------------------------------------------------------------------
# run by the llm-compressor tool venv's python: argv = SRC OUT GROUP CALIB_JSON; GPTQ W4 asymmetric, lm_head float
_GPTQ_SCRIPT = r'''
import json, sys, time
import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

src, out, group, calib = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
samples = json.load(open(calib))
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
tok = PreTrainedTokenizerFast.from_pretrained(src)
data = Dataset.from_dict({"input_ids": samples, "attention_mask": [[1] * len(s) for s in samples]})
scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
    num_bits=4, type="int", strategy="group", group_size=group, symmetric=False))
t = time.time()
oneshot(model=model, processor=tok, recipe=GPTQModifier(config_groups={"group_0": scheme}, ignore=["lm_head"]),
        dataset=data, num_calibration_samples=len(samples), max_seq_length=len(samples[0]))
model.save_pretrained(out, save_compressed=True)
tok.save_pretrained(out)
print(json.dumps({"seconds": round(time.time() - t, 1)}))
'''


def calibration_ids(tokenizer_src: Path, out: Path) -> Path:
    from tokenmill.tokenizer import load_tokenizer
    tok = load_tokenizer(str(tokenizer_src))
    ids: list[int] = []
    for f in CALIBRATION_TEXTS:
        ids += tok.encode(Path(f).read_text(encoding="utf-8", errors="replace"))
    n = min(CALIB_SAMPLES, len(ids) // CALIB_SEQ)
    out.write_text(json.dumps([ids[i * CALIB_SEQ:(i + 1) * CALIB_SEQ] for i in range(n)]))
    log(f"calibration: {n} samples of {CALIB_SEQ} tokens from {', '.join(CALIBRATION_TEXTS)}")
    return out


def real_gptq(src: Path, out: Path, group: int, calib: Path) -> Path:
    if not (out / "config.json").exists():
        py = quant_tools().tool_python()
        if py is None:
            raise RuntimeError(quant_tools().last_error)
        log(f"llm-compressor GPTQ W4A16 asymmetric, group {group} -> {out}")
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONNOUSERSITE="1")
        env.pop("PYTHONPATH", None)
        p = subprocess.run([py, "-c", _GPTQ_SCRIPT, str(src), str(out), str(group), str(calib)], capture_output=True,
                           text=True, env=env)
        if p.returncode != 0:
            raise RuntimeError(f"llm-compressor failed: {p.stderr[-3000:]}")
        log(f"  {p.stdout.strip().splitlines()[-1]}")
    return out


def perplexity(model: Path, extra: list[str], threads: int) -> dict:
    cmd = [str(Path(sys.executable).parent / "tokenmill"), "bench", "perplexity", "--model", str(model), "--json",
           "--context", "512", *extra]
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
    if p.returncode != 0:
        return {"error": p.stderr[-4000:], "cmd": cmd}
    r = json.loads(p.stdout.strip().splitlines()[-1])
    r["cmd"] = " ".join(cmd[1:])
    r["wall_s"] = time.perf_counter() - t
    return r


def part_ppl(a: argparse.Namespace) -> None:
    from tokenmill.executor.loader import default_model_path
    from tokenmill.executor.loader.gguf_writer import quantize_model
    bundled = Path(default_model_path())
    d = a.cache_dir / "smollm2-135m"
    d.mkdir(parents=True, exist_ok=True)
    hf = float_folder(bundled, d / "hf-f32", "float32")
    calib = calibration_ids(hf, d / "calibration.json")
    models = {"float (Q4_1 dequantised, float32 folder)": (hf, "float")}
    for g in (64, 192):
        models[f"GPTQ W4A16 g{g} asym (llm-compressor)"] = (real_gptq(hf, d / f"gptq-w4-g{g}-llmc", g, calib), "gptq")
    models["GPTQ W4 g64 asym (RTN, legacy format)"] = (legacy_gptq(hf, d / "gptq-w4-g64-rtn", 64), "gptq")
    q4 = d / "smollm2-135m-Q4_K_M.gguf"
    if not q4.exists():
        log(f"writing {q4} (llama.cpp's quantiser)")
        if not os.environ.get("PEERS_DIR") and a.llamacpp_venv != PEERS / "llamacpp":
            os.environ["PEERS_DIR"] = str(a.llamacpp_venv.parent)
        quantize_model(str(hf), str(q4), "q4_k_m", progress=False)
    models["Q4_K_M (llama.cpp)"] = (q4, "gguf")
    q40 = d / "smollm2-135m-Q4_0.gguf"          # a plain 4-bit reference: every matrix in rows of 32
    if not q40.exists():
        quantize_model(str(hf), str(q40), "q4_0", progress=False)
    models["Q4_0 (tokenmill's writer)"] = (q40, "gguf")
    models["bundled Q4_1 GGUF"] = (bundled, "gguf")

    rows = []
    for name, (path, kind) in models.items():
        routes = [("exact (--no-int8-activations)", ["--no-int8-activations"]), ("default", [])] \
            if kind == "gptq" else [("default", [])]
        for route, extra in routes:
            log(f"perplexity: {name}, {route}")
            r = perplexity(path, extra + ["--threads", str(a.threads)], a.threads)
            size = path.stat().st_size if path.suffix == ".gguf" else folder_bytes(path)
            rows.append({"model": name, "route": route, "path": str(path), "bytes": size, **r})
            if "error" in r:
                log(f"  FAILED: {r['error'][-1500:]}")
            else:
                log(f"  perplexity {r['perplexity']:.4f} (mean NLL {r['mean_nll']:.4f}, {r['tokens_scored']} tokens, "
                    f"{r['tok_s']:.0f} tok/s, dtype {r.get('dtype')})")
    from tokenmill.executor.kernels import machine_record
    res = {"date": time.strftime("%Y-%m-%d %H:%M"), **machine_record(), "llama_cpp": llamacpp_info(a.llamacpp_venv),
           "calibration": {"texts": CALIBRATION_TEXTS, "samples": CALIB_SAMPLES, "seq_len": CALIB_SEQ},
           "notes": ["the float model is the bundled Q4_1 GGUF dequantised: every other row re-quantises those values",
                     "SmolLM2-135M's hidden size 576 is not a multiple of 128: GPTQ group 128 cannot be made for its "
                     "q/k/v/gate/up rows, so groups 64 and 192 bracket it",
                     "llama.cpp's Q4_K_M needs rows of 256: for rows of 576 its quantiser falls back (Q4_K -> Q5_0, "
                     "Q6_K -> Q8_0), so only the down projections are K-quants here; see bytes",
                     "perplexity scores 512-token prompts, whose matmuls run on dequantised tiles and a GEMM: the "
                     "int8 rounding of activations (decode steps of up to 16 rows) does not apply there, so the "
                     "exact and default routes give the same figures"],
           "rows": rows}
    Path(a.ppl_out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.ppl_out).write_text(json.dumps(res, indent=1) + "\n")
    log(f"wrote {a.ppl_out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["speed", "ppl", "all"], default="all")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--asym", action="store_true", help="the speed part's GPTQ folder asymmetric (default: "
                    "symmetric, GPTQ's own default)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--llamacpp-venv", type=Path, default=PEERS / "llamacpp")
    ap.add_argument("--speed-out", default=str(ROOT / "benchmarks" / "results" / "2026-11-27-gptq-1b.json"))
    ap.add_argument("--ppl-out", default=str(ROOT / "benchmarks" / "results" / "2026-11-27-gptq-ppl.json"))
    a = ap.parse_args()
    if a.part in ("ppl", "all"):
        part_ppl(a)
    if a.part in ("speed", "all"):
        part_speed(a)


if __name__ == "__main__":
    main()
