"""Every attention backend matches the torch reference, token for token and close in value."""
import pytest
import torch

from tests.tiny_models import random_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.executor.attention import AttentionMetadata, get_backend
from tokenmill.executor.kernels import load, runnable_variants
from tokenmill.executor.kv_cache import (LayerKV, dequantize_fp8, dequantize_int4, dequantize_int8, quantize_fp8,
                                         quantize_int4, quantize_int8)


def _fp8(dtype: torch.dtype):
    """(quantize, dequantize) of an fp8 cache with a different scale per kv head: values of randn / scale reach
    e4m3's clamp at 448 for the smallest scale, its subnormals for the largest."""
    def scales(x):
        return torch.tensor([0.01, 0.5, 1.0, 3.0] * 8)[:x.shape[-2]]
    return (lambda x: (quantize_fp8(x, scales(x), dtype), scales(x)), dequantize_fp8)


QUANT = {"int8": (quantize_int8, dequantize_int8), "int4": (quantize_int4, dequantize_int4),
         "fp8_e4m3": _fp8(torch.float8_e4m3fn), "fp8_e5m2": _fp8(torch.float8_e5m2)}

# the CPU kernel backend once per kernel variant this CPU runs, each against the torch reference
CPU = [f"cpu-{isa}" for isa in runnable_variants()]


def _backend(name: str, H: int, KV: int, D: int):
    isa = name.split("-", 1)[1] if name.startswith("cpu-") else "reference"
    return get_backend(name.split("-")[0], torch.device("cpu"), H, KV, D, load(isa))


def _cache(k: torch.Tensor, v: torch.Tensor, kv_dtype: torch.dtype) -> LayerKV:
    """A LayerKV holding k and v [slots, KV, D] in kv_dtype: a torch float dtype, or a name in QUANT (quantised,
    with their scales)."""
    if kv_dtype not in QUANT:
        return LayerKV(k.to(kv_dtype).contiguous(), v.to(kv_dtype).contiguous())
    quantize = QUANT[kv_dtype][0]
    (kq, ks), (vq, vs) = quantize(k), quantize(v)
    return LayerKV(kq, vq, ks, vs)


def _clone(c: LayerKV) -> LayerKV:
    return LayerKV(*(None if t is None else t.clone() for t in (c.k, c.v, c.k_scale, c.v_scale)))


