"""On an NVIDIA GPU (skipped without one): the engine with the Triton attention kernels against transformers on the
same device, greedy tokens exact in float32 and close by the logprob rule in bfloat16 (DESIGN.md: where two
tokens tie within rounding, each side's token is in the other's top-k)."""
from __future__ import annotations

import copy

import pytest
import torch
import transformers
from packaging.version import Version

from tests.tiny_models import build_tiny, random_prompts
from tokenmill import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]
TOP = 5


@pytest.fixture(scope="module", params=["llama", "mistral_sw", "gemma2", "gpt_oss", "qwen3_5"])
def model(request, tmp_path_factory):
    return build_tiny(request.param, tmp_path_factory.mktemp(request.param))


@torch.no_grad()
def _hf(hf, prompt: list[int], n: int, dtype: torch.dtype) -> tuple[list[int], list[dict[int, float]]]:
    """transformers' greedy tokens on the GPU and the top logprobs at each."""
    hf = copy.deepcopy(hf).to("cuda", dtype)
    # the plain attention: transformers before 5.2x ran Gemma 2 on SDPA by default, which drops its soft cap
    hf.set_attn_implementation("eager")
    out = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=n, do_sample=False, eos_token_id=None,
                      pad_token_id=0, output_scores=True, return_dict_in_generate=True,
                      attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device="cuda"))
    tops = []
    for scores in out.scores:
        lp = torch.log_softmax(scores[0].float(), -1)
        v, i = lp.topk(TOP)
        tops.append(dict(zip(i.tolist(), v.tolist())))
    return out.sequences[0, len(prompt):].tolist(), tops


def _ours(path: str, prompts: list[list[int]], n: int, dtype: str, plan: str = "triton"):
    """plan 'triton': the GPU's kernels; 'reference': torch's ops and attention on the device (the plain path)."""
    kw = {} if plan == "triton" else {"cpu_kernels": "reference", "attention_backend": "torch"}
    llm = LLM(path, dtype=dtype, device="cuda", kv_cache_memory_gb=0.05, max_model_len=512, **kw)
    assert (llm.llm_engine.runner.backend.name == "triton") == (plan == "triton")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=TOP), use_tqdm=False)
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in outs]


@pytest.mark.parametrize("plan", ["triton", "reference"])
def test_float32_token_exact(model, plan):
    path, hf = model
    prompts = random_prompts([5, 33, 70, 12, 1, 48], seed=11)
    for p, (toks, lps) in zip(prompts, _ours(path, prompts, 24, "float32", plan)):
        want, want_lps = _hf(hf, p, 24, torch.float32)
        assert toks == want
        for t, got, ref in zip(toks, lps, want_lps):
            assert abs(got[t] - ref[t]) < 1e-4


def test_bfloat16_logprobs_close(model):
    """Up to the first divergence the chosen tokens' logprobs agree to bfloat16's rounding; a divergence is a tie
    within rounding: each side's token is in the other's top tokens (then the sequences part ways)."""
    path, hf = model
    if hf.config.model_type == "gpt_oss" and Version(transformers.__version__) < Version("5.24"):
        # the oracle's: older transformers' bfloat16 gpt-oss parts from 5.24's, which both our plans meet, on the
        # CPU too (float32 is exact under either; BENCHMARKS.md, run xx)
        pytest.xfail(f"transformers {transformers.__version__}'s bfloat16 gpt-oss parts from 5.24's")
    prompts = random_prompts([5, 33, 70, 12], seed=12)
    for p, (toks, lps) in zip(prompts, _ours(path, prompts, 24, "bfloat16")):
        want, want_lps = _hf(hf, p, 24, torch.bfloat16)
        for j, (a, b) in enumerate(zip(toks, want)):
            if a != b:
                assert a in want_lps[j] and b in lps[j], (j, a, b)
                break
            assert abs(lps[j][a] - want_lps[j][a]) < 0.1, (j, lps[j][a], want_lps[j][a])


