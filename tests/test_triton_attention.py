"""The Triton attention kernels (the GPU's backend) against the torch reference: run here on CPU tensors under
Triton's interpreter (conftest sets TRITON_INTERPRET=1 without a GPU); on a GPU, tests/test_gpu.py runs them.

Under the interpreter, bfloat16 values are read and converted to float32 correctly but a float32 result is
truncated, not rounded, when stored as bfloat16; the bfloat16 cases allow for it, as they allow for bfloat16's
own rounding."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="Triton's wheel is not installed for this platform")
if torch.cuda.is_available():    # the interpreter is on only without a GPU; there tests/test_gpu.py runs the kernels
    pytest.skip("these run the kernels under Triton's interpreter; on a GPU, tests/test_gpu.py runs them",
                allow_module_level=True)

from tests.family_checks import check_greedy, check_prefix_hits, greedy  # noqa: E402
from tests.test_attention_backends import CASES, _backend, _cache, _clone, _compare_with_reference, _meta  # noqa
from tests.tiny_models import build_tiny, hf_greedy, random_prompts  # noqa: E402
from tokenmill import LLM  # noqa: E402
from tokenmill.executor.kv_cache import LayerKV  # noqa: E402

ENGINE = dict(dtype="float32", kv_cache_memory_gb=0.02, max_model_len=512, attention_backend="triton")
# a prompt chunk over more than 1024 positions: the interpreter's slowest case, left to make test
LONG_PROMPT = pytest.param("long_prompt", marks=pytest.mark.slow)


@pytest.mark.parametrize("case", [c if c != "long_prompt" else LONG_PROMPT for c in CASES])
@pytest.mark.parametrize("window", [None, 20])
def test_kernels_match_reference(window, case):
    """Decodes (one and several, split or not), fresh prompts, prompts over a cached context (later chunks of a
    chunked prefill, prefix hits) and mixed steps, with and without a sliding window."""
    _compare_with_reference("triton", window, torch.float32, case, 6, 2, 32)


@pytest.mark.parametrize("case", ["mixed", "decode6", "long", LONG_PROMPT])
def test_bfloat16_model(case):
    _compare_with_reference("triton", None, torch.bfloat16, case, 6, 2, 32)


# GQA groups of 1, 4 and 8 query heads per kv head; head dims that are not a power of two; Gemma's 256
@pytest.mark.parametrize("shape", [(4, 4, 40), (8, 2, 64), (8, 1, 80), (16, 2, 256)])
@pytest.mark.parametrize("case", ["mixed", "long"])
def test_kernels_take_gqa_groups_and_head_dims(shape, case):
    _compare_with_reference("triton", None, torch.float32, case, *shape)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16, "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("case", ["mixed", "long"])
def test_rounded_kv_cache_matches_reference(kv_dtype, case):
    _compare_with_reference("triton", 20 if case == "mixed" else None, torch.float32, case, 6, 2, 32,
                            kv_dtype=kv_dtype)


@pytest.mark.parametrize("case", ["mixed", "long"])
def test_layer_window_and_soft_cap(case):
    """A layer's own window (Gemma's local layers, the model having none) and soft-capped scores (Gemma 2)."""
    H, KV, D, bs, nblocks = 8, 2, 32, 4, 300
    ctx, qn, _ = CASES[case]
    torch.manual_seed(5)
    cache = _cache(torch.randn(nblocks * bs, KV, D), torch.randn(nblocks * bs, KV, D), torch.float32)
    q = torch.randn(sum(qn), H, D) * 3           # scores large enough that the cap bends them
    k, v = torch.randn(sum(qn), KV, D), torch.randn(sum(qn), KV, D)
    for window, softcap in ((16, None), (None, 5.0), (16, 5.0)):
        outs = []
        for name in ("torch", "triton"):
            be = _backend(name, H, KV, D)
            be.bind_kv_cache([_clone(cache)])
            outs.append(be.forward(0, q, k, v, be.prepare(_meta(ctx, qn, bs, None, nblocks)), D ** -0.5,
                                   window=window, softcap=softcap))
        torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["mixed", "long", LONG_PROMPT])
@pytest.mark.parametrize("window", [None, 20])
def test_attention_sinks(window, case):
    """gpt-oss's sinks in the decode kernel (folded in at the end of one split, or once by the merge of several)
    and the prompt kernel."""
    _compare_with_reference("triton", window, torch.float32, case, 8, 2, 32, sinks=torch.linspace(-1.0, 3.0, 8))


@pytest.mark.parametrize("sinks", [None, torch.linspace(-1.0, 3.0, 6)], ids=["plain", "sinks"])
@pytest.mark.parametrize("window", [None, 20])
def test_long_decodes_are_split_and_merged(window, sinks):
    """A long context's decode is split over several programs and the partial results merged by their
    log-sum-exp (and the sinks, once); the result is the unsplit one's."""
    from tokenmill.executor.attention.gpu import TritonBackend
    cache = _cache(torch.randn(1200, 2, 32), torch.randn(1200, 2, 32), torch.float32)
    q, k, v = torch.randn(2, 6, 32), torch.randn(2, 2, 32), torch.randn(2, 2, 32)
    outs = []
    for min_programs in (16, 1):
        be = TritonBackend(torch.device("cpu"), min_programs)
        be.bind_kv_cache([_clone(cache)])
        meta = be.prepare(_meta([1100, 40], [1, 1], 4, window, 300))
        assert (meta.num_splits > 1) == (min_programs > 1)
        outs.append(be.forward(0, q, k, v, meta, 32 ** -0.5, sinks=sinks))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("window", [None, 12])