def _meta(ctx_lens, q_lens, block_size, window, num_blocks, seed=0, shared_blocks=0):
    """shared_blocks: every request's table starts with the same blocks (a cached common prefix)."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    prefix = [perm.pop() for _ in range(shared_blocks)]
    tables, slots, qsl, computed = [], [], [0], []
    for c, n in zip(ctx_lens, q_lens):
        nb = -(-c // block_size)
        table = prefix + [perm.pop() for _ in range(nb - shared_blocks)]
        tables.append(table)
        computed.append(c - n)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(c - n, c)]
        qsl.append(qsl[-1] + n)
    return AttentionMetadata(torch.tensor(slots), qsl, computed, list(ctx_lens), tables, block_size, window)


# mixed: decodes and prefills (fresh and with context). Pure decode steps take the C kernel's direct path, with
# q a strided view (as it is of fused qkv): one request (heads split over threads) and six (one item each).
# cascade: the first 17 blocks (68 positions) are the same for every request, so the C kernel attends them once
# for the batch (without a window); with a prefill in the step too. context: prompts over a cached context,
# longer than a tile of query tokens and a chunk of positions. Values: (context lengths, query lengths, shared
# blocks).
CASES = {"mixed": ([1, 9, 37, 64, 5, 50], [1, 1, 1, 1, 5, 13], 0), "decode1": ([45], [1], 0),
         "decode6": ([1, 9, 37, 64, 17, 50], [1] * 6, 0),
         "cascade": ([70, 90, 130, 77, 200], [1] * 5, 17),
         "cascade_mixed": ([70, 90, 130, 77, 200, 150], [1, 1, 1, 1, 1, 30], 17),
         "context": ([150, 45, 300], [40, 20, 70], 0),
         "long": ([1100, 40], [1, 1], 0),      # over 1024 positions: the C decode splits a request's range
         "long_prompt": ([1100, 40], [30, 1], 0)}   # a prompt chunk over more than 1024 positions


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("backend", ["batched", *CPU])
def test_backend_matches_reference(backend, window, dtype, case):
    _compare_with_reference(backend, window, dtype, case, 6, 2, 32)


# (H, KV, D): the C kernel's float32 decode path (decode_fast) takes query rows 3 at a time for scores and 4 at
# a time for values, and head dims in 64-wide pieces plus 16-wide tails; D = 40 is not a multiple of 16, so
# attend_rows decodes it instead.
@pytest.mark.parametrize("case", ["decode1", "decode6", "cascade", "mixed", "long"])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("shape", [(9, 3, 64), (8, 2, 80), (10, 2, 48), (4, 4, 40)])
@pytest.mark.parametrize("backend", CPU)
def test_cpu_decode_head_shapes(backend, shape, window, case):
    _compare_with_reference(backend, window, torch.float32, case, *shape)


# the shapes: 144 query heads (more than one work item of the kernel holds), head_dim 24 and 256, and
# groups of 1 to 8 query heads per kv head
@pytest.mark.parametrize("shape", [(144, 18, 64), (144, 144, 24), (8, 1, 256), (16, 2, 256), (6, 6, 24)])
@pytest.mark.parametrize("case", ["decode6", "mixed", "cascade"])
@pytest.mark.parametrize("backend", CPU)
def test_cpu_kernels_take_the_shapes_of_their_limits(backend, case, shape):
    _compare_with_reference(backend, None, torch.float32, case, *shape)


# kv_cache_dtype="bfloat16", "int8", "int4" or "fp8_e4m3" under a float32 model: q float32, the cache rounded or quantised; every
# backend reads the same K/V (the reference dequantises the rows it gathers, the kernels a chunk at a time in L1),
# so they agree as closely as float32 caches do
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("shape", [(6, 2, 32), (9, 3, 64)])
@pytest.mark.parametrize("backend", ["batched", *CPU])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, "int8", "int4", "fp8_e4m3"])
def test_rounded_kv_cache_matches_reference(kv_dtype, backend, shape, window, case):
    _compare_with_reference(backend, window, torch.float32, case, *shape, kv_dtype=kv_dtype)


@pytest.mark.parametrize("kv_dtype", list(QUANT))
@pytest.mark.parametrize("backend", ["batched", *CPU])
def test_quantised_cache_attends_the_dequantised_values(backend, kv_dtype):
    """A quantised cache's attention equals float32 attention over its dequantised K/V, to float32 rounding."""
    quantize, dequantize = QUANT[kv_dtype]
    H, KV, D, bs, nblocks = 12, 4, 32, 4, 300
    ctx, qn, _ = CASES["mixed"]
    torch.manual_seed(3)
    k, v = torch.randn(nblocks * bs, KV, D), torch.randn(nblocks * bs, KV, D)
    quant = _cache(k, v, kv_dtype)
    deq = LayerKV(dequantize(quant.k, quant.k_scale), dequantize(quant.v, quant.v_scale))
    q = torch.randn(sum(qn), H, D)
    kn, vn = torch.randn(sum(qn), KV, D), torch.randn(sum(qn), KV, D)
    # the step's own K/V, as the quantised cache will hold them, so the float32 run reads the same values
    (kq, ks), (vq, vs) = quantize(kn), quantize(vn)
    kd, vd = dequantize(kq, ks), dequantize(vq, vs)
    got_be, want_be = _backend(backend if backend == "batched" else backend, H, KV, D), _backend("torch", H, KV, D)
    got_be.bind_kv_cache([quant])
    want_be.bind_kv_cache([deq])
    got = got_be.forward(0, q, kn, vn, got_be.prepare(_meta(ctx, qn, bs, None, nblocks)), D ** -0.5)
    want = want_be.forward(0, q, kd, vd, want_be.prepare(_meta(ctx, qn, bs, None, nblocks)), D ** -0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, want_be.forward(0, q, kn, vn, want_be.prepare(_meta(ctx, qn, bs, None, nblocks)),
                                                   D ** -0.5), atol=1e-4, rtol=0)   # the rounding is really there


