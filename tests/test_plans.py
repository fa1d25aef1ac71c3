"""The execution plan: the CPU kernel plan (every variant this CPU runs) against the reference plan (plain torch),
token for token in float32, across the architectures and the scheduling paths."""
import pytest
import torch

from tests.test_gguf import _write_tiny
from tests.tiny_models import ARCHS, build_tiny, random_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.executor.kernels import runnable_variants
from tokenmill.executor.ops import CpuKernelOps, ReferenceOps

pytestmark = pytest.mark.slow
VARIANTS = runnable_variants()
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)


def run(path, prompts, cpu_kernels, params=GREEDY, **kw):
    # the float route: plans are compared token for token (the int8 route's bound: test_qmatmul_int8.py)
    kw = {"kv_cache_memory_gb": 0.02, "max_model_len": 512, "int8_activations": False, **kw}
    llm = LLM(path, dtype="float32", cpu_kernels=cpu_kernels, tokenizer=None, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs], llm


def assert_same(got, want):
    """Greedy ids equal; logprobs within float32 summation-order noise (the kernels sum in another order)."""
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(got, want):
        for la, lb in zip(a.logprobs, b.logprobs):
            (ta, pa), = la.items()
            (tb, pb), = lb.items()
            assert ta == tb and abs(pa.logprob - pb.logprob) < 1e-3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {kind: build_tiny(kind, tmp_path_factory.mktemp(kind))[0]
            for kind in [*ARCHS, "mistral_sw", "heads144", "head_dim256"]}


@pytest.mark.parametrize("kind", [*ARCHS, "mistral_sw", "heads144", "head_dim256"])
def test_kernel_plans_equal_reference_plan(models, kind):
    prompts = random_prompts([5, 33, 70, 1, 20], seed=21)
    want, ref = run(models[kind], prompts, "reference")
    assert type(ref.llm_engine.model.ops) is ReferenceOps
    for isa in VARIANTS:
        got, llm = run(models[kind], prompts, isa)
        assert isinstance(llm.llm_engine.model.ops, CpuKernelOps) and llm.llm_engine.model.ops.kernels.isa == isa
        assert llm.llm_engine.runner.backend.name == "cpu"      # Gemma's soft caps and windows too
        assert_same(got, want)


@pytest.mark.parametrize("path", ["chunked", "prefix", "preempt"])
def test_kernel_plans_equal_reference_on_scheduling_paths(models, path):
    """Chunked prefill (7 tokens a step), prefix-cache hits (a shared 64-token prefix) and preemption (a cache
    of 12 blocks)."""
    llama = models["llama"]
    if path == "prefix":
        shared = random_prompts([64], seed=5)[0]
        prompts = [shared + s for s in random_prompts([3, 9, 17, 4, 30], seed=6)]
        kw = {}
    else:
        prompts = random_prompts([5, 33, 70, 12, 1, 48, 20, 9], seed=3)
        kw = {"max_num_batched_tokens": 7} if path == "chunked" else \
            {"kv_cache_memory_gb": 12 * (2 * 3 * 16 * 2 * 8 * 4) / 2 ** 30, "max_model_len": 128}
    want, _ = run(llama, prompts, "reference", **kw)
    for isa in VARIANTS:
        got, llm = run(llama, prompts, isa, **kw)
        assert_same(got, want)
        stats = llm.get_stats()
        if path == "prefix":
            assert stats["prefix_cache_hits"] > 0
        if path == "preempt":
            assert stats["num_preemptions"] > 0


def test_quantised_gguf_kernel_plans_equal_reference(tmp_path):
    """A GGUF with Q4_0/Q4_1/Q8_0 matrices: the kernel plans decode from the blocks (and the one-call layer does
    not apply: its qkv stays dense), the reference from the dequantised weights; 40 requests finishing at
    different steps make decode batches of 40 down to 1 rows, so every qmatmul path runs."""
    path = tmp_path / "tiny.gguf"
    _write_tiny(path)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 48, (int(n),), generator=g).tolist() for n in torch.randint(1, 30, (40,), generator=g)]
    params = [SamplingParams(temperature=0, max_tokens=4 + i // 2, ignore_eos=True, logprobs=0) for i in range(40)]
    want = [o.outputs[0] for o in LLM(str(path), dtype="float32", kv_cache_memory_gb=0.01, cpu_kernels="reference",
                                      tokenizer=None).generate([{"prompt_token_ids": p} for p in prompts], params,
                                                               use_tqdm=False)]
    for isa in VARIANTS:
        llm = LLM(str(path), dtype="float32", kv_cache_memory_gb=0.01, cpu_kernels=isa, tokenizer=None,
                  int8_activations=False)
        got = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                  use_tqdm=False)]
        assert_same(got, want)
