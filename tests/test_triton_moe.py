"""The fused Mixture-of-Experts kernel (ops/triton_moe.py) against ReferenceOps.fused_moe, under Triton's interpreter
on CPU tensors (on a GPU, on CUDA tensors): float and group-quantised experts, routings with empty experts and with
every token on the same experts; moe_align's invariants; and what makes it graph-safe: no host sync in a MoE step
through TritonOps (the reference's step has them), one traced node.

Tolerances: float32 within 1e-5 relative (the GEMMs sum K in another order); bfloat16 within 2 units in the last
place of the output's magnitude (a product rounded one way or the other moves one rounding of the intermediate,
which the down GEMM spreads), most entries exact."""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():     # before triton is imported: its interpreter runs the kernels on CPU tensors
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="Triton's wheel is not installed for this platform")

from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from tokenmill.config import ModelConfig  # noqa: E402
from tokenmill.executor.graph_check import GraphSafetyMode  # noqa: E402
from tokenmill.executor.layers.moe import SparseMoeBlock  # noqa: E402
from tokenmill.executor.layers.quant import GroupWeight, PackedWeight, pack_codes  # noqa: E402
from tokenmill.executor.models.decoder import MLP  # noqa: E402
from tokenmill.executor.ops import triton_moe as tm  # noqa: E402
from tokenmill.executor.ops.reference import ReferenceOps  # noqa: E402
from tokenmill.executor.ops.triton import TritonOps  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
REF = ReferenceOps()
E, K_TOP, H, INTER = 8, 2, 32, 16


def _config() -> ModelConfig:
    return ModelConfig.from_hf_dict(dict(
        architectures=["Qwen3MoeForCausalLM"], vocab_size=32, hidden_size=H, intermediate_size=64,
        moe_intermediate_size=INTER, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        num_experts=E, num_experts_per_tok=K_TOP))


def _block(ops, dtype=torch.float32, act="silu", finalize=True, seed=0) -> SparseMoeBlock:
    """A MoE block of random float experts on DEVICE; finalize: the CPU layout (W^T kept) as a loaded model has.
    act 'gelu': experts with Gemma's GeGLU (no MoE family has it yet; the kernel takes it)."""
    torch.manual_seed(seed)
    cfg = _config()
    block = SparseMoeBlock(cfg, ops, lambda inter: MLP(cfg, ops, inter, reduce=False))
    if act == "gelu":
        for e in block.experts:
            e.act = ops.gelu_tanh_mul
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
    block = block.to(DEVICE, dtype)
    if finalize:
        for m in block.modules():
            if hasattr(m, "finalize") and m.__class__.__name__ == "Linear":
                m.finalize()
    return block


