"""Real quantised checkpoints for the loader tests, made at test time from tiny random HF folders.

* compressed-tensors folders (GPTQ, AWQ, W8A16, W8A8, FP8) come from llm-compressor itself, run in a tool venv
  of its own (it pins transformers<=5.17): ${PEERS_DIR:-${TMPDIR:-/tmp}/tokenmill-peers}/llmcompressor, built on
  first use. The venv borrows this interpreter's site-packages (torch above all) through a .pth file placed
  after its own, so only llm-compressor and what it pins beside torch (transformers 5.17, compressed-tensors
  0.19, datasets, ...) are installed: ~22 s, no torch download. A file lock keeps two test processes from
  building it at once; a stamp file marks it complete.
* legacy GPTQ folders (qweight/qzeros/scales/g_idx, GPTQModel/AutoGPTQ "gptq" v1 checkpoint format) and AutoAWQ
  GEMM folders are written here, by round-to-nearest, in the tools' published packings (checked against
  GPTQModel 7.5's and AutoAWQ 0.2.9's own loading/unpacking code, which read back the intended weights).

Helpers only: no tests in this module.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Iterable, Optional

import torch

LLMCOMPRESSOR_SPEC = ["llmcompressor==0.14.0.1", "compressed-tensors==0.19.0", "transformers==5.17.0"]
_VENV_NAME = "llmcompressor"
_STAMP = ".tokenmill-complete"
# the reason the last tool_python() call returned None, for a test's skip message
last_error: Optional[str] = None

# compressed-tensors schemes make_compressed knows (see _CT_SCRIPT for each recipe)
SCHEMES = ("gptq_w4a16", "gptq_w4a16_asym", "gptq_w4a16_asym_g32", "gptq_w8a16", "gptq_w8a8",
           "w4a16", "w8a16", "fp8_dynamic", "awq_w4a16_asym", "awq_w4a16", "fp8_kv")
# the linear layers of a Llama/Mistral/Qwen decoder layer that the quantisers convert
LINEAR_SUFFIXES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def peers_dir() -> str:
    return os.environ.get("PEERS_DIR") or os.path.join(os.environ.get("TMPDIR") or "/tmp", "tokenmill-peers")


def _stamp_value() -> dict:
    return {"spec": LLMCOMPRESSOR_SPEC, "base": sysconfig.get_paths()["purelib"], "torch": torch.__version__,
            "python": sys.version.split()[0]}


def _complete(venv: str) -> bool:
    try:
        return (json.loads(Path(venv, _STAMP).read_text()) == _stamp_value()
                and os.path.isfile(os.path.join(venv, "bin", "python")))
    except (OSError, ValueError):
        return False


def tool_python(build: bool = True, timeout: float = 600) -> Optional[str]:
    """The python of the llm-compressor tool venv, built on first use (None if it can't be: see last_error).

    TOKENMILL_NO_TOOL_BUILD=1 only looks for a finished venv."""
    global last_error
    venv = os.path.join(peers_dir(), _VENV_NAME)
    python = os.path.join(venv, "bin", "python")
    if _complete(venv):
        return python
    if not build or os.environ.get("TOKENMILL_NO_TOOL_BUILD"):
        last_error = f"no llm-compressor tool venv at {venv}"
        return None
    os.makedirs(peers_dir(), exist_ok=True)
    with open(os.path.join(peers_dir(), _VENV_NAME + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)           # another process may be building it: wait, then look again
        try:
            if _complete(venv):
                return python
            return _build(venv, python, timeout)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build(venv: str, python: str, timeout: float) -> Optional[str]:
    global last_error
    shutil.rmtree(venv, ignore_errors=True)
    t0 = time.time()
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, capture_output=True,
                       timeout=60)
        purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 check=True, capture_output=True, text=True, timeout=60).stdout.strip()
        # appended after the venv's own site-packages: its transformers 5.17 shadows ours, our torch is reused
        # (and pip, run from here, sees torch as installed and leaves it be)
        Path(purelib, "_tokenmill_base.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
        # --no-compile: the tests import a small part of these packages; compiling all of them took longer
        proc = subprocess.run([python, "-m", "pip", "install", "--disable-pip-version-check", "-q", "--no-compile",
                               *LLMCOMPRESSOR_SPEC], capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            last_error = f"pip install {' '.join(LLMCOMPRESSOR_SPEC)} failed: {(proc.stdout + proc.stderr)[-2000:]}"
            return None
        check = subprocess.run([python, "-c", "import importlib.metadata as m, torch; print('versions', "
                                "torch.__version__, m.version('transformers'), m.version('llmcompressor'))"],
                               capture_output=True, text=True, timeout=120)
        if check.returncode != 0 or f"versions {torch.__version__} 5.17" not in check.stdout:
            last_error = f"the tool venv does not import as expected: {(check.stdout + check.stderr)[-2000:]}"
            return None
    except (OSError, subprocess.SubprocessError) as e:
        last_error = f"building the llm-compressor venv at {venv} failed: {e}"
        return None
    Path(venv, _STAMP).write_text(json.dumps(_stamp_value()))
    Path(venv, "build-seconds").write_text(f"{time.time() - t0:.1f}\n")
    return python


# Run by the tool venv's python. argv: SRC_FOLDER SCHEME=OUT_FOLDER ...; one json line per job on stdout.
# A model is loaded afresh for each job (oneshot changes it in place); the imports (~4 s) are paid once.
_CT_SCRIPT = r'''
import json, os, sys, time
t0 = time.time()
import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

# AWQ pins its cached activations for faster host-to-device copies; without an accelerator pin_memory raises
# ("Cannot access accelerator device when none is available"), and there is nothing to pin for
if not torch.accelerator.is_available():
    from llmcompressor.pipelines.cache import IntermediatesCache
    IntermediatesCache.pin_memory = lambda self, *a, **k: None

src = sys.argv[1]
jobs = [a.split("=", 1) for a in sys.argv[2:]]
N_SAMPLES, SEQ_LEN = 8, 32
vocab = json.load(open(os.path.join(src, "config.json")))["vocab_size"]


def tokenizer():
    # oneshot wants a processor whenever it is given a dataset, even a tokenized one
    if os.path.exists(os.path.join(src, "tokenizer.json")):
        return PreTrainedTokenizerFast.from_pretrained(src)
    from tokenizers import Tokenizer, models
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0", eos_token="t0")


def group(bits, size, sym):
    return {"group_0": QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=bits, type="int", strategy="group", group_size=size, symmetric=sym))}


IGNORE = ["lm_head"]


def recipe(scheme):
    if scheme.startswith("awq"):
        from llmcompressor.modifiers.awq import AWQModifier
        return AWQModifier(targets=["Linear"], ignore=IGNORE,
                           scheme="W4A16_ASYM" if scheme == "awq_w4a16_asym" else "W4A16")
    return {
        # GPTQ, int4 weights in groups of 128 along the input dim, symmetric (static actorder: no g_idx)
        "gptq_w4a16": lambda: GPTQModifier(targets="Linear", scheme="W4A16", ignore=IGNORE),
        "gptq_w4a16_asym": lambda: GPTQModifier(targets="Linear", scheme="W4A16_ASYM", ignore=IGNORE),
        "gptq_w4a16_asym_g32": lambda: GPTQModifier(config_groups=group(4, 32, False), ignore=IGNORE),
        "gptq_w8a16": lambda: GPTQModifier(targets="Linear", scheme="W8A16", ignore=IGNORE),
        # int8 per-channel weights + int8 dynamic per-token activations
        "gptq_w8a8": lambda: GPTQModifier(targets="Linear", scheme="W8A8", ignore=IGNORE),
        # round-to-nearest (no calibration)
        "w4a16": lambda: QuantizationModifier(targets="Linear", scheme="W4A16", ignore=IGNORE),
        "w8a16": lambda: QuantizationModifier(targets="Linear", scheme="W8A16", ignore=IGNORE),
        # fp8 e4m3 per-channel weights + fp8 dynamic per-token activations
        "fp8_dynamic": lambda: QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=IGNORE),
        # float weights, an fp8 KV cache with static per-layer k_scale / v_scale calibrated on the data
        "fp8_kv": lambda: QuantizationModifier(kv_cache_scheme=QuantizationArgs(
            num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True)),
    }[scheme]()


ids = torch.randint(0, vocab, (N_SAMPLES, SEQ_LEN), generator=torch.Generator().manual_seed(0))
data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
print(json.dumps({"import_s": round(time.time() - t0, 2)}), flush=True)
for scheme, out in jobs:
    t1 = time.time()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(src, dtype="auto")
    tok = tokenizer()
    calibrate = scheme.startswith(("gptq", "awq", "fp8_kv"))
    oneshot(model=model, processor=tok, recipe=recipe(scheme),
            **(dict(dataset=data, num_calibration_samples=N_SAMPLES, max_seq_length=SEQ_LEN) if calibrate else {}))
    model.save_pretrained(out, save_compressed=True)
    tok.save_pretrained(out)
    print(json.dumps({"scheme": scheme, "out": out, "seconds": round(time.time() - t1, 2)}), flush=True)
'''


def make_compressed_many(src_folder: str | os.PathLike, jobs: dict[str, str | os.PathLike],
                         timeout: float = 300) -> list[dict]:
    """Run llm-compressor once over several {scheme: out_folder} jobs (one interpreter start for all);
    returns the per-job timing lines. Raises RuntimeError if the tool venv is missing or a job fails."""
    unknown = set(jobs) - set(SCHEMES)
    if unknown:
        raise ValueError(f"unknown schemes {sorted(unknown)}; known: {SCHEMES}")
    python = tool_python()
    if python is None:
        raise RuntimeError(last_error or "no llm-compressor tool venv")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONNOUSERSITE="1")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([python, "-c", _CT_SCRIPT, str(src_folder),
                           *[f"{scheme}={out}" for scheme, out in jobs.items()]],
                          capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"llm-compressor failed (exit {proc.returncode}): {proc.stderr[-3000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def make_compressed(src_folder: str | os.PathLike, out_folder: str | os.PathLike, scheme: str) -> None:
    """Write a compressed-tensors folder (save_compressed=True) of src_folder with one of SCHEMES."""
    make_compressed_many(src_folder, {scheme: out_folder})


# ----------------------------------------------------------------------------- legacy GPTQ and AutoAWQ GEMM

def _load_folder(src: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return json.loads((src / "config.json").read_text()), tensors


def _copy_side_files(src: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy(f, out / f.name)


def _quantized_names(tensors: dict[str, torch.Tensor], modules: Optional[Iterable[str]]) -> list[str]:
    if modules is not None:
        return list(modules)
    return sorted(k[: -len(".weight")] for k in tensors
                  if k.endswith(".weight") and k[: -len(".weight")].endswith(LINEAR_SUFFIXES))


def _pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] codes in [0, 2^bits) -> int32 [R // (32/bits), C]: row r*f + j in bits j*bits.. of word r."""
    f = 32 // bits
    c = codes.to(torch.int64).reshape(codes.shape[0] // f, f, codes.shape[1])
    shifts = (torch.arange(f, dtype=torch.int64) * bits).view(1, f, 1)
    return _to_int32((c << shifts).sum(1))


def _pack_cols(codes: torch.Tensor, bits: int, order: Optional[list[int]] = None) -> torch.Tensor:
    """[R, C] codes -> int32 [R, C // (32/bits)]: column c*f + order[j] in bits j*bits.. of word c."""
    f = 32 // bits
    c = codes.to(torch.int64).reshape(codes.shape[0], codes.shape[1] // f, f)
    if order is not None:
        c = c[:, :, order]
    shifts = (torch.arange(f, dtype=torch.int64) * bits).view(1, 1, f)
    return _to_int32((c << shifts).sum(2))


def _to_int32(x: torch.Tensor) -> torch.Tensor:
    x = x & 0xFFFFFFFF
    return torch.where(x >= 1 << 31, x - (1 << 32), x).to(torch.int32)


def _write(out: Path, config: dict, tensors: dict[str, torch.Tensor], quant_config: dict) -> None:
    from safetensors.torch import save_file
    config = dict(config, quantization_config=quant_config)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})


def write_gptq_legacy(src_folder: str | os.PathLike, out_folder: str | os.PathLike, bits: int = 4,
                      group_size: int = 128, sym: bool = True, desc_act: bool = False, seed: int = 0,
                      modules: Optional[Iterable[str]] = None,
                      quantizer: tuple[str, ...] = ("tokenmill-tests:rtn",)) -> dict[str, torch.Tensor]:
    """A GPTQModel/AutoGPTQ "gptq" (v1) checkpoint of src_folder's linear layers, by round-to-nearest.

    Per linear layer (W: [N out, K in]):  qweight int32 [K*bits/32, N] (input rows packed along K, row r*f+j in
    bits j*bits.. of word r, f = 32/bits), qzeros int32 [G, N*bits/32] (packed along N the same way) holding
    zero-1 (v1), scales fp16 [G, N], g_idx int32 [K] (group of each input column; a random permutation-ranked
    grouping when desc_act, as act-order produces). W[n, k] = scales[g_idx[k], n] * (q[k, n] - zero[g_idx[k], n]).
    bits in (2, 4, 8). Zeros are kept in [1, 2^bits - 1] (v1 can't hold a zero of 0). GPTQModel itself refuses
    a sym=False v1 folder unless quantize_config's meta.quantizer names "gptqmodel:<version >= 0.9>" (older
    AutoGPTQ asym files had that zero-of-0 overflow); pass quantizer=("gptqmodel:7.5.0",) to load one there.
    Returns the dequantised
    float32 weights {module name: [N, K]} it meant, for the test's comparison."""
    if bits not in (2, 4, 8):
        raise ValueError("bits must be 2, 4 or 8")
    src, out = Path(src_folder), Path(out_folder)
    config, tensors = _load_folder(src)
    _copy_side_files(src, out)
    maxq = (1 << bits) - 1
    gen = torch.Generator().manual_seed(seed)
    expected: dict[str, torch.Tensor] = {}
    orders: dict[str, torch.Tensor] = {}
    for name in _quantized_names(tensors, modules):
        w = tensors.pop(name + ".weight").float()
        n, k = w.shape
        gs = k if group_size == -1 else group_size
        if k % gs or k % (32 // bits) or n % (32 // bits):
            raise ValueError(f"{name}: shape {list(w.shape)} does not fit group {gs} / {bits}-bit packing")
        g = k // gs
        if desc_act:           # column k's rank in a random "activation order" decides its group
            # layers that read the same input (q/k/v, gate/up) share its order, as act-order's Hessians do
            base, leaf = name.rsplit(".", 1)
            key = base + {"q_proj": "/qkv", "k_proj": "/qkv", "v_proj": "/qkv", "gate_proj": "/gate_up",
                          "up_proj": "/gate_up"}.get(leaf, "/" + leaf)
            if key not in orders:
                orders[key] = torch.randperm(k, generator=gen)
            perm = orders[key]
            g_idx = torch.empty(k, dtype=torch.int64)
            g_idx[perm] = torch.arange(k) // gs
        else:
            g_idx = torch.arange(k) // gs
        scales = torch.empty(g, n)
        zeros = torch.empty(g, n)
        for gi in range(g):                        # AutoGPTQ's Quantizer.find_params, per output row
            cols = w[:, g_idx == gi]
            xmin = cols.min(1).values.clamp(max=0)
            xmax = cols.max(1).values.clamp(min=0)
            if sym:
                xmax = torch.maximum(xmin.abs(), xmax)
                xmin = torch.where(xmin < 0, -xmax, xmin)
            both0 = (xmin == 0) & (xmax == 0)
            xmin, xmax = torch.where(both0, -1.0, xmin), torch.where(both0, 1.0, xmax)
            s = (xmax - xmin) / maxq
            z = torch.full_like(s, (maxq + 1) / 2) if sym else torch.round(-xmin / s)
            scales[gi], zeros[gi] = s, z.clamp(1, maxq)
        scales16 = scales.half()
        s_k, z_k = scales16.float()[g_idx], zeros[g_idx]           # [K, N]
        q = torch.clamp(torch.round(w.t() / s_k) + z_k, 0, maxq)     # [K, N]
        expected[name] = (s_k * (q - z_k)).t().contiguous()
        tensors[name + ".qweight"] = _pack_rows(q, bits)
        tensors[name + ".qzeros"] = _pack_cols(zeros - 1, bits)
        tensors[name + ".scales"] = scales16
        tensors[name + ".g_idx"] = g_idx.to(torch.int32)
    quant = {"bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym, "lm_head": False,
             "quant_method": "gptq", "checkpoint_format": "gptq", "format": "gptq", "pack_dtype": "int32",
             "true_sequential": True, "static_groups": False, "damp_percent": 0.01,
             "meta": {"quantizer": list(quantizer)}}
    _write(out, config, tensors, quant)
    (out / "quantize_config.json").write_text(json.dumps({k: v for k, v in quant.items()}, indent=2))
    return expected


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]          # nibble j of a word holds column 8c + AWQ_ORDER[j]
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]


