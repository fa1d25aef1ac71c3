"""Quantised folders as people download them, made from a tiny random Llama by the tools that make them:
llm-compressor's GPTQ, AWQ, W8A16, W8A8 and FP8 recipes (compressed-tensors folders, in a venv of its own:
tests/quant_tools.py), and the legacy GPTQ (GPTQModel / AutoGPTQ) and AutoAWQ GEMM folders written from their
published packings (those tools take minutes to install and run here; quant_tools says how the packings were
checked against them). transformers reading the same folders (compressed-tensors' own decompression) is the oracle.

On the exact route (int8_activations=False) a quantised matmul differs from dequantise-then-matmul only in float32
summation order, so greedy tokens equal the dequantised model's in float32."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests import quant_tools
from tests.tiny_models import hf_greedy, random_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.executor.layers.quant import Fp8Weight, GroupWeight, PackedWeight, quant_nbytes

VOCAB = 512
PROMPTS = [p for p in random_prompts([9, 5, 14], seed=3)]
# (the scheme's expected form on the CPU plan, bits): the plan repacks integer groups into its blocks of 32 where
# they fit, and keeps what they cannot hold as it is
CT_FORMS = {"gptq_w4a16": (PackedWeight, 4), "gptq_w4a16_asym": (PackedWeight, 4),
            "gptq_w4a16_asym_g32": (PackedWeight, 4), "gptq_w8a16": (PackedWeight, 8), "gptq_w8a8": (PackedWeight, 8),
            "w4a16": (PackedWeight, 4), "w8a16": (PackedWeight, 8), "fp8_dynamic": (Fp8Weight, 8),
            "awq_w4a16_asym": (PackedWeight, 4), "awq_w4a16": (PackedWeight, 4)}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> tuple[str, object]:
    """A bf16 tiny Llama whose shapes are whole groups of 128 (the quantisers' default group)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, initializer_range=0.05,
                      eos_token_id=None, bos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    path = tmp_path_factory.mktemp("source")
    model.save_pretrained(path)
    return str(path), model


# one folder per format the recipes write: 4-bit packed groups symmetric and not, int8 channels, FP8, and AWQ's
# (8-bit packed groups, W8A16, unpack as 4-bit ones do; the legacy GPTQ tests cover 8 bits)
SCHEMES = ("gptq_w4a16", "gptq_w4a16_asym_g32", "gptq_w8a8", "fp8_dynamic", "awq_w4a16_asym")


@pytest.fixture(scope="module")
def ct_folders(source, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ct")
    jobs = {scheme: root / scheme for scheme in (*SCHEMES, "fp8_kv")}
    if quant_tools.tool_python() is None:
        pytest.fail(f"the llm-compressor tool venv could not be built: {quant_tools.last_error}")
    quant_tools.make_compressed_many(source[0], jobs)
    return jobs


def _ours(folder, **kw) -> LLM:
    kw = {"dtype": "float32", "tokenizer": None, "kv_cache_memory_gb": 0.01, "max_model_len": 128,
          "int8_activations": False, **kw}
    return LLM(str(folder), **kw)


def _greedy(llm: LLM, n: int = 12) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=n, temperature=0,
                                                                                   ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


def _linears(llm: LLM) -> list:
    from tokenmill.executor.layers.linear import Linear
    return [m for name, m in llm.llm_engine.model.named_modules() if isinstance(m, Linear) and "layers." in name]


def _transformers_reading(folder: Path) -> dict[str, torch.Tensor]:
    """The folder's weights as transformers (compressed-tensors' decompression, in the checkpoint's dtype) reads
    them, by HF name."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=CompressedTensorsConfig(dequantize=True))
    return {k: v.float() for k, v in model.state_dict().items()}


def _hf_float32(source, weights: dict[str, torch.Tensor]):
    """transformers' float32 model of the source's config with these weights."""
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM(source[1].config).float().eval()
    model.load_state_dict({**{k: v.float() for k, v in source[1].state_dict().items()}, **weights})
    return model


@pytest.mark.slow
def test_llm_compressor_fp8_kv_scales_are_read(ct_folders: dict[str, Path], source) -> None:
    """llm-compressor's kv_cache_scheme (float weights; static fp8 k_scale and v_scale a layer, calibrated on data):
    kv_cache_dtype='fp8' takes each layer's scales for every kv head, and gives the tokens of the float folder's fp8
    cache with those scales set by hand (the scales are all the folder adds); 'auto' keeps a float cache and gives
    the float folder's tokens."""
    from safetensors.torch import load_file
    folder = ct_folders["fp8_kv"]
    sd = load_file(str(folder / "model.safetensors"))
    want = [(float(sd[f"model.layers.{i}.self_attn.k_scale"]), float(sd[f"model.layers.{i}.self_attn.v_scale"]))
            for i in range(2)]
    kw = dict(dtype="float32", kv_cache_memory_gb=0.02, max_model_len=128)
    llm = LLM(str(folder), kv_cache_dtype="fp8", **kw)
    got = [(c.k_scale.tolist(), c.v_scale.tolist()) for c in llm.llm_engine.runner.kv_tensors]
    assert got == [([k] * 2, [v] * 2) for k, v in want] and all(k != 1.0 for k, _ in want)
    by_hand = LLM(source[0], kv_cache_dtype="fp8", **kw)
    for c, (k, v) in zip(by_hand.llm_engine.runner.kv_tensors, want):
        c.k_scale.fill_(k)
        c.v_scale.fill_(v)
    assert _greedy(llm) == _greedy(by_hand)
    assert _greedy(LLM(str(folder), **kw)) == _greedy(LLM(source[0], **kw))


@pytest.mark.slow
@pytest.mark.parametrize("scheme", SCHEMES)
def test_llm_compressor_folders_equal_transformers(scheme: str, ct_folders: dict[str, Path], source) -> None:
    from tokenmill.executor.loader import open_checkpoint
    folder = ct_folders[scheme]
    llm = _ours(folder)
    form, bits = CT_FORMS[scheme]
    for lin in _linears(llm):
        assert isinstance(lin.quant, form) and lin.weight is None, f"{scheme}: {type(lin.quant).__name__}"
        assert form is Fp8Weight or lin.quant.bits == bits
        n, k = lin.quant.shape
        # no float copy: codes and scales (twice over where the CPU keeps its lanes layout too) under a float32's 60%
        assert quant_nbytes(lin.quant) < 0.6 * n * k * 4
    ours = _greedy(llm)
    assert llm.llm_engine.model.lm_head.quant is None          # the exact route keeps the checkpoint's head
    # our reading of each matrix: scale * (code - zero) in float32; transformers' rounds it to the checkpoint's
    # bfloat16, so the two agree to bfloat16's rounding
    every = dict(open_checkpoint(str(folder)).tensors())
    exact = {k: v for k, v in every.items() if k.endswith("proj.weight")}
    theirs = _transformers_reading(folder)
    assert len(exact) == 14
    for name, w in exact.items():
        torch.testing.assert_close(theirs[name], w, rtol=2 ** -8, atol=1e-7)
    # and transformers' float32 forward on those exact weights (and the folder's own norms: AWQ rescales them), the
    # dequantised model, gives our tokens
    hf = _hf_float32(source, every)
    assert ours == [hf_greedy(hf, p, 12) for p in PROMPTS]


def test_the_default_route_makes_a_float_head_8_bit(ct_folders: dict[str, Path]) -> None:
    head = _ours(ct_folders["gptq_w4a16"], int8_activations=True).llm_engine.model.lm_head
    assert isinstance(head.quant, PackedWeight) and head.quant.bits == 8 and head.weight_t is None


def test_compressed_tensors_own_unpacking_reads_what_we_read(ct_folders: dict[str, Path]) -> None:
    """compressed-tensors' unpack_from_int32 on a packed layer gives the codes our loader keeps."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors.torch import load_file
    from tokenmill.executor.loader import open_checkpoint
    folder = ct_folders["gptq_w4a16_asym_g32"]
    raw = load_file(str(next(folder.glob("*.safetensors"))))
    name = "model.layers.1.mlp.down_proj"
    theirs = unpack_from_int32(raw[name + ".weight_packed"], 4, torch.Size(raw[name + ".weight_shape"].tolist()))
    ours = dict(open_checkpoint(str(folder)).tensors(keep_blocks=True))[name + ".weight"]
    assert isinstance(ours, GroupWeight) and ours.zero is not None
    assert torch.equal(ours.unpacked().to(torch.int16) - 8, theirs.to(torch.int16))


@pytest.mark.parametrize("bits,group,sym,desc_act", [(4, 32, False, False), (4, 64, False, True),
                                                     (8, 32, False, True), (4, -1, True, False)])
def test_legacy_gptq_folders(bits: int, group: int, sym: bool, desc_act: bool, source, tmp_path: Path) -> None:
    from tokenmill.executor.loader import open_checkpoint
    expected = quant_tools.write_gptq_legacy(source[0], tmp_path, bits=bits, group_size=group, sym=sym,
                                             desc_act=desc_act)
    loaded = dict(open_checkpoint(str(tmp_path)).tensors(keep_blocks=True))
    raw = quant_tools._load_folder(tmp_path)[1]
    for name, want in expected.items():
        w = loaded[name + ".weight"]
        assert isinstance(w, GroupWeight) and (w.perm is not None) == desc_act
        torch.testing.assert_close(w.dequantize(), want, rtol=0, atol=0)
        torch.testing.assert_close(quant_tools.dequant_gptq_legacy(raw, name, bits), want, rtol=0, atol=0)
    llm = _ours(tmp_path)
    if desc_act:
        assert all(lin.in_perm is not None for lin in _linears(llm))
    assert _greedy(llm) == _greedy(_ours(tmp_path, quantized_kernels=False))


def test_awq_gemm_folder(source, tmp_path: Path) -> None:
    from tokenmill.executor.loader import open_checkpoint
    expected = quant_tools.write_awq(source[0], tmp_path, group_size=128)
    loaded = dict(open_checkpoint(str(tmp_path)).tensors(keep_blocks=True))
    raw = quant_tools._load_folder(tmp_path)[1]
    for name, want in expected.items():
        torch.testing.assert_close(loaded[name + ".weight"].dequantize(), want, rtol=0, atol=0)
        torch.testing.assert_close(quant_tools.dequant_awq(raw, name, 128), want, rtol=0, atol=0)
    llm = _ours(tmp_path)
    assert all(isinstance(lin.quant, PackedWeight) for lin in _linears(llm))
    assert _greedy(llm) == _greedy(_ours(tmp_path, quantized_kernels=False))


@pytest.fixture(scope="module")
def bundled_gptq(smollm2_hf: Path, tmp_path_factory) -> Path:
    """The bundled SmolLM2 (its GGUF's weights in float) as a legacy GPTQ 4-bit folder, groups of 64 (its hidden
    size, 576, is not whole groups of 128)."""
    out = tmp_path_factory.mktemp("bundled") / "gptq"
    quant_tools.write_gptq_legacy(smollm2_hf, out, bits=4, group_size=64, sym=False)
    return out


@pytest.mark.slow
def test_default_route_bounded_on_the_bundled_model(bundled_gptq: Path) -> None:
    """The default route rounds activations to int8 per 32 where a matmul has at most 16 rows (decode; more run in
    float), so it is not exact by design: its log-likelihoods stay near the exact route's on the bundled perplexity
    text and on the exact route's own greedy continuations. Prompts go in chunks of 16 tokens, so every row takes
    the int8 route a decode step takes."""
    from tokenmill.bench.perplexity import PerplexityConfig, load_text, make_windows, score_windows, tokenize
    kw = dict(dtype="float32", kv_cache_memory_gb=0.1, max_model_len=320, enable_prefix_caching=False)
    exact = LLM(str(bundled_gptq), int8_activations=False, **kw)
    default = LLM(str(bundled_gptq), max_num_batched_tokens=16, **kw)
    assert default.llm_engine.model.ops.int8_activations
    cfg = PerplexityConfig(context=256, max_tokens_scored=510)
    ids = tokenize(exact, load_text(None)[0])
    windows = make_windows(len(ids), cfg)
    want = score_windows(exact, ids, windows, cfg, progress=False)
    got = score_windows(default, ids, windows, cfg, progress=False)
    gap = [abs(a - b) for a, b in zip(got, want)]
    ppl_ratio = math.exp((sum(got) - sum(want)) / len(want))
    assert abs(ppl_ratio - 1) <= 0.01 and sum(gap) / len(gap) <= 0.08 and max(gap) <= 1.0, \
        (ppl_ratio, sum(gap) / len(gap), max(gap))
    prompts = [tokenize(exact, t) for t in ("The capital of France is", "def fibonacci(n):", "Once upon a time")]
    conts = [o.outputs[0].token_ids for o in exact.generate([{"prompt_token_ids": p} for p in prompts],
                                                           SamplingParams(max_tokens=48, temperature=0))]
    own = [p + list(c) for p, c in zip(prompts, conts)]
    sp = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, detokenize=False)
    lp = [[o.prompt_logprobs for o in llm.generate([{"prompt_token_ids": s} for s in own], sp, use_tqdm=False)]
          for llm in (exact, default)]
    diffs = [abs(a[i][s[i]].logprob - b[i][s[i]].logprob) for a, b, s, p in zip(*lp, own, prompts)
             for i in range(len(p), len(s))]
    assert sum(diffs) / len(diffs) <= 0.06 and max(diffs) <= 1.0, (sum(diffs) / len(diffs), max(diffs))


def test_tensor_parallel_refuses_packed_folders(source, tmp_path: Path) -> None:
    quant_tools.write_gptq_legacy(source[0], tmp_path, bits=4, group_size=128)
    with pytest.raises(ValueError, match="does not split a gptq checkpoint's packed weights yet"):
        _ours(tmp_path, tensor_parallel_size=2)