def _group_weight(n: int, k: int, bits: int, group: int, zero: bool, scale_dtype) -> GroupWeight:
    codes = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8)
    scale = (torch.rand(n, k // group) * 0.02 + 0.005).to(scale_dtype)
    z = torch.randint(0, 1 << bits, (n, k // group), dtype=torch.uint8) if zero else None
    return GroupWeight(bits, pack_codes(codes, bits), scale, z, group, (n, k)).to(DEVICE)


def _quantise(block: SparseMoeBlock, bits: int, group: int, zero: bool, scale_dtype=torch.float16) -> None:
    for e in block.experts:
        for lin in (e.gate_up_proj, e.down_proj):
            n, k = (lin.weight if lin.weight is not None else lin.weight_t.t()).shape
            g = min(group, k)        # down_proj's 16 columns: one group a row where the group is wider
            lin.quant, lin.weight, lin.weight_t = _group_weight(n, k, bits, g, zero, scale_dtype), None, None


def _routing(T: int, kind: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32, ids) [T, k]: 'random' over all experts; 'sparse': only experts 1, 4, 6 (five are empty);
    'one': every token on experts 5 and 2."""
    g = torch.Generator().manual_seed(seed)
    pool = {"random": list(range(E)), "sparse": [1, 4, 6], "one": [5, 2]}[kind]
    if kind == "one":
        ids = torch.tensor([pool] * T)
    else:
        ids = torch.stack([torch.tensor(pool)[torch.randperm(len(pool), generator=g)[:K_TOP]] for _ in range(T)])
    weights = torch.rand(T, K_TOP, generator=g)
    return weights.to(DEVICE), ids.to(DEVICE)


def _ulp(x: torch.Tensor) -> torch.Tensor:
    bits = {torch.bfloat16: 8, torch.float16: 11}[x.dtype]
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), torch.frexp(x.float()).exponent - bits)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return
    # half dtypes: within 2 ulps of the output's scale (its largest entries), most exact
    scale = _ulp(want.float().abs().amax(dim=-1, keepdim=True).expand_as(want).to(want.dtype))
    worst = ((got.float() - want.float()).abs() / scale).max().item()
    assert worst <= 2.0, f"{worst} ulps apart"
    assert (got == want).float().mean().item() >= 0.7


# ---- moe_align ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("T,k,experts,block_m,kind", [
    (1, 2, 8, 16, "random"), (17, 2, 8, 16, "random"), (64, 2, 8, 16, "sparse"), (64, 2, 8, 16, "one"),
    (50, 4, 16, 64, "random"), (5, 8, 128, 16, "random"), (0, 2, 8, 16, "random")])
def test_moe_align_invariants(T, k, experts, block_m, kind):
    g = torch.Generator().manual_seed(T + k)
    if T == 0:
        ids = torch.empty(0, k, dtype=torch.long)
    elif kind == "random":
        ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(T)])
    elif kind == "sparse":
        ids = torch.stack([torch.tensor([1, 4, 6])[torch.randperm(3, generator=g)[:k]] for _ in range(T)])
    else:
        ids = torch.tensor([[5, 2]] * T)
    sorted_ids, block_expert, num_blocks = tm.moe_align(ids.to(DEVICE), experts, block_m)
    M = T * k
    # the sizes are bounds from the shapes only
    assert sorted_ids.shape == (tm.align_bound(M, experts, block_m),) and sorted_ids.dtype == torch.int32
    assert block_expert.shape == (sorted_ids.shape[0] // block_m,) and num_blocks.shape == (1,)
    s, be, nb = sorted_ids.cpu().long(), block_expert.cpu().long(), int(num_blocks.cpu())
    flat = ids.flatten()
    counts = torch.bincount(flat, minlength=experts)
    assert nb == int(((counts + block_m - 1) // block_m).sum())
    live = s < M
    assert sorted(s[live].tolist()) == list(range(M))                 # every pair exactly once
    assert (s[~live] == M).all()                                       # the rest: the sentinel
    assert not live[nb * block_m:].any()                               # nothing past the valid blocks
    blocks = s[:nb * block_m].view(nb, block_m)
    for b in range(nb):
        pairs = blocks[b][blocks[b] < M]
        assert len(pairs) > 0 and (flat[pairs] == be[b]).all()         # one expert a block, none empty
        assert pairs.tolist() == sorted(pairs.tolist())                # in pair order within it
        if len(pairs) < block_m:                                       # padding only at the run's end
            assert (blocks[b][:len(pairs)] < M).all()
    assert be[:nb].tolist() == sorted(be[:nb].tolist())                # runs in ascending expert order
    assert (be >= 0).all() and (be < experts).all()


def test_moe_align_issues_no_host_sync():
    ids = torch.tensor([[3, 1], [1, 7], [3, 0]], device=DEVICE)
    with torch.inference_mode(), GraphSafetyMode([ids], DEVICE) as mode:
        tm.moe_align(ids, 8, 16)
    assert mode.violations == []


# ---- the kernel against the reference ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["random", "sparse", "one"])
@pytest.mark.parametrize("T", [1, 3, 17, 64])
def test_fused_moe_float32_matches_reference(T, kind):
    block = _block(REF, finalize=T % 2 == 1, seed=T)           # odd T: the CPU's W^T layout; even: W as loaded
    x = (torch.randn(T, H) * 2).to(DEVICE)
    weights, ids = _routing(T, kind, seed=T)
    want = REF.fused_moe(x, weights, ids, block.experts)
    stacked, why = tm.stack_experts(block.experts, torch.float32)
    assert why is None
    _close(tm.fused_moe(x, weights, ids, stacked), want)
    # the experts' own weights are views of the stack: the reference reads the same values, no second copy
    lin = block.experts[3].gate_up_proj
    w = lin.weight if lin.weight is not None else lin.weight_t
    assert w.untyped_storage().data_ptr() == stacked.gate_up.weight.untyped_storage().data_ptr()
    torch.testing.assert_close(REF.fused_moe(x, weights, ids, block.experts), want, rtol=0, atol=0)


@pytest.mark.parametrize("act", ["silu", "gelu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_moe_half_dtypes_match_reference(dtype, act):
    T = 17
    block = _block(REF, dtype, act=act, seed=5)
    x = torch.randn(T, H).to(DEVICE, dtype)
    weights, ids = _routing(T, "random", seed=5)
    stacked, why = tm.stack_experts(block.experts, dtype)
    assert why is None and stacked.act == ("gelu_tanh_mul" if act != "silu" else "silu_mul")
    _close(tm.fused_moe(x, weights, ids, stacked), REF.fused_moe(x, weights, ids, block.experts))


@pytest.mark.parametrize("bits,group,zero,dtype", [(4, 16, True, torch.float32), (8, 32, False, torch.bfloat16),
                                                   (4, 8, False, torch.bfloat16), (8, 16, True, torch.float16)])
def test_fused_moe_group_quantised_experts(bits, group, zero, dtype):
    """GroupWeight experts (4 bits packed two a byte, or 8), dequantised in registers: the reference's value, which
    dequantises tiles to float32 (bfloat16 for a bfloat16 model) and multiplies."""
    T = 17
    block = _block(REF, dtype, seed=bits + group)
    _quantise(block, bits, group, zero)
    x = torch.randn(T, H).to(DEVICE, dtype)
    weights, ids = _routing(T, "sparse", seed=7)
    stacked, why = tm.stack_experts(block.experts, dtype)
    assert why is None and stacked.gate_up.bits == bits and stacked.gate_up.weight.shape[0] == E
    assert stacked.gate_up.weight.dtype == torch.uint8           # no float copy
    _close(tm.fused_moe(x, weights, ids, stacked), REF.fused_moe(x, weights, ids, block.experts))


# ---- the plan: TritonOps, graph safety, tracing ------------------------------------------------------------------

class _Model(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.config = block.cfg
        self.block = block


def test_triton_ops_serve_moe_without_a_host_sync():
    """prepare() stacks the block's experts; a MoE step through TritonOps equals the reference's and issues no host
    sync, no shape from data, no tensor from Python values; the reference's step does all of those."""
    ops = TritonOps(torch.float32)
    block = _block(ops, seed=11)
    ops.prepare(_Model(block))
    assert id(block.experts) in ops.moe and ops.moe_fallbacks == 0
    assert ops.describe()["fused_moe"].startswith("triton")
    x = torch.randn(9, H, device=DEVICE)
    weights, ids = block.route(x)
    _close(ops.fused_moe(x, weights, ids, block.experts), REF.fused_moe(x, weights, ids, block.experts))

    with torch.inference_mode(), GraphSafetyMode([block, x], DEVICE) as mode:
        block(x)
    assert mode.violations == []
    with torch.inference_mode(), GraphSafetyMode([block, x, weights, ids], DEVICE) as mode:   # inside the op
        tm.fused_moe_impl(x, weights, ids, *_args(ops.moe[id(block.experts)])[3:])
    assert mode.violations == []

    block.ops = REF
    with torch.inference_mode(), GraphSafetyMode([block, x], DEVICE) as mode:
        block(x)
    kinds = {v.kind for v in mode.violations}
    assert "python_read" in kinds and "dynamic_shape" in kinds, mode.violations


def _args(s: tm.StackedExperts) -> tuple:
    g, d = s.gate_up, s.down
    return (None, None, None, g.weight, d.weight, g.scale, g.zero, d.scale, d.zero, g.bits, g.group, d.bits, d.group,
            g.shape[1], d.shape[1], s.act == "gelu_tanh_mul")


def test_traced_step_is_one_node():
    block = _block(REF, seed=2)
    stacked, _ = tm.stack_experts(block.experts, torch.float32)
    x = torch.randn(5, H, device=DEVICE)
    weights, ids = _routing(5, "random", seed=2)
    gm = make_fx(lambda x, w, i: tm.fused_moe(x, w, i, stacked), tracing_mode="real")(x, weights, ids)
    ops = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert ops == ["tokenmill.fused_moe.default"], ops
    x2 = torch.randn(5, H, device=DEVICE)
    torch.testing.assert_close(gm(x2, weights, ids), tm.fused_moe(x2, weights, ids, stacked), rtol=0, atol=0)
    args = (x, weights, ids) + _args(stacked)[3:]
    torch.library.opcheck(torch.ops.tokenmill.fused_moe.default, args, test_utils=("test_schema", "test_faketensor"))


def test_fits_name_what_the_kernel_does_not_take():
    block = _block(REF, seed=3)
    assert tm.fused_moe_fits(block.experts, torch.float32) is None
    assert "float64" in tm.fused_moe_fits(block.experts, torch.float64)
    assert "bfloat16" in tm.fused_moe_fits(block.experts, torch.bfloat16)       # float32 experts, bf16 activations
    q = _block(REF, seed=3)
    _quantise(q, 4, 16, True)
    lin = q.experts[0].down_proj
    lin.quant = dataclasses.replace(lin.quant, perm=torch.arange(INTER))
    assert "perm" in tm.fused_moe_fits(q.experts, torch.float32)
    lin.quant = PackedWeight(8, torch.zeros(H, INTER, dtype=torch.int8), torch.ones(H, 1), None, (H, INTER))
    assert "PackedWeight" in tm.fused_moe_fits(q.experts, torch.float32)
    mixed = _block(REF, seed=3)
    _quantise(mixed, 8, 16, False)
    mixed.experts[1].down_proj.quant = _group_weight(H, INTER, 4, 16, False, torch.float16)
    assert "different forms" in tm.fused_moe_fits(mixed.experts, torch.float32)
    # a block the kernel does not take stays the reference's, named in the plan
    ops = TritonOps(torch.float32)
    fallback = _block(ops, seed=4)
    fallback.experts[2].down_proj.bias = torch.nn.Parameter(torch.randn(H, device=DEVICE))
    assert "bias" in tm.fused_moe_fits(fallback.experts, torch.float32)
    ops.prepare(_Model(fallback))
    assert ops.moe == {} and ops.moe_fallbacks == 1 and ops.describe()["fused_moe"] == "torch"
    x = torch.randn(3, H, device=DEVICE)
    w, i = _routing(3, "random", seed=4)
    torch.testing.assert_close(ops.fused_moe(x, w, i, fallback.experts), REF.fused_moe(x, w, i, fallback.experts))


def test_a_moe_model_on_the_triton_plan_gives_transformers_tokens(tmp_path):
    """A tiny Qwen3-MoE loaded on the Triton plan: every MoE layer's experts stacked at load, greedy tokens equal
    transformers'."""
    from tests.tiny_models import build_tiny, hf_greedy, random_prompts
    from tokenmill import LLM, SamplingParams
    path, hf = build_tiny("qwen3_moe", tmp_path)
    llm = LLM(path, dtype="float32", device=DEVICE, cpu_kernels="triton", kv_cache_memory_gb=0.02, max_model_len=256,
              enforce_eager=True)
    model = llm.llm_engine.model
    ops = model.ops
    assert ops.name == "triton" and ops.moe_fallbacks == 0
    assert len(ops.moe) == sum(hasattr(layer.mlp, "experts") for layer in model.layers) > 0
    prompts = random_prompts([5, 12], seed=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 6)