def write_awq(src_folder: str | os.PathLike, out_folder: str | os.PathLike, group_size: int = 128,
              modules: Optional[Iterable[str]] = None) -> dict[str, torch.Tensor]:
    """An AutoAWQ GEMM checkpoint (4-bit) of src_folder's linear layers, by round-to-nearest (no AWQ scaling
    search: the format, not the method, is what a loader sees).

    Per linear layer (W: [N out, K in]): qweight int32 [K, N/8] (packed along N, nibble j of word c holding
    column 8c + AWQ_ORDER[j]), qzeros int32 [G, N/8] (same packing; plain zero, no -1), scales fp16 [G, N].
    W[n, k] = scales[k // gs, n] * (q[k, n] - zero[k // gs, n]), zero in [0, 15] (asymmetric: AutoAWQ's GEMM
    packer requires zeros). Returns the dequantised float32 weights {module name: [N, K]} it meant."""
    src, out = Path(src_folder), Path(out_folder)
    config, tensors = _load_folder(src)
    _copy_side_files(src, out)
    expected: dict[str, torch.Tensor] = {}
    for name in _quantized_names(tensors, modules):
        w = tensors.pop(name + ".weight").float()
        n, k = w.shape
        gs = k if group_size == -1 else group_size
        if k % gs or n % 8:
            raise ValueError(f"{name}: shape {list(w.shape)} does not fit group {gs} / 4-bit packing")
        wg = w.reshape(n, k // gs, gs)            # AutoAWQ's pseudo_quantize_tensor
        mx, mn = wg.amax(2), wg.amin(2)
        scales = (mx - mn).clamp(min=1e-5) / 15
        zeros = (-torch.round(mn / scales)).clamp(0, 15)
        scales16 = scales.half().t().contiguous()                    # [G, N]
        zeros_gn = zeros.t().contiguous()                            # [G, N]
        g_of_k = torch.arange(k) // gs
        s_k, z_k = scales16.float()[g_of_k], zeros_gn[g_of_k]         # [K, N]
        # [K, N], as WQLinear_GEMM.from_linear rounds (plus a clamp: it lets a 16 spill into the next nibble)
        q = torch.clamp(torch.round((w.t() + z_k * s_k) / s_k), 0, 15)
        expected[name] = (s_k * (q - z_k)).t().contiguous()
        tensors[name + ".qweight"] = _pack_cols(q, 4, AWQ_ORDER)
        tensors[name + ".qzeros"] = _pack_cols(zeros_gn, 4, AWQ_ORDER)
        tensors[name + ".scales"] = scales16
    quant = {"quant_method": "awq", "zero_point": True, "group_size": group_size, "bits": 4,
             "version": "gemm", "modules_to_not_convert": None}
    _write(out, config, tensors, quant)
    return expected


# ----------------------------------------------------------------------------- reference readers

def unpack_compressed_tensors(words: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """compressed-tensors' pack-quantized rows (int32 [R, W]) -> unsigned codes int64 [R, n]: element i of a
    row sits at bits i*bits .. i*bits+bits-1 of the row's little-endian bit string (dense; for 4 and 8 bits
    simply 32/bits elements per word, lowest bits first). Subtract 2^(bits-1) for the signed value."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    r, nw = w.shape
    bitstr = ((w.unsqueeze(-1) >> torch.arange(32)) & 1).reshape(r, nw * 32)[:, : n * bits]
    return (bitstr.reshape(r, n, bits) << torch.arange(bits)).sum(-1)


def dequant_gptq_legacy(tensors: dict[str, torch.Tensor], prefix: str, bits: int) -> torch.Tensor:
    """Reference dequantisation of a legacy GPTQ (v1) layer -> float32 [N, K]."""
    f, maxq = 32 // bits, (1 << bits) - 1
    qweight, qzeros = tensors[prefix + ".qweight"].to(torch.int64), tensors[prefix + ".qzeros"].to(torch.int64)
    scales, g_idx = tensors[prefix + ".scales"].float(), tensors[prefix + ".g_idx"].long()
    shifts = torch.arange(f) * bits
    q = ((qweight.unsqueeze(1) >> shifts.view(1, f, 1)) & maxq).reshape(-1, qweight.shape[1])     # [K, N]
    zero = ((qzeros.unsqueeze(2) >> shifts.view(1, 1, f)) & maxq).reshape(qzeros.shape[0], -1) + 1  # [G, N]
    return (scales[g_idx] * (q - zero[g_idx])).t().contiguous()


def dequant_awq(tensors: dict[str, torch.Tensor], prefix: str, group_size: int) -> torch.Tensor:
    """Reference dequantisation of an AutoAWQ GEMM layer -> float32 [N, K]."""
    qweight, qzeros = tensors[prefix + ".qweight"].to(torch.int64), tensors[prefix + ".qzeros"].to(torch.int64)
    scales = tensors[prefix + ".scales"].float()
    shifts = torch.arange(8) * 4

    def unpack(x: torch.Tensor) -> torch.Tensor:      # [R, C/8] -> [R, C], undoing the interleave
        codes = (x.unsqueeze(2) >> shifts.view(1, 1, 8)) & 15                 # nibble j -> column 8c+ORDER[j]
        return codes[:, :, AWQ_REVERSE_ORDER].reshape(x.shape[0], -1)

    q, zero = unpack(qweight), unpack(qzeros)                                 # [K, N], [G, N]
    g = torch.arange(q.shape[0]) // group_size
    return (scales[g] * (q - zero[g])).t().contiguous()
