"""The CPU kernel library, every variant this CPU runs, op by op against the reference (plain torch) ops: the
quantised-block matmul, the small per-layer ops, the KV write, the one-call decode layer, and the library's
interface itself (the header's structs, the ISA choice, stale builds)."""
from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
import time

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.family_checks import check_one_call_layer
from tokenmill import LLM
from tokenmill.executor.kernels import REFERENCE, Cpu, choose, load, runnable_variants, this_cpu
from tokenmill.executor.kernels.abi import HEADER, parse
from tokenmill.executor.layers.linear import Linear
from tokenmill.executor.layers.quant import pack_ggml
from tokenmill.executor.kv_cache import LayerKV
from tokenmill.executor.layers.rotary import apply_rotary
from tokenmill.executor.memory import PageToucher, touch_pages
from tokenmill.executor.ops import CpuKernelOps, ReferenceOps

QTYPES = ["Q4_0", "Q4_1", "Q5_0", "Q8_0"]
VARIANTS = runnable_variants()
REF = ReferenceOps()


@pytest.fixture(params=VARIANTS, scope="module")
def ops(request) -> CpuKernelOps:
    """The float route: the block kernels equal dequantise-then-matmul to float32 rounding (the int8 route, which
    rounds x first, is tests/test_qmatmul_int8.py)."""
    return CpuKernelOps(load(request.param), torch.float32, int8_activations=False)


def _packed(qtype: str, n: int, k: int, seed: int = 0):
    """A random [n, k] matrix through gguf's quantiser: (PackedWeight, gguf's own dequantisation)."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    t = gguf.GGMLQuantizationType[qtype]
    raw = gguf.quants.quantize(w, t)
    ref = torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, t), dtype=np.float32).reshape(n, k))
    return pack_ggml(qtype, raw, (n, k)), ref


def test_every_variant_of_this_architecture_is_built_and_the_best_is_chosen() -> None:
    cpu = this_cpu()
    assert VARIANTS and VARIANTS[-1] == "generic" and VARIANTS[0] == cpu.best()
    assert choose("auto") == cpu.best()
    assert load("generic").isa == "generic"


def test_a_variant_the_cpu_cannot_run_is_a_clear_error(monkeypatch) -> None:
    avx2_only = Cpu("x86_64", "AMD EPYC (Zen 1)", frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2",
                                                              "movbe", "abm", "sse4_2"}))
    assert avx2_only.best() == "avx2"
    with pytest.raises(ValueError, match="cannot run the avx512 kernels, which need avx512bw.*choose one of avx2, "
                                         "generic, reference"):
        choose("avx512", avx2_only)
    with pytest.raises(ValueError, match="need an aarch64 CPU"):
        choose("neon", avx2_only)
    with pytest.raises(ValueError, match="unknown CPU kernel variant 'sse9'"):
        choose("sse9", avx2_only)
    monkeypatch.setenv("TOKENMILL_CPU_ISA", "reference")
    assert choose("auto") == REFERENCE and load() is None
    monkeypatch.setenv("TOKENMILL_CPU_ISA", "generic")
    assert choose(None, avx2_only) == "generic"


def test_header_is_the_one_description_of_the_interface() -> None:
    """Every kernel the header declares is exported by every variant, each takes its own struct, and the limits
    the Python side reads are the header's."""
    abi = parse(HEADER.read_text())
    kernels = [f for f in abi.functions.values() if f.arg is not None]
    assert {f.name for f in kernels} >= {"tm_qmatmul", "tm_paged_decode", "tm_paged_prefill", "tm_decode_layer",
                                         "tm_rms_norm", "tm_rotary", "tm_silu_mul", "tm_argmax", "tm_write_kv"}
    for isa in VARIANTS:
        lib = load(isa)
        assert lib.limits == abi.limits and lib.limits["TM_QMATMUL_MAX_ROWS"] == 64
        for f in kernels:
            assert ctypes.sizeof(lib.structs.types[f.arg]) > 0 and f.arg in abi.structs