def test_unwritten_and_freed_blocks_are_never_read(window):
    """The cache is NaN wherever no step wrote, and a window's passed blocks are freed (-1 in the tables): no
    output is NaN, and each equals the reference's."""
    H, KV, D, bs, nblocks = 6, 2, 32, 4, 300
    ctx, qn, _ = CASES["mixed"]
    meta0 = _meta(ctx, qn, bs, window, nblocks)
    k0, v0 = torch.full((nblocks * bs, KV, D), float("nan")), torch.full((nblocks * bs, KV, D), float("nan"))
    for i, table in enumerate(meta0.block_tables):           # the context before this step's rows
        pos = torch.arange(meta0.num_computed[i])
        slots = torch.tensor(table)[pos // bs] * bs + pos % bs
        k0[slots], v0[slots] = torch.randn(len(pos), KV, D), torch.randn(len(pos), KV, D)
        if window is not None:                               # the blocks no query of this step can reach
            passed = max(0, meta0.num_computed[i] - window + 1) // bs
            table[:passed] = [-1] * passed
    q, k, v = torch.randn(sum(qn), H, D), torch.randn(sum(qn), KV, D), torch.randn(sum(qn), KV, D)
    outs = []
    for name in ("torch", "triton"):
        be = _backend(name, H, KV, D)
        be.bind_kv_cache([LayerKV(k0.clone(), v0.clone())])
        outs.append(be.forward(0, q, k, v, be.prepare(meta0), D ** -0.5))
    assert not outs[1].isnan().any()
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    return build_tiny("gemma2", tmp_path_factory.mktemp("gemma2"))


@pytest.mark.slow
def test_engine_token_exact(tiny_llama):
    """Greedy tokens through the Triton backend equal transformers' for a batch of mixed lengths."""
    path, hf = tiny_llama
    llm = LLM(path, **ENGINE)
    assert llm.llm_engine.runner.backend.name == "triton"
    prompts = random_prompts([5, 33, 70, 1], seed=11)
    for p, got in zip(prompts, greedy(llm, prompts, 12)):
        assert got == hf_greedy(hf, p, 12)


@pytest.mark.slow
def test_engine_chunked_and_preempted(tiny_llama):
    """Prompts in chunks of 16 beside decodes, in a pool of 4 blocks of 16 that cannot hold two requests' growth."""
    path, hf = tiny_llama
    per_block = LLM(path, **ENGINE).llm_engine.kv_bytes_per_block()
    llm = LLM(path, **{**ENGINE, "max_num_batched_tokens": 16, "max_model_len": 64,
                       "kv_cache_memory_gb": 4.5 * per_block / 2 ** 30})
    prompts = random_prompts([30, 5, 22, 9], seed=4)
    for p, got in zip(prompts, greedy(llm, prompts, 16)):
        assert got == hf_greedy(hf, p, 16)
    assert llm.llm_engine.stats.num_preemptions > 0
    llm.llm_engine.kv.check_integrity()


@pytest.mark.slow
def test_engine_prefix_hits(tiny_llama):
    check_prefix_hits(*tiny_llama, ENGINE)


@pytest.mark.slow
def test_engine_sliding_window(tiny_mistral_sw):
    """Prompts longer than the window, whose early blocks the cache frees."""
    check_greedy(*tiny_mistral_sw, ENGINE, [45, 7])


@pytest.mark.slow
def test_engine_gemma2_soft_cap_and_layer_windows(gemma2):
    check_greedy(*gemma2, ENGINE, [40, 10])


@pytest.mark.slow
def test_engine_gpt_oss_sinks_and_layer_windows(tmp_path):
    check_greedy(*build_tiny("gpt_oss", tmp_path), ENGINE, [40, 10])


@pytest.mark.slow
def test_engine_fp8_cache_matches_reference(tiny_llama):
    """An fp8 cache read by the kernels gives the reference backend's tokens over the same cache."""
    prompts = random_prompts([5, 40], seed=12)
    got = greedy(LLM(tiny_llama[0], **{**ENGINE, "kv_cache_dtype": "fp8"}), prompts, 12)
    want = greedy(LLM(tiny_llama[0], **{**ENGINE, "kv_cache_dtype": "fp8", "attention_backend": "torch"}),
                  prompts, 12)
    assert got == want


def test_refusals(tiny_llama, monkeypatch):
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' cannot be served by the 'triton' attention "
                                         "backend: the Triton kernels read float and fp8 caches"):
        LLM(tiny_llama[0], **{**ENGINE, "kv_cache_dtype": "int8"})
    if not torch.cuda.is_available():
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(ValueError, match="attention_backend='triton' cannot run here: the device is not a GPU"):
            LLM(tiny_llama[0], **ENGINE)


