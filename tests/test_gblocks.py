"""GGUF matrices in their file's own blocks (csrc/gblocks.c): every type's dequantisation and matmul, in every
kernel variant this CPU runs, against gguf-py's dequantiser; and a tiny model whose matrices are in those types
gives the same greedy tokens as the same model dequantised, holding no float copy of any quantised matrix."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tests.test_gguf import add_shape
from tests.test_plans import assert_same
from tokenmill import LLM, SamplingParams
from tokenmill.executor.kernels import load, runnable_variants
from tokenmill.executor.layers.linear import Embedding, Linear
from tokenmill.executor.layers.quant import (GGML_TYPES, GGMLWeight, PackedWeight, RowParts, ggml_block,
                                             quant_nbytes)
from tokenmill.executor.loader.gguf import open_gguf
from tokenmill.executor.ops import CpuKernelOps, ReferenceOps

VARIANTS = runnable_variants()
Q = gguf.GGMLQuantizationType
# where each K-quant keeps its fp16 super-block scales (d, and dmin where it has one)
_SCALE_OFFSETS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(type_name: str, n: int, k: int, rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """[n, row bytes] of valid blocks: gguf-py's quantiser where it has one, else random codes with modest fp16
    scales (random bytes there could be NaN or huge)."""
    block, size = ggml_block(type_name)
    if type_name not in _SCALE_OFFSETS:
        w = (rng.standard_normal((n, k)) * scale).astype(np.float32)
        if type_name == "F16":
            return w.astype(np.float16).view(np.uint8).reshape(n, -1)
        return np.asarray(gguf.quants.quantize(w, Q[type_name])).reshape(n, -1)
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for off in _SCALE_OFFSETS[type_name]:
        d = rng.uniform(0.2, 1.0, (n, k // block, 1)) * scale / 64
        raw[..., off:off + 2] = d.astype(np.float16).view(np.uint8)
    return raw.reshape(n, -1)


def oracle(type_name: str, raw: np.ndarray, k: int) -> torch.Tensor:
    out = np.asarray(gguf.quants.dequantize(raw, Q[type_name]), dtype=np.float32)
    return torch.from_numpy(out.reshape(raw.shape[0], k).copy())


def within_rounding(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y = x @ w^T to float32 summation-order rounding: a few ulps of sum |x| |w|, against a float64 product."""
    exact = x.double() @ w.double().t()
    bound = 16 * torch.finfo(torch.float32).eps * (x.abs().double() @ w.abs().double().t()) + 1e-30
    assert ((y.double() - exact).abs() <= bound).all(), ((y.double() - exact).abs() / bound).max()


@pytest.fixture(params=VARIANTS, scope="module")
def ops(request) -> CpuKernelOps:
    """The float route: x stays float32, so a matmul equals dequantise-then-matmul to float32 rounding."""
    return CpuKernelOps(load(request.param), torch.float32, int8_activations=False)


@pytest.mark.parametrize("type_name", GGML_TYPES)
def test_dequantise_and_matmul_equal_gguf_py(ops: CpuKernelOps, type_name: str) -> None:
    rng = np.random.default_rng(1)
    n, k = 37, 512                                      # rows not a multiple of any thread chunk
    raw = random_blocks(type_name, n, k, rng)
    w = GGMLWeight(type_name, torch.from_numpy(raw), (n, k))
    want = oracle(type_name, raw, k)
    got = torch.empty(n, k)
    assert torch.equal(ops.dequantize(w, 0, n, got), want)           # bit for bit
    assert torch.equal(ops.dequantize(w, 5, 9, torch.empty(9, k)), want[5:14])
    ids = torch.tensor([3, 0, 36, 3])
    assert torch.equal(ops.lookup(w, ids), want[ids])
    lin = Linear(k, n, False, ops)
    lin.quant, lin.weight = w, None
    for rows in (1, 2, 7, ops.gmax_rows, ops.gmax_rows + 1, 70):     # the kernel, then dequantised tiles
        x = torch.randn(rows, k)
        within_rounding(lin(x), x, want)


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("Q5_K", "Q5_K", "Q6_K"), ("Q4_K", "Q5_0", "Q6_K", "F16")])
@pytest.mark.parametrize("int8", [False, True])
def test_row_parts_are_one_call_equal_to_their_parts(ops: CpuKernelOps, types: tuple[str, ...], int8: bool) -> None:
    """A matrix stored as row parts of different types (a Q4_K_M qkv: q and k Q4_K, v Q6_K) is one kernel call
    over the chain of parts, equal to the parts multiplied one by one, rows of y in the parts' order."""
    rng = np.random.default_rng(3)
    k, ns = 512, (24, 8, 13, 5)
    parts = tuple(GGMLWeight(t, torch.from_numpy(random_blocks(t, n, k, rng)), (n, k)) for t, n in zip(types, ns))
    kops = CpuKernelOps(ops.kernels, torch.float32, int8_activations=int8)
    stacked = kops._register_any(RowParts(parts))
    assert id(stacked) in kops._gweights and len(kops._gweights[id(stacked)][2]) == len(parts) - 1
    for rows in (1, 3, kops.gmax_rows):
        x = torch.randn(rows, k)
        want = torch.cat([kops._matmul(x, p) for p in stacked.parts], dim=1)
        got = kops._matmul(x, stacked)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        if not int8:
            within_rounding(got, x, stacked.dequantize())