def test_struct_fields_are_checked_by_name_and_dtype() -> None:
    lib = load(VARIANTS[0])
    x, out = torch.randn(2, 8), torch.empty(2, dtype=torch.int64)
    with pytest.raises(TypeError, match=r"missing fields \['num_threads'\]"):
        lib.struct("argmax_args", x=x, out=out, rows=2, n=8)
    with pytest.raises(TypeError, match=r"unknown fields \['cols'\]"):
        lib.struct("argmax_args", x=x, out=out, rows=2, n=8, num_threads=1, cols=8)
    with pytest.raises(TypeError, match="argmax_args.x takes a CPU tensor of float, got torch.float64"):
        lib.struct("argmax_args", x=x.double(), out=out, rows=2, n=8, num_threads=1)
    with pytest.raises(RuntimeError, match="argmax kernel refused its arguments"):
        lib.run("argmax", x=x, out=out, rows=2, n=0, num_threads=1)


def test_a_library_built_from_other_sources_is_refused(tmp_path) -> None:
    """A stale build (the sources changed since) fails at load with the command that fixes it."""
    from tokenmill.executor.kernels import library
    src = load(VARIANTS[0]).path
    stale = tmp_path / src.name
    stale.write_bytes(src.read_bytes().replace(library.source_hash().encode(), b"0" * 16))
    with pytest.raises(library.KernelLibraryError, match="built from other sources.*make kernels"):
        library.KernelLibrary(stale, VARIANTS[0])
    with pytest.raises(library.KernelLibraryError, match="not built.*make setup"):
        library.KernelLibrary(tmp_path / "missing.so", VARIANTS[0])


@pytest.mark.parametrize("qtype", QTYPES)
def test_pack_dequantizes_like_gguf(qtype: str) -> None:
    p, ref = _packed(qtype, 37, 96)
    assert p.bits == (8 if qtype in ("Q8_0", "Q5_0") else 4)        # Q5_0: its codes - 16 as Q8_0's int8
    # Q4_0 is d * (c - 8) in gguf and d * c - 8d here: equal up to one rounding
    torch.testing.assert_close(p.dequantize(), ref, rtol=1e-6, atol=1e-6)
    if qtype != "Q4_0":
        assert torch.equal(p.dequantize(), ref)


def _rounding_bound(x: torch.Tensor, p) -> torch.Tensor:
    """What float32 rounding alone can add to x @ W^T, W = d * c + m, in a kernel that forms d * sum(c x) +
    m * sum(x): a few ulps of sum(|x| (|d c| + |m|)) (the two terms may cancel), for each output."""
    n, k = p.shape
    mag = p.dequantize().abs() if p.offset is None else \
        (p.dequantize() - p.offset.repeat_interleave(32, dim=1)).abs() + p.offset.abs().repeat_interleave(32, dim=1)
    return 16 * torch.finfo(torch.float32).eps * (x.double().abs() @ mag.double().t())


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("n,k", [(1, 32), (5, 96), (37, 64), (130, 160), (64, 1536)])
def test_qmatmul_matches_dense(ops, qtype: str, n: int, k: int) -> None:
    """Within float32 rounding of the float64 product with the dequantised weights (gguf's own dequantiser)."""
    p, ref = _packed(qtype, n, k, seed=n + k)
    for b in [*range(1, 10), 15, 16, 17, 21, 33, 48, ops.max_rows]:   # every kernel; partial and several passes
        x = torch.randn(b, k, generator=torch.Generator().manual_seed(b))
        err = (ops.qmatmul(x, p).double() - x.double() @ ref.double().t()).abs()
        bound = _rounding_bound(x, p)
        assert (err <= bound).all(), f"rows {b}: error {err.max():.3g} past the rounding bound"
        assert err.max() < 1e-3       # and a bound a wrong block (scale, offset, nibble order) would break


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("n,k", [(16, 32), (80, 96), (144, 160)])   # panels of 1, 3 + 2 and 3 x 3 vectors
def test_qmatmul_lanes_layout_matches_dense(ops, qtype: str, n: int, k: int) -> None:
    p, ref = _packed(qtype, n, k, seed=n + k)
    lanes = ops._register(p)
    assert (lanes.lanes is not None) == (ops.kernels.isa == "avx512")   # the lanes kernel is AVX-512's
    for b in [1, 8, 9, 10, 17, 33, 40, 41, ops.max_rows]:   # each side of the lanes kernel's row range
        x = torch.randn(b, k, generator=torch.Generator().manual_seed(b))
        y = ops.qmatmul(x, lanes)
        assert ((y.double() - x.double() @ ref.double().t()).abs() <= _rounding_bound(x, p)).all()
        # the same dequantised values summed in the same k order as the row-layout kernels: equal bits
        # wherever both sum with one FMA chain per output (the row dot products split k into pieces)
        if b > 20:
            assert torch.equal(y, ops.qmatmul(x, p))