@pytest.mark.parametrize("case", ["mixed", "decode6", "long", "context", "long_prompt"])
@pytest.mark.parametrize("window,softcap", [(None, None), (20, None), (20, 5.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_match_reference(case, window, softcap, dtype):
    """The Triton kernels on the device against the torch reference on the device: decodes (split or not),
    fresh prompts, prompts over a cached context, sliding windows, Gemma 2's soft cap (the tiny model's 5.0);
    float32 products and bfloat16 ones."""
    from tests.test_attention_backends import CASES, _meta
    from tokenmill.executor.attention import get_backend
    from tokenmill.executor.kv_cache import LayerKV
    H, KV, D, bs, nblocks = 8, 2, 64, 4, 300
    ctx, qn, _ = CASES[case]
    dev = torch.device("cuda")
    k0, v0 = (torch.randn(nblocks * bs, KV, D, device=dev).to(dtype) for _ in "kv")
    q, k, v = (torch.randn(sum(qn), n, D, device=dev).to(dtype) for n in (H, KV, KV))
    outs = []
    for name in ("torch", "triton"):
        be = get_backend(name, dev, H, KV, D, None)
        be.bind_kv_cache([LayerKV(k0.clone(), v0.clone())])
        meta = _meta(ctx, qn, bs, window, nblocks)
        meta.device, meta.slot_mapping = dev, meta.slot_mapping.to(dev)
        outs.append(be.forward(0, q, k, v, be.prepare(meta), D ** -0.5, softcap=softcap).float())
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(outs[1], outs[0], atol=tol, rtol=tol)


@pytest.mark.parametrize("kind", ["llama", "mistral_sw", "gemma2"])
def test_graph_replay_equals_eager_without_host_syncs(kind, tmp_path):
    """The GPU runner's captured decode steps against its eager steps, at every captured size (batches of 8 down to
    1 requests), with torch's sync debug mode raising on any blocking host sync inside the steps (the one read-back
    of the sampled tokens waits on an event, which it does not count)."""
    path, _ = build_tiny(kind, tmp_path)
    prompts = random_prompts([5, 33, 70, 12, 1, 48, 9, 20], seed=13)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=TOP) for n in range(3, 27, 3)]
    sizes = [1, 2, 4, 8]

    def run(graphs: bool):
        llm = LLM(path, dtype="float32", device="cuda", kv_cache_memory_gb=0.05, max_model_len=512,
                  enforce_eager=not graphs, compilation_config={"cudagraph_capture_sizes": sizes})
        torch.cuda.set_sync_debug_mode("error")
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return llm, [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()}
                                               for d in o.outputs[0].logprobs]) for o in outs]
    _, eager = run(False)
    llm, graph = run(True)
    runner = llm.llm_engine.runner
    assert runner.backend.name == "triton" and set(runner.replays) == set(sizes), runner.replays
    for (gt, gl), (et, el) in zip(graph, eager):
        assert gt == et
        for a, b in zip(gl, el):
            assert max(abs(a[t] - b[t]) for t in a) < 1e-4


def test_gemma2_first_layer_on_cuda_and_cpu(tmp_path):
    """Where tokenmill's Gemma 2 on the GPU leaves its own run on the CPU: each op of the first layer, prefilling
    one 48-token prompt (the probe the open Gemma 2 gap needs; the first differing op is in the failure message)."""
    path, _ = build_tiny("gemma2", tmp_path)
    prompt = random_prompts([48], seed=11)[0]
    seen: dict[str, list[torch.Tensor]] = {}
    for dev in ("cpu", "cuda"):
        llm = LLM(path, dtype="float32", device=dev, kv_cache_memory_gb=0.05, max_model_len=512,
                  cpu_kernels="reference", attention_backend="batched", enforce_eager=True)
        model = llm.llm_engine.model
        layer = model.layers[0]
        hooks = []
        for name, mod in [("input_layernorm", layer.input_layernorm), ("qkv_proj", layer.self_attn.qkv_proj),
                          ("self_attn", layer.self_attn), ("o_proj", layer.self_attn.o_proj)]:
            hooks.append(mod.register_forward_hook(
                lambda m, a, o, name=name: seen.setdefault(name, []).append(
                    (o[0] if isinstance(o, tuple) else o).detach().float().cpu())))
        rotary = llm.llm_engine.runner.backend.forward_rotary

        def spy(layer_idx, qk, v, rope, rot, *args, **kw):
            if layer_idx == 0:
                seen.setdefault("rope_cos", []).append(rope[0].detach().float().cpu())
                seen.setdefault("qk_rotated", []).append(rot(qk.clone(), *rope).detach().float().cpu())
            return rotary(layer_idx, qk, v, rope, rot, *args, **kw)
        llm.llm_engine.runner.backend.forward_rotary = spy
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        for h in hooks:
            h.remove()
    diffs = {k: (v[0] - v[1]).abs().max().item() for k, v in seen.items() if len(v) == 2}
    assert all(d < 1e-5 for d in diffs.values()), diffs


def test_async_scheduling_equals_sync_on_cuda(tmp_path):
    """Steps launched before the last one is back (their in-flight rows fed on the device, two pinned host headers
    in turn): the same tokens as one step at a time, with no blocking host sync inside the steps."""
    path, _ = build_tiny("llama", tmp_path)
    prompts = [{"prompt_token_ids": p} for p in random_prompts([5, 33, 70, 12, 1, 48], seed=14)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, stop_token_ids=[3, 7])
              for n in (4, 9, 14, 19, 24, 29)]

    def run(async_scheduling: bool) -> list[list[int]]:
        llm = LLM(path, dtype="float32", device="cuda", kv_cache_memory_gb=0.05, max_model_len=512,
                  async_scheduling=async_scheduling, compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8]})
        torch.cuda.set_sync_debug_mode("error")
        try:
            return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert run(True) == run(False)