# Gemma 2's soft cap on every path of the C kernels (decode_fast, attend_rows for D = 40, the cascade, prompt
# tiles, ranges split past 1024 positions), Gemma 3 270M's heads (4, 1, 256) among them; a cap of 3 bends scores of
# about that size, so dropping it fails (checked in the test)
@pytest.mark.parametrize("case", ["mixed", "cascade_mixed", "context", "long", "long_prompt"])
@pytest.mark.parametrize("shape", [(6, 2, 32), (4, 1, 256), (4, 4, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", CPU)
def test_cpu_kernels_soft_cap_scores(backend, dtype, shape, case):
    _compare_with_reference(backend, 20 if case == "context" else None, dtype, case, *shape, softcap=3.0)


# gpt-oss's attention sinks (a logit per query head that takes a share of each softmax) on every path of the C
# kernels: decode_fast and attend_rows (D = 40), ranges split past 1024 positions and merged, the cascade's shared
# part, prompt tiles with a window, a bfloat16 model; sinks from -1 to 3 against scores of about 1, so dropping them
# fails
@pytest.mark.parametrize("case", ["mixed", "cascade_mixed", "context", "long"])
@pytest.mark.parametrize("dtype, shape", [(torch.float32, (6, 2, 32)), (torch.float32, (4, 4, 40)),
                                          (torch.bfloat16, (8, 1, 64))])
@pytest.mark.parametrize("backend", CPU)
def test_attention_sinks(backend, dtype, shape, case):
    sinks = torch.linspace(-1.0, 3.0, shape[0])
    _compare_with_reference(backend, 20 if case == "context" else None, dtype, case, *shape, sinks=sinks)


@pytest.mark.parametrize("case", ["mixed", "context", "long_prompt"])
@pytest.mark.parametrize("backend", ["batched", "padded"])
def test_attention_sinks_torch_backends(backend, case):
    _compare_with_reference(backend, 20 if case == "context" else None, torch.float32, case, 6, 2, 32,
                            sinks=torch.linspace(-1.0, 3.0, 6))


def _compare_with_reference(backend, window, dtype, case, H, KV, D, kv_dtype=None, softcap=None, sinks=None):
    bs, nblocks = 4, 300
    ctx, qn, shared = CASES[case]
    torch.manual_seed(0)
    cache = _cache(torch.randn(nblocks * bs, KV, D), torch.randn(nblocks * bs, KV, D), kv_dtype or dtype)
    T = sum(qn)
    q = torch.randn(T, H + 2, D).to(dtype)[:, 1:H + 1]          # rows strided, as a view of qkv is
    k, v = torch.randn(T, KV, D).to(dtype), torch.randn(T, KV, D).to(dtype)
    outs = {}
    for name in ("torch", backend):
        be = _backend(name, H, KV, D)
        be.bind_kv_cache([_clone(cache)])
        meta = be.prepare(_meta(ctx, qn, bs, window, nblocks, shared_blocks=shared))
        outs[name] = be.forward(0, q, k, v, meta, D ** -0.5, softcap=softcap, sinks=sinks).float()
        if name.startswith("cpu"):
            shared_len = meta.decode_step.shared_len if meta.decode_step is not None else 0
            assert shared_len == (68 if shared and window is None else 0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[backend], outs["torch"], atol=tol, rtol=tol)
    if softcap is not None or sinks is not None:    # a kernel that dropped the cap or the sinks would fail above
        be = _backend("torch", H, KV, D)
        be.bind_kv_cache([_clone(cache)])
        uncapped = be.forward(0, q, k, v, be.prepare(_meta(ctx, qn, bs, window, nblocks, shared_blocks=shared)),
                              D ** -0.5).float()
        assert (uncapped - outs["torch"]).abs().max() > 2 * tol


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16", "int8", "fp8"])
def test_cpu_backend_token_exact(tiny_llama, kv_cache_dtype):
    prompts = random_prompts([5, 33, 70, 12, 1, 48], seed=11)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    res = {}
    for name in ("torch", "cpu"):
        llm = LLM(tiny_llama[0], dtype="float32", max_model_len=512, kv_cache_memory_gb=0.02, attention_backend=name,
                  kv_cache_dtype=kv_cache_dtype)
        res[name] = [o.outputs[0].token_ids for o in
                     llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    assert res["cpu"] == res["torch"]


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, *QUANT])
@pytest.mark.parametrize("ctx", [[45], [1, 9, 37, 64, 17, 50]])
@pytest.mark.parametrize("isa", runnable_variants())
def test_decode_attention_kernel_matches_rotary_then_reference(isa, ctx, kv_dtype):
    """tm_decode_attention (rotary + KV write + attention from the fused qkv rows, inside the one-call decode
    layer) against rotating in torch and the reference backend: same output, same caches."""
    from tokenmill.executor.layers.rotary import apply_rotary
    H, KV, D, bs, nblocks = 12, 4, 32, 4, 200
    torch.manual_seed(1)
    T = len(ctx)
    qkv = torch.randn(T, (H + 2 * KV) * D)
    cos, sin = torch.randn(T, 1, D), torch.randn(T, 1, D)
    cache = _cache(torch.randn(nblocks * bs, KV, D), torch.randn(nblocks * bs, KV, D), kv_dtype)
    be = _backend(f"cpu-{isa}", H, KV, D)
    got_cache = _clone(cache)
    be.bind_kv_cache([got_cache])
    meta = be.prepare(_meta(ctx, [1] * T, bs, None, nblocks))
    meta.decode_step.cos, meta.decode_step.sin = cos.data_ptr(), sin.data_ptr()
    got = torch.empty(T, H, D)
    be.kernels.run("decode_attention", step=meta.decode_step, kv=meta.kv[0], qkv=qkv.clone(), qkv_stride=qkv.shape[1],
                   out=got, heads=H, scale=D ** -0.5, softcap=0.0, sinks=None)
    qk = apply_rotary(qkv[:, :(H + KV) * D].view(T, H + KV, D), cos, sin)
    v = qkv[:, (H + KV) * D:].view(T, KV, D)
    ref = _backend("torch", H, KV, D)
    want_cache = _clone(cache)
    ref.bind_kv_cache([want_cache])
    want = ref.forward(0, qk[:, :H], qk[:, H:], v, ref.prepare(_meta(ctx, [1] * T, bs, None, nblocks)), D ** -0.5)
    # a bfloat16 or quantised cache: C and torch rotate k with float32 rounding differences, which can round an
    # element to a neighbouring bfloat16 (one step is 2^-8 relative) or code (one step is the row's or group's
    # scale; int4's min moves with its group's too; an fp8 step is 2^-3 (e4m3) or 2^-2 (e5m2) of the value, or the
    # smallest subnormal)
    close = dict(atol=1e-5, rtol=1e-5) if kv_dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(got, want, **close)
    kg, vg = got_cache.read(torch.arange(nblocks * bs), torch.float32)
    kw, vw = want_cache.read(torch.arange(nblocks * bs), torch.float32)
    if kv_dtype == "int8":
        step = got_cache.k_scale.repeat_interleave(kg.shape[-1] // got_cache.k_scale.shape[-1], -1) * 1.001
        assert ((kg - kw).abs() <= step).all()
    elif kv_dtype == "int4":
        step = got_cache.k_scale[..., 0].float().repeat_interleave(32, -1) * 2.01
        assert ((kg - kw).abs() <= step).all()
    elif kv_dtype in ("fp8_e4m3", "fp8_e5m2"):
        rel, sub = (2 ** -3, 2 ** -9) if kv_dtype == "fp8_e4m3" else (2 ** -2, 2 ** -16)
        step = (kw.abs() * rel + got_cache.k_scale[:, None] * sub) * 1.01
        assert ((kg - kw).abs() <= step).all()
    else:
        torch.testing.assert_close(kg, kw, **(dict(atol=1e-6, rtol=1e-6) if kv_dtype == torch.float32
                                              else dict(atol=0, rtol=2 ** -8)))
    assert torch.equal(vg, vw)          # v is not rotated: the same bytes, written by C and by torch


def test_int8_cache_holds_about_four_times_the_tokens(tiny_llama):
    """The engine sizes the cache from the budget in the dtype's bytes per token, scales included, as kv-calc
    counts them: int8 is D + 4 bytes a token's head against float32's 4 D (3.8x at head_dim 64; this tiny model's
    head_dim is smaller, so less); fp8 is D bytes."""
    from tokenmill.bench.kvcalc import kv_calc
    blocks = {}
    for dt in ("float32", "int8", "fp8"):
        llm = LLM(tiny_llama[0], dtype="float32", kv_cache_memory_gb=0.02, kv_cache_dtype=dt)
        eng = llm.llm_engine
        blocks[dt] = eng.stats.kv_blocks_total
        per_block = eng.runner.kv_bytes_per_block(eng.config)
        assert per_block == kv_calc(eng.model_config, 64, {"float32": "fp32"}.get(dt, dt))["bytes_per_token"] * 16
    D = LLM(tiny_llama[0], dtype="float32", kv_cache_memory_gb=0.02).llm_engine.model_config.head_dim
    want = 4 * D / (D + 4)
    assert abs(blocks["int8"] / blocks["float32"] - want) < 0.05 * want
    assert abs(blocks["fp8"] / blocks["float32"] - 4) < 0.05 * 4      # fp8's scales are the layer's, not a token's


@pytest.mark.parametrize("beside", [0, 1])
@pytest.mark.parametrize("rows", [2, 4, 6])
@pytest.mark.parametrize("kv_dtype", [torch.float32, "int8"])
@pytest.mark.parametrize("backend", CPU)
def test_verification_rows_get_the_bits_of_lone_decodes(backend, kv_dtype, rows, beside):
    """A verification's rows (one request's token and its guesses: the same table, one position apart, here across
    a part boundary at 128), alone or beside another request, give each row exactly what a decode step of that row
    alone gives, so guessing changes no greedy token. (Four rows of one request once took the cascade.)"""
    H, KV, D, bs, nblocks = 9, 3, 64, 16, 64
    torch.manual_seed(5)
    cache = _cache(torch.randn(nblocks * bs, KV, D), torch.randn(nblocks * bs, KV, D), kv_dtype)
    table, other = list(range(0, 20)), list(range(20, 40))
    lens = [126 + j for j in range(rows)] + [200]
    tables = [table] * rows + [other]
    q = torch.randn(rows + 1, H + 2, D)[:, 1:H + 1]
    k, v = torch.randn(rows + 1, KV, D), torch.randn(rows + 1, KV, D)
    be = _backend(backend, H, KV, D)
    be.bind_kv_cache([cache])

    def step(idx):
        slots = torch.tensor([tables[i][(lens[i] - 1) // bs] * bs + (lens[i] - 1) % bs for i in idx])
        meta = AttentionMetadata(slots, list(range(len(idx) + 1)), [lens[i] - 1 for i in idx], [lens[i] for i in idx],
                                 [tables[i] for i in idx], bs, None)
        return be.forward(0, q[idx], k[idx], v[idx], be.prepare(meta), D ** -0.5)

    together = step(list(range(rows + beside)))   # writes every row's K/V, which the later rows attend
    for i in range(rows + beside):
        assert torch.equal(together[i], step([i])[0]), f"row {i}"