def test_reference_ops_read_blocks_too() -> None:
    rng = np.random.default_rng(2)
    raw = random_blocks("Q5_K", 8, 256, rng)
    w = GGMLWeight("Q5_K", torch.from_numpy(raw), (8, 256))
    lin = Linear(256, 8, False, ReferenceOps())
    lin.quant, lin.weight = w, None
    x = torch.randn(3, 256)
    within_rounding(lin(x), x, oracle("Q5_K", raw, 256))


def test_kernels_refuse_what_they_cannot_read() -> None:
    lib = load(VARIANTS[0])
    raw = torch.zeros(4, 144, dtype=torch.uint8)
    bad = [dict(type=12, row_bytes=144, n=4, k=255),        # K not whole super-blocks
           dict(type=12, row_bytes=100, n=4, k=256),        # row bytes that do not match
           dict(type=15, row_bytes=144, n=4, k=256)]        # Q8_K: not a file type we read
    for fields in bad:
        gw = lib.struct("gweight", data=raw, next=None, **fields)
        assert lib.call("gmatmul", lib.struct("gmatmul_args", w=gw, x=torch.zeros(1, 256), y=torch.zeros(1, 4),
                                              rows=1, int8_x=0, num_threads=1)) == -1
    gw = lib.struct("gweight", type=12, data=raw, row_bytes=144, n=4, k=256, next=None)
    assert lib.call("gdequant", lib.struct("gdequant_args", w=gw, ids=torch.tensor([4]), row0=0, rows=1,
                                           out=torch.zeros(1, 256), num_threads=1)) == -3


# ---------------------------------------------------------------- a tiny model in the K-quants and the rest

DIMS = dict(vocab=64, hidden=256, heads=4, kv_heads=2, ffn=512, layers=2)