def test_qmatmul_rejects_what_it_cannot_take(ops) -> None:
    p, _ = _packed("Q4_1", 8, 64)
    with pytest.raises(ValueError, match="qmatmul takes"):
        ops.qmatmul(torch.randn(ops.max_rows + 1, 64), p)
    with pytest.raises(ValueError, match="qmatmul takes"):
        ops.qmatmul(torch.randn(1, 32), p)
    assert pack_ggml("Q4_K", np.zeros((1, 144), np.uint8), (1, 256)) is None


def test_linear_uses_blocks_for_few_rows_only(ops) -> None:
    p, ref = _packed("Q4_1", 48, 64)
    lin = Linear(64, 48, False, ops)
    lin.weight.data.copy_(ref)
    lin.finalize()
    dense = [lin(torch.randn(r, 64)) for r in (1, ops.max_rows + 3)]   # reference outputs, no blocks yet
    lin.quant, lin.weight_t = p, None
    x1, xb = torch.randn(1, 64), torch.randn(ops.max_rows + 3, 64)
    torch.testing.assert_close(lin(x1), x1 @ ref.t(), rtol=1e-5, atol=1e-5)
    # many rows: tiles dequantised (exactly the reference's values) into a GEMM
    torch.testing.assert_close(lin(xb), xb @ ref.t(), rtol=1e-5, atol=1e-5)
    assert [d.shape for d in dense] == [(1, 48), (ops.max_rows + 3, 48)]


@pytest.mark.parametrize("rows", [1, 3, 100])
def test_add_rms_norm_matches_torch(ops, rows: int) -> None:
    x, res, w = torch.randn(rows, 96), torch.randn(rows, 96), torch.randn(96)
    want, want_res = REF.rms_norm(x, res.clone(), w, 1e-5)
    out, got_res = ops.rms_norm(x, res.clone(), w, 1e-5)
    assert torch.equal(got_res, want_res)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    out, same = ops.rms_norm(x, None, w, 1e-5)
    assert same is x
    torch.testing.assert_close(out, w * F.rms_norm(x, (96,), eps=1e-5), rtol=1e-5, atol=1e-6)
    out, _ = ops.rms_norm(x.double(), None, w.double(), 1e-5)   # not float32: the reference's turn
    assert out.dtype == torch.float64


@pytest.mark.parametrize("rows", [1, 70])
def test_rotary_matches_torch(ops, rows: int) -> None:
    heads, d, kv = 6, 16, 2
    qkv = torch.randn(rows, (heads + kv) * d)
    cos, sin = torch.randn(rows, 1, d), torch.randn(rows, 1, d)
    want = apply_rotary(qkv[:, :heads * d].view(rows, heads, d), cos, sin)
    v_before = qkv[:, heads * d:].clone()
    got = ops.rotary(qkv[:, :heads * d].view(rows, heads, d), cos, sin)
    assert got.data_ptr() == qkv.data_ptr()                         # in place, in the fused rows
    torch.testing.assert_close(qkv[:, :heads * d].view(rows, heads, d), want, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, heads * d:], v_before)                # only the first `heads` vectors move


