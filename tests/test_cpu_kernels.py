"""The C fast paths against the plain torch ones they replace: the quantised-block matmul (layers/quant.py) and
the fused per-layer ops (layers/cpu_ops.py), op by op and then through the engine on a quantised GGUF."""
from __future__ import annotations

import ctypes
import os
import sys
import threading
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.test_gguf import _write_tiny
from tokenmill import LLM, SamplingParams
from tokenmill.executor.layers import cpu_ops
from tokenmill.executor.layers.linear import Linear
from tokenmill.executor.layers.quant import MAX_ROWS, pack_ggml, qmatmul, with_lanes
from tokenmill.executor.native import _cpu_id, faulting_in, kernels
from tokenmill.executor.layers.rotary import apply_rotary

pytestmark = pytest.mark.skipif(kernels() is None, reason="no C compiler")
QTYPES = ["Q4_0", "Q4_1", "Q8_0"]


def _packed(qtype: str, n: int, k: int, seed: int = 0):
    """A random [n, k] matrix through gguf's quantiser: (PackedWeight, gguf's own dequantisation)."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    t = gguf.GGMLQuantizationType[qtype]
    raw = gguf.quants.quantize(w, t)
    ref = torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, t), dtype=np.float32).reshape(n, k))
    return pack_ggml(qtype, raw, (n, k)), ref


@pytest.mark.parametrize("qtype", QTYPES)
def test_pack_dequantizes_like_gguf(qtype: str) -> None:
    p, ref = _packed(qtype, 37, 96)
    assert p.bits == (8 if qtype == "Q8_0" else 4)
    # Q4_0 is d * (c - 8) in gguf and d * c - 8d here: equal up to one rounding
    torch.testing.assert_close(p.dequantize(), ref, rtol=1e-6, atol=1e-6)
    if qtype != "Q4_0":
        assert torch.equal(p.dequantize(), ref)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("n,k", [(1, 32), (5, 96), (37, 64), (130, 160)])
def test_qmatmul_matches_dense(qtype: str, n: int, k: int) -> None:
    p, ref = _packed(qtype, n, k, seed=n + k)
    for b in [*range(1, 10), 15, 16, 17, 21, 33, 48, MAX_ROWS]:   # both kernels; partial and several passes
        x = torch.randn(b, k, generator=torch.Generator().manual_seed(b))
        torch.testing.assert_close(qmatmul(x, p), x @ ref.t(), rtol=1e-5, atol=1e-5)


AVX512 = "avx512f" in _cpu_id().split()     # the flags the kernels are built for (-march=native)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("n,k", [(16, 32), (80, 96), (144, 160)])   # panels of 1, 3 + 2 and 3 x 3 vectors
def test_qmatmul_lanes_layout_matches_dense(qtype: str, n: int, k: int) -> None:
    p, ref = _packed(qtype, n, k, seed=n + k)
    lanes = with_lanes(p)
    assert (lanes.lanes is not None) == AVX512      # rows a multiple of 16: the kernel takes them on AVX-512
    for b in [1, 8, 9, 10, 17, 33, 40, 41, MAX_ROWS]:   # each side of the lanes kernel's row range
        x = torch.randn(b, k, generator=torch.Generator().manual_seed(b))
        y = qmatmul(x, lanes)
        torch.testing.assert_close(y, x @ ref.t(), rtol=1e-5, atol=1e-5)
        # the same dequantised values summed in the same k order as the row-layout kernels: equal bits
        # wherever both sum with one FMA chain per output (the row dot products split k into two halves)
        if b > 20:
            assert torch.equal(y, qmatmul(x, p))


def test_qmatmul_rejects_what_it_cannot_take() -> None:
    p, _ = _packed("Q4_1", 8, 64)
    with pytest.raises(ValueError, match="qmatmul takes"):
        qmatmul(torch.randn(MAX_ROWS + 1, 64), p)
    with pytest.raises(ValueError, match="qmatmul takes"):
        qmatmul(torch.randn(1, 32), p)
    assert pack_ggml("Q4_K", np.zeros((1, 144), np.uint8), (1, 256)) is None


def test_linear_uses_blocks_for_few_rows_only() -> None:
    p, ref = _packed("Q4_1", 48, 64)
    lin = Linear(64, 48)
    lin.weight.data.copy_(ref)
    lin.finalize()
    dense = [lin(torch.randn(r, 64)) for r in (1, MAX_ROWS + 3)]   # reference outputs, no blocks yet
    lin.packed = p
    x1, xb = torch.randn(1, 64), torch.randn(MAX_ROWS + 3, 64)
    torch.testing.assert_close(lin(x1), x1 @ ref.t(), rtol=1e-5, atol=1e-5)
    assert torch.equal(lin(xb), xb @ lin.weight_t)                  # many rows: the dense GEMM, bit for bit
    assert [d.shape for d in dense] == [(1, 48), (MAX_ROWS + 3, 48)]


@pytest.mark.parametrize("rows", [1, 3, 100])
def test_add_rms_norm_matches_torch(rows: int) -> None:
    x, res, w = torch.randn(rows, 96), torch.randn(rows, 96), torch.randn(96)
    want_res = res + x
    want = w * F.rms_norm(want_res, (96,), eps=1e-5)
    out, got_res = cpu_ops.add_rms_norm(x, res.clone(), w, 1e-5)
    assert torch.equal(got_res, want_res)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    out, same = cpu_ops.add_rms_norm(x, None, w, 1e-5)
    assert same is x
    torch.testing.assert_close(out, w * F.rms_norm(x, (96,), eps=1e-5), rtol=1e-5, atol=1e-6)
    assert cpu_ops.add_rms_norm(x.double(), None, w.double(), 1e-5) is None     # not float32: torch's turn


@pytest.mark.parametrize("rows", [1, 70])
def test_rotary_matches_torch(rows: int) -> None:
    heads, d, kv = 6, 16, 2
    qkv = torch.randn(rows, (heads + kv) * d)
    cos, sin = torch.randn(rows, 1, d), torch.randn(rows, 1, d)
    want = apply_rotary(qkv[:, :heads * d].view(rows, heads, d), cos, sin)
    v_before = qkv[:, heads * d:].clone()
    assert cpu_ops.rotary_(qkv, heads, d, cos, sin)
    torch.testing.assert_close(qkv[:, :heads * d].view(rows, heads, d), want, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, heads * d:], v_before)                # only the first `heads` vectors move


def test_silu_mul_matches_torch() -> None:
    gu = torch.randn(5, 2 * 40) * 4
    gate, up = gu.split(40, dim=-1)
    torch.testing.assert_close(cpu_ops.silu_mul(gu), F.silu(gate) * up, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shape", [(64, 49152), (3, 1000), (2, 17), (1, 5)])
def test_argmax_matches_torch(shape) -> None:
    torch.manual_seed(0)
    x = torch.randn(shape)
    x[0, 1:3] = 9.0                       # a tie: the first index wins
    if shape[1] > 16:
        x[-1, -1] = 99.0                  # the largest in the tail after the last whole vector
    assert torch.equal(cpu_ops.argmax(x), x.argmax(dim=-1))
    # torch's rules at the edges: a NaN is the largest (its first one), -0.0 == 0.0, a row of -inf gives 0
    e = torch.randn(5, 40)
    e[0, 30], e[0, 7] = float("nan"), float("nan")
    e[1] = float("-inf")
    e[2] = 0.0
    e[2, 3] = -0.0
    e[3, 20], e[3, 35] = float("inf"), float("inf")
    e[4, 33] = float("nan")
    assert cpu_ops.argmax(e).tolist() == e.argmax(dim=-1).tolist() == [7, 0, 0, 20, 33]


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_index_put(cache_dtype) -> None:
    """bfloat16 caches (kv_cache_dtype="bfloat16"): rounded exactly as torch converts, to nearest even."""
    kv, d, t = 2, 8, 3
    qkv = torch.randn(t, (4 + 2 * kv) * d)                         # k and v are strided views of these rows
    k = qkv[:, 4 * d:(4 + kv) * d].view(t, kv, d)
    v = qkv[:, (4 + kv) * d:].view(t, kv, d)
    slots = torch.tensor([7, 0, 12])
    kc, vc = torch.zeros(16, kv, d, dtype=cache_dtype), torch.zeros(16, kv, d, dtype=cache_dtype)
    want_k, want_v = kc.clone(), vc.clone()
    want_k[slots], want_v[slots] = k.to(cache_dtype), v.to(cache_dtype)
    assert cpu_ops.write_kv(k, v, kc, vc, slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    with pytest.raises(IndexError):
        cpu_ops.write_kv(k, v, kc, vc, torch.tensor([7, 0, 16]))
    assert torch.equal(kc, want_k)                                   # a bad slot writes nothing


def _resident_pages(t: torch.Tensor) -> tuple[int, int]:
    """(resident, total) of the whole pages inside t, by mincore(2)."""
    page = os.sysconf("SC_PAGE_SIZE")
    lo = -(-t.data_ptr() // page) * page
    n = (t.data_ptr() + t.numel() * t.element_size() - lo) // page
    vec = (ctypes.c_ubyte * n)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(lo, n * page, vec) == 0, os.strerror(ctypes.get_errno())
    return sum(v & 1 for v in vec), n


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore(2) as Linux has it")
def test_touch_pages_faults_in_every_page_and_honours_stop() -> None:
    # above glibc's 32 MB mmap threshold (keep_freed_memory): fresh, untouched pages; not a whole number of chunks
    ts = [torch.empty((40 << 20) // 4 + 1000) for _ in range(3)]
    nbytes = ts[0].numel() * 4
    ptrs = (ctypes.c_void_p * 3)(*[t.data_ptr() for t in ts])
    stop = ctypes.c_int(1)
    assert kernels().touch_pages(ptrs, 3, nbytes, 2 << 20, ctypes.byref(stop)) == 0      # stopped before it began
    resident, total = _resident_pages(ts[2])
    assert resident < total
    stop.value = 0
    assert kernels().touch_pages(ptrs, 3, nbytes, 2 << 20, ctypes.byref(stop)) == nbytes
    for t in ts:
        resident, total = _resident_pages(t)
        assert resident == total
    ts[1][:5] = 7.0                                  # the memory stays usable (and writable) afterwards
    assert ts[1][:5].tolist() == [7.0] * 5


def test_faulting_in_joins_its_thread_when_the_body_ends() -> None:
    ts = [torch.empty(1 << 24) for _ in range(4)]     # 256 MB: far more than the empty body leaves time for
    with faulting_in(ts):
        assert any(t.name == "tokenmill-fault-in" for t in threading.enumerate())
    assert not any(t.name == "tokenmill-fault-in" for t in threading.enumerate())
    with pytest.raises(ValueError, match="one size"):
        with faulting_in([torch.empty(10), torch.empty(11)]):
            pass


def test_engine_on_quantised_gguf_matches_dequantised_weights(tmp_path: Path) -> None:
    """Blocks on vs off through the whole engine: same greedy ids, logprobs within float32 summation-order
    noise. 40 requests finishing at different steps: decode steps of 40 down to 1 rows, so both kernels
    (row dot products, and the GEMM above 20 rows with 2, 3 and 4 vectors of inputs) run."""
    path = tmp_path / "tiny.gguf"
    _write_tiny(path)
    prompts = [{"prompt_token_ids": [3, 17, 5, 9, 30]}, {"prompt_token_ids": [11, 4]},
               {"prompt_token_ids": list(range(3, 40))}]
    g = torch.Generator().manual_seed(0)
    prompts += [{"prompt_token_ids": torch.randint(3, 48, (int(n),), generator=g).tolist()}
                for n in torch.randint(1, 30, (37,), generator=g)]
    sp = [SamplingParams(temperature=0, max_tokens=4 + i // 2, ignore_eos=True, logprobs=0) for i in range(40)]
    runs = {}
    for on in (True, False):
        llm = LLM(str(path), dtype="float32", kv_cache_memory_gb=0.01, quantized_kernels=on, tokenizer=None)
        model = llm.llm_engine.model
        packed = [m for m in model.modules() if isinstance(m, Linear) and m.packed is not None]
        # gate (Q4_0) + up (Q4_1) fuse, down is Q8_0; qkv mixes F32/Q8_0/F16 and stays dense
        assert len(packed) == (4 if on else 0)
        runs[on] = llm.generate(prompts, sp, use_tqdm=False)
    for a, b in zip(runs[True], runs[False]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            (ta, pa), = la.items()
            (tb, pb), = lb.items()
            assert ta == tb and abs(pa.logprob - pb.logprob) < 1e-4


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16"])
def test_fused_decode_layer_matches_layer_by_layer(kv_cache_dtype) -> None:
    """The bundled Q4_1 GGUF qualifies for the one-call decode layer; with it and without it (the same kernels
    called one by one from Python), greedy ids are equal and logprobs agree; with a bfloat16 KV cache too."""
    llm = LLM(dtype="float32", kv_cache_memory_gb=0.1, max_model_len=512, enable_prefix_caching=False,
              kv_cache_dtype=kv_cache_dtype)
    want = torch.bfloat16 if kv_cache_dtype == "bfloat16" else torch.float32
    assert llm.llm_engine.runner.kv_caches[0][0].dtype == want
    layers = llm.llm_engine.model.layers
    assert all(layer.fused is not None for layer in layers)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    fused = llm.generate(prompts, sp, use_tqdm=False)
    for layer in layers:
        layer.fused = None
    plain = llm.generate(prompts, sp, use_tqdm=False)
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            (ta, pa), = la.items()
            (tb, pb), = lb.items()
            assert ta == tb and abs(pa.logprob - pb.logprob) < 1e-4
