"""Gemma 2 and Gemma 3 (text): greedy tokens equal transformers' for prompts longer than the local layers' window,
under chunked prefill, prefix hits and preemption, through every attention backend the engine may pick, and from
GGUF files in llama.cpp's names. The CPU kernels attend with Gemma 2's soft cap and each KV group's window, on every
kernel variant this CPU runs. (The mixed-length batch with logprobs is test_models.py's.)"""
from __future__ import annotations

import pytest

from tests.family_checks import (PRESSURE, check_blocks_equal_dequantised, check_one_call_layer,
                                 check_past_the_window, check_prefix_hits, check_under_pressure, greedy)
from tests.tiny_models import build_tiny, hf_greedy, random_prompts
from tokenmill import LLM
from tokenmill.config import ModelConfig
from tokenmill.executor.kernels import runnable_variants

ENGINE = dict(dtype="float32", kv_cache_memory_gb=0.02, max_model_len=512)


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def gemma(request, tmp_path_factory):
    return build_tiny(request.param, tmp_path_factory.mktemp(request.param))


def test_config_reads_the_layer_pattern(gemma):
    path, hf = gemma
    mc = ModelConfig.from_path(path)
    assert [w is not None for w in mc.layer_windows] == \
        [t == "sliding_attention" for t in hf.config.layer_types]
    assert mc.sliding_window is None            # global layers keep every block
    assert mc.query_pre_attn_scalar == hf.config.query_pre_attn_scalar


@pytest.mark.parametrize("backend", ["auto", "batched", "torch"])
def test_long_prompts_past_the_window(gemma, backend):
    check_past_the_window(*gemma, ENGINE, backend)


@pytest.mark.slow
@pytest.mark.parametrize("pressure", PRESSURE)
def test_under_pressure(gemma, pressure):
    check_under_pressure(*gemma, ENGINE, pressure)


def test_prefix_hits(gemma):
    check_prefix_hits(*gemma, ENGINE)


@pytest.mark.parametrize("isa", runnable_variants())
def test_every_kernel_variant_attends_as_transformers(gemma, isa):
    """Each CPU kernel variant's ops and attention, chunked prompts past the window among decodes: greedy tokens
    equal transformers'."""
    path, hf = gemma
    llm = LLM(path, **ENGINE, cpu_kernels=isa, attention_backend="cpu", max_num_batched_tokens=24)
    prompts = random_prompts([60, 10, 45, 33], seed=7)
    for p, got in zip(prompts, greedy(llm, prompts, 20)):
        assert got == hf_greedy(hf, p, 20), len(p)


def test_config_options_outside_the_implementation_are_named(gemma):
    import json
    cfg = json.loads(open(f"{gemma[0]}/config.json").read())
    bad = {**cfg, "layer_types": ["chunked_attention"] * cfg["num_hidden_layers"]}
    with pytest.raises(ValueError, match="layer type\\(s\\) chunked_attention are not implemented"):
        ModelConfig.from_hf_dict(bad)
    with pytest.raises(ValueError, match="use_bidirectional_attention is not implemented"):
        ModelConfig.from_hf_dict({**cfg, "use_bidirectional_attention": True})
    # transformers 4 leaves a default tie out of config.json: Gemma's default is tied
    assert ModelConfig.from_hf_dict({k: v for k, v in cfg.items() if k != "tie_word_embeddings"}).tie_word_embeddings