def write_model(path: Path, types: dict[str, str], seed: int = 0) -> None:
    """A llama-arch GGUF with each kind of matrix in the type `types` gives it (1-D tensors stay F32)."""
    d, rng = DIMS, np.random.default_rng(seed)
    head_dim = d["hidden"] // d["heads"]
    w = gguf.GGUFWriter(str(path), "llama")
    add_shape(w, d, rms_eps=1e-5, rope_base=10000.0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def put(name: str, kind: str, n: int, k: int) -> None:
        t = types[kind]
        scale = 1.0 if kind == "embd" else k ** -0.5
        raw = random_blocks(t, n, k, rng, scale)
        w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=Q[t])

    put("token_embd.weight", "embd", d["vocab"], d["hidden"])
    for i in range(d["layers"]):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(d["hidden"], np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(d["hidden"], np.float32))
        put(p + "attn_q.weight", "q", d["heads"] * head_dim, d["hidden"])
        put(p + "attn_k.weight", "k", d["kv_heads"] * head_dim, d["hidden"])
        put(p + "attn_v.weight", "v", d["kv_heads"] * head_dim, d["hidden"])
        put(p + "attn_output.weight", "o", d["hidden"], d["heads"] * head_dim)
        put(p + "ffn_gate.weight", "gate", d["ffn"], d["hidden"])
        put(p + "ffn_up.weight", "up", d["ffn"], d["hidden"])
        put(p + "ffn_down.weight", "down", d["hidden"], d["ffn"])
    w.add_tensor("output_norm.weight", np.ones(d["hidden"], np.float32))
    put("output.weight", "out", d["vocab"], d["hidden"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


MIXES = {
    # Q4_K_M's pattern: Q4_K with Q6_K for v, down and the head; qkv and gate_up fused from different types
    "q4_k_m": dict(embd="Q4_K", q="Q4_K", k="Q4_K", v="Q6_K", o="Q4_K", gate="Q4_K", up="Q4_K", down="Q6_K",
                   out="Q6_K"),
    "k_quants": dict(embd="Q3_K", q="Q2_K", k="Q3_K", v="Q5_K", o="Q5_K", gate="Q2_K", up="Q3_K", down="Q4_K",
                     out="Q5_K"),
    "legacy": dict(embd="F16", q="Q5_0", k="Q5_0", v="Q5_1", o="BF16", gate="Q8_0", up="Q4_0", down="Q4_1",
                   out="Q8_0"),
}


def _generate(path: Path, **kw):
    llm = LLM(str(path), dtype="float32", kv_cache_memory_gb=0.01, max_model_len=256, tokenizer=None, **kw)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (1, 9, 40, 23, 5)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs], llm


@pytest.mark.slow
@pytest.mark.parametrize("mix", list(MIXES))
def test_model_in_blocks_equals_the_model_dequantised(tmp_path: Path, mix: str) -> None:
    """With float activations, the blocks give the dequantised model's tokens (int8 activations are bounded below)."""
    path = tmp_path / f"{mix}.gguf"
    write_model(path, MIXES[mix])
    want, _ = _generate(path, quantized_kernels=False, cpu_kernels="reference")
    for isa in VARIANTS:
        got, llm = _generate(path, cpu_kernels=isa, int8_activations=False)
        assert_same(got, want)
    assert_no_float_copy(llm, path)


def assert_no_float_copy(llm, path: Path) -> None:
    """Every matrix is held in its blocks and nothing else: the bytes the model holds are the file's tensors' bytes
    (plus the kernels' own layout of Q4_0/Q4_1/Q8_0, and the 1-D tensors in the model's dtype)."""
    model = llm.llm_engine.model
    held = 0
    seen: set[int] = set()
    for m in model.modules():
        if isinstance(m, (Linear, Embedding)):
            assert m.quant is not None and m.weight is None and getattr(m, "weight_t", None) is None, m
            if id(m.quant) not in seen:
                seen.add(id(m.quant))
                held += quant_nbytes(m.quant)
    held += sum(p.numel() * p.element_size() for p in model.parameters())
    f = open_gguf(str(path))
    in_file = sum(i.n_bytes for i in f.tensors.values())
    repacked = [p for m in model.modules() if isinstance(m, Linear) and m.quant is not None
                for p in (m.quant.parts if isinstance(m.quant, RowParts) else (m.quant,)) if isinstance(p, PackedWeight)]
    if not repacked:
        assert held == in_file
    else:    # the tuned kernels' layout: float32 scales (and a lanes copy on AVX-512) instead of fp16
        assert held <= 3 * in_file


def test_bfloat16_prefill_multiplies_bfloat16_tiles(ops: CpuKernelOps) -> None:
    """A bfloat16 model's prefill: tiles rounded to bfloat16 (as its own weights would be) and a bfloat16 GEMM."""
    rng = np.random.default_rng(3)
    raw = random_blocks("Q4_K", 40, 256, rng)
    w = GGMLWeight("Q4_K", torch.from_numpy(raw), (40, 256))
    x = torch.randn(50, 256).to(torch.bfloat16)
    y = ops.tiled_matmul(x, w)
    want = x.float() @ oracle("Q4_K", raw, 256).to(torch.bfloat16).float().t()
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_int8_activations_equal_rounded_x_times_dequantised(rows: int, type_name: str) -> None:
    """int8_activations: a Q4_K, Q5_K or Q6_K matmul equals the dequantised weights times x rounded to int8 per 256
    (dx = max|x| / 127, as llama.cpp's Q8_K), to float32 rounding; on x86 (AVX2 and up), the float kernel elsewhere."""
    variants = [v for v in VARIANTS if v in ("avx512", "avx2")]
    if not variants:
        pytest.skip("the int8 route is written for x86's AVX2 and up")
    rng = np.random.default_rng(5)
    n, k = 37, 512
    raw = random_blocks(type_name, n, k, rng)
    w = GGMLWeight(type_name, torch.from_numpy(raw), (n, k))
    want_w = oracle(type_name, raw, k)
    # seeded: an x whose scaled value falls within an ulp of a .5 rounds either way in C and in torch
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    blocks = x.view(rows, k // 256, 256)
    dx = blocks.abs().amax(-1, keepdim=True) / 127
    xq = torch.round(blocks * torch.where(dx > 0, 1 / dx, torch.zeros_like(dx))) * dx   # half to even, as lrintf
    xr = xq.view(rows, k)
    for isa in variants:
        ops = CpuKernelOps(load(isa), torch.float32, int8_activations=True)
        y = ops._matmul(x, w)
        within_rounding(y, xr, want_w)
        assert not torch.allclose(y, x @ want_w.t(), rtol=0, atol=1e-6)    # x was really rounded


@pytest.mark.parametrize("int8", [False, True])
def test_one_call_decode_layer_reads_gguf_blocks(tmp_path: Path, int8: bool) -> None:
    """A Q4_K_M-pattern model (qkv and gate_up chains of Q4_K and Q6_K) decodes one call a layer, and gives the
    same tokens and logprobs as the same kernels called one by one from Python."""
    path = tmp_path / "q4_k_m.gguf"
    write_model(path, MIXES["q4_k_m"])
    llm = LLM(str(path), dtype="float32", kv_cache_memory_gb=0.01, max_model_len=256, tokenizer=None,
              int8_activations=int8)
    ops = llm.llm_engine.model.ops
    assert len(ops._layers) == len(llm.llm_engine.model.layers)
    prompts = [{"prompt_token_ids": [5 + i, 17, 3 * i + 1, 40]} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    fused = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    ops._layers.clear()
    plain = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in fused] == [o.token_ids for o in plain]
    for a, b in zip(fused, plain):     # the top-5 too: the greedy token's logprob is ~0 in this tiny model
        for la, lb in zip(a.logprobs, b.logprobs):
            assert la.keys() == lb.keys()
            for t in la:
                assert abs(la[t].logprob - lb[t].logprob) <= 1e-5 * max(1.0, abs(lb[t].logprob))


def _logprob_error(got, want) -> float:
    """Mean |logprob difference| over the top-5 tokens both runs list, up to where their tokens part."""
    errs = [abs(lg[t].logprob - lw[t].logprob)
            for g, w in zip(got, want) for i, (lg, lw) in enumerate(zip(g.logprobs, w.logprobs))
            if g.token_ids[:i + 1] == w.token_ids[:i + 1] for t in lw if t in lg]
    return sum(errs) / len(errs)


def test_one_call_decode_layer_in_bfloat16(tmp_path: Path) -> None:
    """A bfloat16 model's one-call layer computes in float32 from bfloat16 inputs, so it cannot equal the plain
    bfloat16 layer, which rounds after every op. Bounded instead, against the float32 model: the same greedy
    tokens, and logprobs no further from float32's than the plain bfloat16 layers' are."""
    path = tmp_path / "q4_k_m.gguf"
    write_model(path, MIXES["q4_k_m"])
    prompts = [{"prompt_token_ids": [5 + i, 17, 3 * i + 1, 40]} for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    kw = dict(kv_cache_memory_gb=0.01, max_model_len=256, tokenizer=None, int8_activations=False)
    want = [o.outputs[0] for o in LLM(str(path), dtype="float32", **kw).generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(path), dtype="bfloat16", **kw)
    ops = llm.llm_engine.model.ops
    assert len(ops._layers) == len(llm.llm_engine.model.layers)
    fused = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    ops._layers.clear()
    plain = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in fused] == [o.token_ids for o in plain] == [o.token_ids for o in want]
    assert _logprob_error(fused, want) <= 1.1 * _logprob_error(plain, want)


@pytest.mark.slow
def test_int8_activations_stay_close_to_float(tmp_path: Path) -> None:
    """A Q4_K_M-pattern model with int8 activations (the default): not exact by nature (x is rounded), so bounded: its greedy
    tokens agree with the float-activation run at 90% of positions or more, and it runs through the engine."""
    path = tmp_path / "q4_k_m.gguf"
    write_model(path, MIXES["q4_k_m"])
    want, _ = _generate(path, int8_activations=False)
    got, llm = _generate(path)                     # the default
    assert llm.llm_engine.model.ops.int8_activations
    pairs = [(a, b) for o, p in zip(got, want) for a, b in zip(o.token_ids, p.token_ids)]
    assert len(pairs) == 50 and sum(a == b for a, b in pairs) / len(pairs) >= 0.9