def test_silu_mul_matches_torch(ops) -> None:
    gu = torch.randn(5, 2 * 40) * 4
    torch.testing.assert_close(ops.silu_mul(gu), REF.silu_mul(gu), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shape", [(64, 49152), (3, 1000), (2, 17), (1, 5)])
def test_argmax_matches_torch(ops, shape) -> None:
    torch.manual_seed(0)
    x = torch.randn(shape)
    x[0, 1:3] = 9.0                       # a tie: the first index wins
    if shape[1] > 16:
        x[-1, -1] = 99.0                  # the largest in the tail after the last whole vector
    assert torch.equal(ops.argmax(x), x.argmax(dim=-1))
    # torch's rules at the edges: a NaN is the largest (its first one), -0.0 == 0.0, a row of -inf gives 0
    e = torch.randn(5, 40)
    e[0, 30], e[0, 7] = float("nan"), float("nan")
    e[1] = float("-inf")
    e[2] = 0.0
    e[2, 3] = -0.0
    e[3, 20], e[3, 35] = float("inf"), float("inf")
    e[4, 33] = float("nan")
    assert ops.argmax(e).tolist() == e.argmax(dim=-1).tolist() == [7, 0, 0, 20, 33]


@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16", "int8", "int4"])
def test_write_kv_matches_torch(ops, cache_dtype) -> None:
    """The C write stores what LayerKV.write (torch) stores, byte for byte: bfloat16 rounded to nearest even as
    torch converts; int8 and int4 codes and scales from the same float32 operations."""
    kv, d, t = 2, 32, 3
    qkv = torch.randn(t, (4 + 2 * kv) * d)                         # k and v are strided views of these rows
    qkv[1, 4 * d:5 * d] = 0                                        # a head of zeros: scale 0, codes 0
    k = qkv[:, 4 * d:(4 + kv) * d].view(t, kv, d)
    v = qkv[:, (4 + kv) * d:].view(t, kv, d)
    slots = torch.tensor([7, 0, 12])
    got = LayerKV.allocate(16, kv, d, cache_dtype)
    for x in got.tensors():
        x.zero_()
    want = LayerKV(*(None if x is None else x.clone() for x in (got.k, got.v, got.k_scale, got.v_scale)))
    want.write(slots, k, v)
    st = ops.kernels.struct("kv_cache", k=got.k, v=got.v, k_scale=got.k_scale, v_scale=got.v_scale, num_slots=16,
                            kv_heads=kv, head_dim=got.head_dim, format=got.format)
    write = dict(kv=st, k=k, v=v, src_stride=k.stride(0), rows=t)
    ops.kernels.run("write_kv", slots=slots, **write)
    assert all(torch.equal(a, b) for a, b in zip(got.tensors(), want.tensors()))
    if cache_dtype == "int8":
        assert got.k_scale[0, 0] == 0 and not got.k[0, 0].any() and got.k.abs().max() == 127
    if cache_dtype == "int4":
        nibbles = torch.cat([got.k & 15, got.k >> 4])
        assert not got.k_scale[0, 0].any() and not got.k[0, 0].any() and nibbles.max() == 15
    with pytest.raises(IndexError):
        ops.kernels.run("write_kv", slots=torch.tensor([7, 0, 16]), **write)
    assert all(torch.equal(a, b) for a, b in zip(got.tensors(), want.tensors()))   # a bad slot writes nothing


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
def test_touch_pages_faults_in_every_page_keeps_contents_and_resumes() -> None:
    # fresh, untouched pages from anonymous maps of their own (after an engine's keep_freed_memory even a large
    # torch.empty may reuse resident heap); not a whole number of chunks
    maps = [mmap.mmap(-1, (40 << 20) + 4000) for _ in range(3)]
    ts = [torch.frombuffer(m, dtype=torch.float32) for m in maps]
    nbytes = ts[0].numel() * 4
    ts[1][:5] = 7.0                                  # a step wrote here already: the touch must keep it
    ts[2][-3:] = -1.5
    lib = load(VARIANTS[0])
    stop = ctypes.c_int(1)
    args, keep = touch_pages(lib, ts, 2 << 20, stop)
    assert lib.call("touch_pages", args) == 0                    # stopped before it began
    resident, total = _resident_pages(ts[0])
    assert resident < total
    stop.value = 0
    args, keep = touch_pages(lib, ts, 2 << 20, stop, start=20 << 20)
    assert lib.call("touch_pages", args) == nbytes
    resident, total = _resident_pages(ts[0])
    assert total // 3 < resident < total                         # from the start offset on only
    args, keep = touch_pages(lib, ts, 2 << 20, stop)
    assert lib.call("touch_pages", args) == nbytes
    for t in ts:
        resident, total = _resident_pages(t)
        assert resident == total
    assert ts[1][:5].tolist() == [7.0] * 5 and ts[2][-3:].tolist() == [-1.5] * 3
    assert not ts[0].any() and not ts[1][5:].any()


def test_page_toucher_resumes_and_joins_its_thread() -> None:
    ts = [torch.empty(1 << 24) for _ in range(4)]     # 256 MB: far more than the empty body leaves time for
    pages = PageToucher(load(VARIANTS[0]), ts)
    with pages.running():
        assert any(t.name == "tokenmill-fault-in" for t in threading.enumerate())
    assert not any(t.name == "tokenmill-fault-in" for t in threading.enumerate())
    reached = pages.offset
    assert 0 <= reached < pages.total and not pages.done
    with pages.running():
        time.sleep(0.3)
    assert pages.offset > reached
    while not pages.done:
        with pages.running():
            time.sleep(0.05)
    assert pages.offset == pages.total and pages.resident_bytes == 4 << 26
    with pytest.raises(ValueError, match="one size"):
        PageToucher(load(VARIANTS[0]), [torch.empty(10), torch.empty(11)])


def test_page_toucher_stays_ahead_of_use_only() -> None:
    """With ahead_bytes it touches that far past the highest byte use() was told of, and no further."""
    ts = [torch.empty(1 << 22) for _ in range(2)]     # 16 MB each
    pages = PageToucher(load(VARIANTS[0]), ts, chunk_bytes=1 << 20, ahead_bytes=4 << 20)
    assert pages.limit == 4 << 20
    while not pages.done:
        with pages.running():
            time.sleep(0.01)
    assert pages.offset == 4 << 20 and pages.resident_bytes == 8 << 20
    pages.use(3 << 20)          # use that stays inside what is touched moves the limit on
    assert pages.limit == 7 << 20 and not pages.done
    pages.use(1 << 20)          # never back
    assert pages.limit == 7 << 20
    pages.use(15 << 20)
    assert pages.limit == pages.total == 16 << 20
    while not pages.done:
        with pages.running():
            time.sleep(0.01)
    assert pages.offset == pages.total


@pytest.mark.slow
@pytest.mark.parametrize("isa", VARIANTS)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16", "int8", "int4", "fp8_e4m3"])
def test_fused_decode_layer_matches_layer_by_layer(isa, kv_cache_dtype) -> None:
    """The bundled Q4_1 GGUF qualifies for the one-call decode layer; with it and without it (the same kernels
    called one by one from Python), greedy ids are equal and logprobs agree; with quantised KV caches too."""
    llm = LLM(dtype="float32", kv_cache_memory_gb=0.1, max_model_len=512, enable_prefix_caching=False,
              kv_cache_dtype=kv_cache_dtype, cpu_kernels=isa)
    assert llm.llm_engine.runner.kv_caches[0].dtype == {"auto": "float32"}.get(kv_cache_dtype, kv_cache_dtype)
    check_one_call_layer(llm, ["The capital of France is", "def fibonacci(n):", "Once upon a time"], 16, tol=1e-4)


def test_a_tied_head_shares_its_tables_kernel_layout() -> None:
    """The bundled model ties its head to its Q8_0 embedding table: both read one repacked copy (the lanes layout
    made once), not one each."""
    llm = LLM(kv_cache_memory_gb=0.2, max_model_len=256)
    model, ops = llm.llm_engine.model, llm.llm_engine.model.ops
    assert model.config.tie_word_embeddings
    assert model.lm_head.quant is model.embed_tokens.quant
    assert sum(1 for w, _ in ops._qweights.values() if w.shape == model.embed_tokens.quant.shape) == 1