# The decode kernel's split count is each request's own, taken on the device from its length (so the grid, which
# depends on the batch's shape alone, can be frozen in a CUDA graph): the cases below call the kernels directly,
# over a cache that is NaN wherever no context lies, and compare with a float64 reference.

def _reference(q, k, v, tables, qsl, first_pos, bs, scale, window):
    """float64 attention of each row of request i (its rows qsl[i]..qsl[i+1], at positions first_pos[i] + m)
    over the cached keys up to its position; a row at a negative position (a decode of length 0) is zero."""
    group = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i in range(len(first_pos)):
        for m in range(int(qsl[i + 1] - qsl[i])):
            p = int(first_pos[i]) + m
            if p < 0:
                continue
            pos = torch.arange(max(0, p - window + 1) if window else 0, p + 1)
            slots = tables[i].long()[pos // bs] * bs + pos % bs
            kk = k[slots].double().repeat_interleave(group, 1)
            vv = v[slots].double().repeat_interleave(group, 1)
            p_ = (torch.einsum("hd,nhd->hn", q[qsl[i] + m].double(), kk) * scale).softmax(-1)
            out[qsl[i] + m] = torch.einsum("hn,nhd->hd", p_, vv)
    return out


def _write_context(k, v, tables, lens, bs, seed):
    """The cache (in place) NaN but for the first lens[i] positions of each request's table."""
    g = torch.Generator().manual_seed(seed)
    k.fill_(float("nan"))
    v.fill_(float("nan"))
    for i, n in enumerate(lens):
        pos = torch.arange(n)
        slots = tables[i].long()[pos // bs] * bs + pos % bs
        k[slots] = torch.randn(n, *k.shape[1:], generator=g)
        v[slots] = torch.randn(n, *v.shape[1:], generator=g)


def _paged_batch(rows, width, bs=16, H=8, KV=2, D=32, seed=0):
    """qsl, tables [B, width], a NaN out, q and empty caches for requests of these many query rows."""
    g = torch.Generator().manual_seed(seed)
    B = len(rows)
    nblocks = B * width + 5
    tables = torch.randperm(nblocks, generator=g)[:B * width].view(B, width).to(torch.int32)
    qsl = torch.tensor([0] + [sum(rows[:i + 1]) for i in range(B)], dtype=torch.int32)
    q = torch.randn(sum(rows), H, D, generator=g)
    k, v = torch.empty(nblocks * bs, KV, D), torch.empty(nblocks * bs, KV, D)
    return qsl, tables, torch.full_like(q, float("nan")), q, k, v


class _Grids:
    """Stands in for a kernel and records each launch's grid."""
    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


def test_decode_splits_depend_on_the_batch_shape_alone():
    from tokenmill.executor.attention.triton_kernels import MAX_SPLITS, decode_splits
    assert decode_splits(1, 2, 16) == 8 and decode_splits(3, 2, 16) == 4 and decode_splits(8, 2, 16) == 1
    assert decode_splits(1, 1, 10 ** 6) == MAX_SPLITS and decode_splits(0, 2, 16) == 1
    assert decode_splits(4, 8, 1) == 1


@pytest.mark.parametrize("max_splits, window", [(1, None), (2, None), (8, None), (8, 100)])
def test_decode_splits_each_context_by_its_own_length(max_splits, window, monkeypatch):
    """Contexts of 0 (a padding row), 5, 128 and 129 (one split and two), 300 and 1000 keys in one batch, beside a
    prompt request the decode leaves alone. The partials' scratch is NaN when allocated: the merge reads only the
    splits written."""
    from tokenmill.executor.attention.triton_kernels import paged_decode
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan")))
    lens, bs = [0, 5, 128, 20, 129, 300, 1000], 16
    rows = [1, 1, 1, 3, 1, 1, 1]
    qsl, tables, out, q, k, v = _paged_batch(rows, 1024 // bs, bs)
    _write_context(k, v, tables, lens, bs, seed=1)
    decode = [i for i, r in enumerate(rows) if r == 1]
    paged_decode(out, q, k, v, None, None, qsl, torch.tensor(lens, dtype=torch.int32), tables,
                 torch.tensor(decode, dtype=torch.int32), max_splits, bs, 32 ** -0.5, window, None)
    drows = qsl[decode].long()
    assert out[3:6].isnan().all()                      # the prompt request's rows: not the decode's
    assert out[drows].isfinite().all() and (out[0] == 0).all()
    want = _reference(q, k, v, tables, qsl, [n - 1 for n in lens], bs, 32 ** -0.5, window)
    torch.testing.assert_close(out[drows].double(), want[drows], atol=1e-5, rtol=1e-5)


def test_decode_grid_does_not_depend_on_lengths(monkeypatch):
    """Graph safety: the same call twice, the lengths, queries and cache rewritten in place between (as a CUDA
    graph's replay sees them), launches the same grids and gives each step's reference."""
    from tokenmill.executor.attention import triton_kernels
    split, merge = _Grids(triton_kernels._decode_split_kernel), _Grids(triton_kernels._decode_merge_kernel)
    monkeypatch.setattr(triton_kernels, "_decode_split_kernel", split)
    monkeypatch.setattr(triton_kernels, "_decode_merge_kernel", merge)
    bs = 16
    qsl, tables, out, q, k, v = _paged_batch([1] * 4, 1024 // bs, bs, seed=2)
    seq_lens, decode_reqs = torch.zeros(4, dtype=torch.int32), torch.arange(4, dtype=torch.int32)
    args = (out, q, k, v, None, None, qsl, seq_lens, tables, decode_reqs, 8, bs, 32 ** -0.5, None, None)
    for step, lens in enumerate(([1000, 0, 40, 300], [7, 600, 0, 129])):
        seq_lens.copy_(torch.tensor(lens))
        q.copy_(torch.randn(q.shape))
        _write_context(k, v, tables, lens, bs, seed=step)
        out.fill_(float("nan"))
        triton_kernels.paged_decode(*args)
        want = _reference(q, k, v, tables, qsl, [n - 1 for n in lens], bs, 32 ** -0.5, None)
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    assert split.grids == [(4, 2, 8)] * 2 and merge.grids == [(4, 8)] * 2


def test_kernels_are_custom_ops_in_a_traced_graph():
    """make_fx records each kernel call as one tokenmill op (real and fake tracing alike), and the traced graph,
    replayed over lengths and queries changed in place, gives the reference."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from tokenmill.executor.attention.triton_kernels import BLOCK_M, paged_decode, paged_prompt
    bs, scale = 16, 32 ** -0.5
    rows = [1, 20, 1, 1]
    qsl, tables, out, q, k, v = _paged_batch(rows, 512 // bs, bs, seed=3)
    seq_lens = torch.tensor([300, 50, 0, 9], dtype=torch.int32)
    computed = seq_lens - torch.tensor(rows, dtype=torch.int32)
    decode_reqs = torch.tensor([0, 2, 3], dtype=torch.int32)
    tile_req = torch.tensor([1, 1], dtype=torch.int32)
    tile_m0 = torch.tensor([0, BLOCK_M], dtype=torch.int32)

    def step(out, q, k, v, qsl, computed, seq_lens, tables, decode_reqs, tile_req, tile_m0):
        paged_decode(out, q, k, v, None, None, qsl, seq_lens, tables, decode_reqs, 4, bs, scale, None, None)
        paged_prompt(out, q, k, v, None, None, qsl, computed, tables, tile_req, tile_m0, bs, scale, None, None)
        return out

    args = (out, q, k, v, qsl, computed, seq_lens, tables, decode_reqs, tile_req, tile_m0)
    _write_context(k, v, tables, seq_lens.tolist(), bs, seed=4)
    ops = [torch.ops.tokenmill.paged_decode.default, torch.ops.tokenmill.paged_prompt.default]
    assert [n.target for n in make_fx(step, tracing_mode="fake")(*args).graph.nodes
            if n.op == "call_function"] == ops
    graph = make_fx(step, tracing_mode="real")(*args)
    assert [n.target for n in graph.graph.nodes if n.op == "call_function"] == ops
    seq_lens.copy_(torch.tensor([0, 50, 200, 130]))
    q.copy_(torch.randn(q.shape))
    _write_context(k, v, tables, seq_lens.tolist(), bs, seed=5)
    out.fill_(float("nan"))
    graph(*args)
    first = [int(seq_lens[i]) - 1 if rows[i] == 1 else int(computed[i]) for i in range(len(rows))]
    torch.testing.assert_close(out.double(), _reference(q, k, v, tables, qsl, first, bs, scale, None),
                               atol=1e-5, rtol=1e-5)