def test_local_layers_keep_a_window_of_blocks(gemma):
    """The local layers' groups give their blocks back as the window passes them: a long request holds its whole
    context in the global group only, and the same budget carries its KV in far fewer bytes than with every layer
    keeping every token."""
    from tokenmill import SamplingParams
    from tokenmill.engine.kv_cache_manager import NO_BLOCK
    path, hf = gemma
    eng = LLM(path, **ENGINE).llm_engine
    groups = eng.model_config.kv_groups
    assert groups.hybrid and groups.windows[0] is None and set(groups.windows[1:]) == {16}
    prompt = random_prompts([100], seed=3)[0]
    eng.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    eng.step()                       # the prompt, whose 100 positions all took blocks while it was computed
    for _ in range(30):
        eng.step()
        n = eng.requests["r"].num_computed_tokens
        full, *local = eng.kv.tables_of("r")
        assert len(full) == -(-n // 16) and NO_BLOCK not in full
        for table in local:
            assert sum(b != NO_BLOCK for b in table) <= 3          # the window's blocks and the one being filled
    bytes_used = eng.kv.num_used_blocks * eng.kv_bytes_per_block()
    every_layer = -(-n // 16) * hf.config.num_hidden_layers * eng.kv_bytes_per_block() // groups.group_size
    assert bytes_used * 2 < every_layer
    eng.kv.check_integrity()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_over_the_hybrid_cache(gemma, method):
    """Guesses verified as one-token rows in every group's tables, rejected ones trimmed from each; the draft
    model (the same Gemma) keeps a hybrid cache of its own."""
    path, hf = gemma
    spec = {"method": "ngram"} if method == "ngram" else {"model": path}
    llm = LLM(path, **ENGINE, speculative_config={**spec, "num_speculative_tokens": 3})
    seg = random_prompts([12], seed=5)[0]
    prompts = [seg * 4, random_prompts([40], seed=6)[0] + seg * 2]
    for p, got in zip(prompts, greedy(llm, prompts, 30)):
        assert got == hf_greedy(hf, p, 30)
    assert llm.llm_engine.stats.spec_num_draft_tokens > 0
    llm.llm_engine.kv.check_integrity()
    if method == "draft_model":
        llm.llm_engine.proposer.check_integrity()


# ---- GGUF ----------------------------------------------------------------------------------------------------------
def write_gemma_gguf(hf_path: str, out, qtype=None) -> None:
    """As llama.cpp's converter writes Gemma 2/3: norms stored as 1 + w, ffn_norm the norm before the MLP,
    post_attention_norm and post_ffw_norm after attention and the MLP; the soft caps, window and window pattern in
    the metadata. Matrices in qtype (else F32)."""
    import json
    import gguf
    import numpy as np
    from safetensors.numpy import load_file
    cfg = json.loads(open(f"{hf_path}/config.json").read())
    sd = load_file(f"{hf_path}/model.safetensors")
    arch = "gemma2" if cfg["model_type"] == "gemma2" else "gemma3"
    rope = cfg["rope_parameters"]
    rope = rope.get("full_attention", rope)
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
    if cfg.get("attn_logit_softcapping"):
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
    if cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])

    def put(name, x, q=None):
        x = np.ascontiguousarray(x, dtype=np.float32)
        if name.endswith("norm.weight"):
            x = x + np.float32(1.0)
        w.add_tensor(name, x if q is None else gguf.quants.quantize(x, q), raw_dtype=q)

    put("token_embd.weight", sd["model.embed_tokens.weight"])
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    mats = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
            "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
            "mlp.down_proj": "ffn_down"}
    for i in range(cfg["num_hidden_layers"]):
        h = f"model.layers.{i}."
        for hf, g in names.items():
            if h + hf + ".weight" in sd:
                put(f"blk.{i}.{g}.weight", sd[h + hf + ".weight"])
        for hf, g in mats.items():
            put(f"blk.{i}.{g}.weight", sd[h + hf + ".weight"], qtype)
    put("output_norm.weight", sd["model.norm.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _as_released(kind: str, path) -> tuple[str, object]:
    """The tiny model with query_pre_attn_scalar = head_dim, as every released Gemma but the 27Bs has it: a GGUF
    does not carry the scalar, and llama.cpp derives it so."""
    import torch
    from transformers import AutoModelForCausalLM
    from tests.tiny_models import _configs
    torch.manual_seed(0)
    cfg = _configs()[kind]()
    cfg.query_pre_attn_scalar = cfg.head_dim
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    hf.save_pretrained(path)
    return str(path), hf


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_gguf_gives_transformers_tokens(kind, tmp_path):
    path, hf = _as_released(kind, tmp_path / "hf")
    write_gemma_gguf(path, tmp_path / "g.gguf")
    llm = LLM(str(tmp_path / "g.gguf"), **ENGINE, tokenizer=None)
    mc, want = llm.llm_engine.model_config, ModelConfig.from_path(path)
    for field in ("layer_windows", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                  "rope_local_theta", "rope_scaling", "hidden_act", "gemma"):
        assert getattr(mc, field) == getattr(want, field), field
    prompts = random_prompts([60, 10, 33], seed=2)
    for p, got in zip(prompts, greedy(llm, prompts, 20)):
        assert got == hf_greedy(hf, p, 20)


def test_gguf_quantised_stays_in_blocks(gemma, tmp_path):
    import gguf
    write_gemma_gguf(gemma[0], tmp_path / "q8.gguf", gguf.GGMLQuantizationType.Q8_0)
    blocks = check_blocks_equal_dequantised(str(tmp_path / "q8.gguf"), ENGINE)
    assert blocks.llm_engine.model.layers[0].mlp.gate_up_proj.quant is not None


@pytest.mark.parametrize("isa", runnable_variants())
@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_one_call_decode_layer_equals_the_layers_op_by_op(kind, isa, tmp_path):
    """A Q8_0 GGUF's decode steps through the one-call layer (q/k norms, the soft cap, the norms after attention and
    the MLP, GeGLU, each KV group's window, in C) against the same kernels called op by op from Python: equal
    greedy tokens and logprobs, on the exact route and the default one; prompts past the window."""
    import gguf
    path, _ = _as_released(kind, tmp_path / "hf")
    write_gemma_gguf(path, tmp_path / "q8.gguf", gguf.GGMLQuantizationType.Q8_0)
    prompts = [{"prompt_token_ids": p} for p in random_prompts([60, 10, 33], seed=4)]
    for int8 in (False, True):
        llm = LLM(str(tmp_path / "q8.gguf"), **ENGINE, tokenizer=None, cpu_kernels=isa, int8_activations=int8,
                  enable_prefix_caching=False)     # (a hit's short suffix takes another int8 route: issue 47)
        check_one_call_layer(llm, prompts, 20, tol=0.0)


@pytest.mark.parametrize("residual", [False, True])
def test_bfloat16_norm_rounds_once_as_transformers(residual):
    """Gemma's norm in bfloat16: normalised and scaled by (1 + w) in float32, rounded once, as transformers does;
    bit for bit, with and without the fused residual add."""
    import torch
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    from tokenmill.executor.layers.norm import RMSNorm
    from tokenmill.executor.ops.reference import ReferenceOps
    torch.manual_seed(0)
    theirs = Gemma2RMSNorm(64, eps=1e-6).to(torch.bfloat16)
    theirs.weight.data.normal_()
    ours = RMSNorm(64, 1e-6, ReferenceOps(), offset=1.0)
    ours.weight.data = theirs.weight.data.clone()
    ours.finalize()
    x, r = torch.randn(5, 64).to(torch.bfloat16), torch.randn(5, 64).to(torch.bfloat16)
    if residual:
        got, summed = ours(x, r.clone())
        assert torch.equal(got, theirs(x + r)) and torch.equal(summed, x + r)
    else:
        assert torch.equal(ours(x), theirs(x))
