"""Qwen3.5 (Qwen3_5ForCausalLM, text), Qwen3.5-MoE and Qwen3-Next from HF folders: Gated DeltaNet linear-attention
layers, each keeping a fixed-size state a request (executor/linear_states.py), around gated full-attention layers
that keep KV; the MoE models' MLPs are experts beside a gated shared expert, and Qwen3-Next's linear projections
come grouped by key head. Greedy tokens and logprobs equal transformers' in a mixed batch, through every attention
backend and kernel plan, in chunks of a prompt (the state carried across them), under preemption (the state started
afresh, or resumed from a snapshot), on prefix hits (resumed from the state snapshot at a cached block boundary) and
with slots reused by later requests; what the state cannot do yet is refused by name."""
from __future__ import annotations

import pytest
import torch

from tests.family_checks import PRESSURE, check_under_pressure, greedy
from tests.tiny_models import build_tiny, hf_greedy, hf_logprobs, random_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.config import ModelConfig
from tokenmill.executor.layers.gated_deltanet import CHUNK, chunked_delta_rule, recurrent_step
from tokenmill.executor.linear_states import state_bytes_per_request
from tokenmill.executor.kernels import load, runnable_variants
from tokenmill.executor.ops import CpuKernelOps, ReferenceOps

ENGINE = dict(dtype="float32", kv_cache_memory_gb=0.02, max_model_len=512)
ENGINE_SEQS = 256           # the engine's max_num_seqs: as many state slots, and as many snapshots


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next", "qwen3_5_moe"])
def qwen3_5(request, tmp_path_factory):
    return build_tiny(request.param, tmp_path_factory.mktemp(request.param))


def test_config_reads_the_linear_layers(qwen3_5):
    path, hf = qwen3_5
    mc = ModelConfig.from_path(path)
    assert mc.linear_layers == tuple(i for i, t in enumerate(hf.config.layer_types) if t == "linear_attention")
    assert mc.attn_output_gate and mc.zero_centered_norms and mc.norm_offset == 1.0
    assert mc.rotary_dim == mc.head_dim // 4
    # one KV group of the attending layer alone: the linear layers keep no KV
    groups = mc.kv_groups
    assert groups.group_size == mc.num_hidden_layers - len(mc.linear_layers) == 1
    assert [mc.attention_index(i) for i in range(mc.num_hidden_layers)] == \
        [None if t == "linear_attention" else 0 for t in hf.config.layer_types]
    if mc.architecture != "Qwen3_5ForCausalLM":       # experts (Qwen3-Next's from the second layer on), gated shared
        assert mc.moe_layers == ((1, 2, 3) if mc.architecture == "Qwen3NextForCausalLM" else (0, 1, 2, 3))
        assert mc.shared_expert_intermediate_size == 48 and mc.norm_topk_prob


def test_the_chunked_rule_equals_the_recurrence():
    """The chunked form (prefill) over several chunks, from a nonzero state, against one token at a time."""
    g = torch.Generator().manual_seed(0)
    H, L, dk, dv = 3, 2 * CHUNK + 9, 8, 5
    q, k = (torch.nn.functional.normalize(torch.randn(H, L, dk, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(H, L, dv, generator=g)
    decay = -torch.rand(H, L, generator=g)
    beta = torch.rand(H, L, generator=g)
    state = torch.randn(H, dk, dv, generator=g)
    out, last = chunked_delta_rule(q, k, v, decay, beta, state)
    s, steps = state.unsqueeze(0), []
    for t in range(L):
        o, s = recurrent_step(q[None, :, t], k[None, :, t], v[None, :, t], decay[None, :, t], beta[None, :, t], s)
        steps.append(o[0])
    torch.testing.assert_close(out, torch.stack(steps, dim=1), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(last, s[0], rtol=1e-4, atol=1e-5)


def _plan(name: str):
    if name == "triton":
        from tokenmill.executor.ops.triton import TritonOps
        return TritonOps(torch.float32)
    return ReferenceOps() if name == "reference" else CpuKernelOps(load(name), torch.float32)


@pytest.mark.parametrize("plan", ["reference", *runnable_variants(), "triton"])
@pytest.mark.parametrize("dk,dv", [(8, 5), (128, 128), (40, 72)])
def test_every_plan_steps_the_rule_as_the_recurrence(plan, dk, dv):
    """A decode's step (ops.delta_rule_step) through each plan (the CPU kernels of each variant this machine runs,
    Triton under the interpreter) against recurrent_step: rows in slots out of order, the other slots untouched."""
    g = torch.Generator().manual_seed(dk + dv)
    B, H, slots = 3, 4, 6
    q, k = (torch.nn.functional.normalize(torch.randn(B, H, dk, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(B, H, dv, generator=g)
    decay, beta = -torch.rand(B, H, generator=g), torch.rand(B, H, generator=g)
    state = torch.randn(slots, H, dk, dv, generator=g)
    at = torch.tensor([4, 0, 2])
    want_out, want_state = recurrent_step(q, k, v, decay, beta, state[at])
    got = state.clone()
    out = _plan(plan).delta_rule_step(q, k, v, decay, beta, got, at)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[at], want_state, rtol=1e-5, atol=1e-5)
    untouched = [i for i in range(slots) if i not in at.tolist()]
    assert torch.equal(got[untouched], state[untouched])


def test_mixed_batch_gives_transformers_tokens_and_logprobs(qwen3_5):
    """Prompts across the chunk size, a one-token one, decoding together; Qwen3.5 through every attention backend
    and kernel plan (the linear layers' own path is the same in each)."""
    path, hf = qwen3_5
    plans = [{}]
    if hf.config.architectures[0] == "Qwen3_5ForCausalLM":
        plans += [{"attention_backend": "batched"}, {"attention_backend": "torch", "cpu_kernels": "reference"}]
    prompts = random_prompts([5, 33, CHUNK + 6, 1, 12], seed=3)
    want = [hf_greedy(hf, p, 16) for p in prompts]
    for plan in plans:
        llm = LLM(path, **ENGINE, **plan)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1), use_tqdm=False)
        for p, o, w in zip(prompts, outs, want):
            toks = o.outputs[0].token_ids
            assert toks == w, (plan, len(p))
            got = torch.tensor([lp[t].logprob for t, lp in zip(toks, o.outputs[0].logprobs)])
            torch.testing.assert_close(got, hf_logprobs(hf, p, toks), rtol=0, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("pressure", list(PRESSURE))
def test_greedy_under_pressure(qwen3_5, pressure):
    """Chunks of 16 carry the state from one to the next; a preempted request recomputes from a fresh state."""
    check_under_pressure(*qwen3_5, ENGINE, pressure)


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [None, 16])
def test_ngram_speculation_rolls_the_state_back(qwen3_5, chunk):
    """Guesses verified a row each: the state after the last accepted row is restored, so rejected guesses leave
    nothing behind; prompts that repeat themselves make guesses that stand as well as ones that fall."""
    path, hf = qwen3_5
    kw = {} if chunk is None else {"max_num_batched_tokens": chunk}
    llm = LLM(path, **ENGINE, **kw, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                         "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    base = random_prompts([6, 11], seed=8)
    prompts = [b * 4 for b in base] + random_prompts([23], seed=9)
    assert greedy(llm, prompts, 48) == [hf_greedy(hf, p, 48) for p in prompts]
    st = llm.llm_engine.stats
    assert st.spec_num_draft_tokens > st.spec_num_accepted_tokens > 0


@pytest.mark.parametrize("kind,plan", [
    ("qwen3_5", {"attention_backend": "padded", "cpu_kernels": "reference"}),
    pytest.param("qwen3_next", {"attention_backend": "triton", "cpu_kernels": "triton"}, marks=pytest.mark.slow)])
def test_the_gpu_runner_steps_them_eagerly(kind, plan, tmp_path, caplog):
    """The GPU's runner (here its CPU stand-in, and the Triton plan with its fused MoE under the interpreter) with
    graphs asked for: they are turned off, saying why, and chunked prompts and decodes give transformers' tokens."""
    from tokenmill.executor.gpu_runner import GpuRunner
    path, hf = build_tiny(kind, tmp_path)
    with caplog.at_level("WARNING", logger="tokenmill"):
        llm = LLM(path, **ENGINE, **plan, max_num_batched_tokens=16, max_num_seqs=4,
                  compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2, 4]})
    runner = llm.llm_engine.runner
    assert isinstance(runner, GpuRunner) and not runner.graphs
    assert "linear-attention layers take each step's requests and state slots from the host" in caplog.text
    # the start-up steps a GPU runs (profiling, compiling): more decode entries than slots, and a prompt; what they
    # leave in the slots is not read by a request, whose first step starts afresh
    assert runner.max_rows > runner.linear_states.conv.shape[1]
    for entries in ([1] * runner.max_rows, [runner.max_rows], [1] * 3):
        runner._dummy_step(entries)
    prompts = random_prompts([21, 4, 9], seed=2)
    assert greedy(llm, prompts, 10) == [hf_greedy(hf, p, 10) for p in prompts]
    with pytest.raises(ValueError, match=f"async_scheduling=True with {hf.config.architectures[0]}'s linear"):
        LLM(path, **ENGINE, **plan, async_scheduling=True)


@pytest.mark.slow
def test_slots_go_back_and_are_reused(qwen3_5):
    """More requests than slots over the engine's life: each finished one's slot serves a later one, starting
    afresh."""
    path, hf = qwen3_5
    llm = LLM(path, **ENGINE, max_num_seqs=2)
    states = llm.llm_engine.runner.linear_states
    assert states.conv.shape[1] == states.rec.shape[1] == 2
    prompts = random_prompts([20, 7, 41, 3, 15], seed=6)
    assert greedy(llm, prompts, 10) == [hf_greedy(hf, p, 10) for p in prompts]
    # (a finished request's slot goes back on the next step, when the runner hears of it)
    assert len(states.slot_of) <= 1 and sorted(states.free_slots + list(states.slot_of.values())) == [0, 1]
    # the same prompt again, alone: nothing of the earlier requests' states leaks in
    assert greedy(llm, prompts[:1], 10) == [hf_greedy(hf, prompts[0], 10)]


@pytest.mark.slow
@torch.no_grad()
def test_bfloat16_agrees_to_rounding(qwen3_5):
    """bfloat16 against transformers in bfloat16 (the states' recurrence in float32 in both): up to the first
    divergence the tokens agree, and a divergence is a tie within rounding: each side's token is among the other's
    top 5."""
    import copy
    path, hf = qwen3_5
    hf16 = copy.deepcopy(hf).to(torch.bfloat16)
    llm = LLM(path, **{**ENGINE, "dtype": "bfloat16"})
    prompts = random_prompts([9, 30, 70], seed=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5), use_tqdm=False)
    for p, o in zip(prompts, outs):
        want = hf16.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                             pad_token_id=0, output_scores=True, return_dict_in_generate=True,
                             attention_mask=torch.ones(1, len(p), dtype=torch.long))
        toks = o.outputs[0].token_ids
        for j, (a, b) in enumerate(zip(toks, want.sequences[0, len(p):].tolist())):
            if a != b:
                assert a in want.scores[j][0].float().topk(5).indices.tolist() and b in o.outputs[0].logprobs[j], \
                    (len(p), j, a, b)
                break


def test_what_the_state_cannot_do_yet_is_refused(qwen3_5):
    path, hf = qwen3_5
    arch = hf.config.architectures[0]
    with pytest.raises(ValueError, match=f"speculative decoding by 'draft_model' with {arch}'s linear-attention"):
        LLM(path, **ENGINE, speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=f"LoRA adapters on {arch}'s linear-attention layers"):
        LLM(path, **ENGINE, enable_lora=True)
    with pytest.raises(ValueError, match="tensor_parallel_size > 1 splits"):
        LLM(path, **ENGINE, tensor_parallel_size=2)
    with pytest.raises(ValueError, match=f"KV offload tiers and kv_transfer_config with {arch}'s linear"):
        LLM(path, **ENGINE, kv_offload_memory_gb=0.01)


def test_state_bytes_are_counted(qwen3_5):
    path, _ = qwen3_5
    mc = ModelConfig.from_path(path)
    llm = LLM(path, **ENGINE, max_num_seqs=3)
    states = llm.llm_engine.runner.linear_states
    assert states.nbytes == states.snapshot_nbytes == 3 * state_bytes_per_request(mc, torch.float32)
    assert "linear-attention states" in llm.llm_engine.kv_cache_info().describe()
    assert "of snapshots for the prefix cache (3)" in llm.llm_engine.kv_cache_info().describe()
    off = LLM(path, **ENGINE, max_num_seqs=3, enable_prefix_caching=False).llm_engine
    assert off.runner.linear_states.snapshot_nbytes == 0 and off.scheduler.snapshots is None


def _run(llm: LLM, prompts: list[list[int]], hf, n: int = 16) -> list[int]:
    """Each prompt's greedy tokens and logprobs checked against transformers'; how many tokens each found cached."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1), use_tqdm=False)
    for p, o in zip(prompts, outs):
        toks = o.outputs[0].token_ids
        assert toks == hf_greedy(hf, p, n), len(p)
        got = torch.tensor([lp[t].logprob for t, lp in zip(toks, o.outputs[0].logprobs)])
        torch.testing.assert_close(got, hf_logprobs(hf, p, toks), rtol=0, atol=1e-4)
    return [o.num_cached_tokens for o in outs]


@pytest.mark.parametrize("chunk", [None, 24])
def test_prefix_hits_resume_from_state_snapshots(qwen3_5, chunk):
    """A hit resumes from the state at the longest cached block boundary that has a snapshot: the same prompt again
    (the boundary before its last token, 32 of 40), a conversation's next turn (the last boundary the first turn's
    decode passed, 48), a prompt parting from a cached one mid-block (32). In chunks of 24 the boundary at 32 falls
    inside a chunk, which is parted there (and in a 48-token prompt, 24 to 48 holds two boundaries). Two requests for one prompt in one step: the second cannot load the
    snapshot that step is writing, so it computes everything (unchunked; chunked, it waits for the first)."""
    path, hf = qwen3_5
    llm = LLM(path, **ENGINE, **({} if chunk is None else {"max_num_batched_tokens": chunk}))
    a = random_prompts([40], seed=1)[0]
    cached = _run(llm, [a, a], hf)
    if chunk is None:
        assert cached == [0, 0]
    first = greedy(llm, [a], 16)[0]
    turn = a + first + random_prompts([7], seed=2)[0]
    parted = a[:37] + random_prompts([8], seed=3)[0]
    assert _run(llm, [a], hf) == [32]
    assert _run(llm, [turn], hf) == [48]
    assert _run(llm, [parted], hf) == [32]
    # a prompt of whole blocks keeps both its boundaries: before its last token (32), and its end (48) for a longer
    # prompt, though it decodes no further
    b = random_prompts([48], seed=4)[0]
    greedy(llm, [b], 1)
    assert _run(llm, [b + random_prompts([5], seed=5)[0], b], hf) == [48, 32]
    snaps = llm.llm_engine.scheduler.snapshots
    assert not snaps.pending and len(snaps.index) + len(snaps.free_slots) == ENGINE_SEQS
    llm.llm_engine.kv.check_integrity()


@pytest.mark.slow
def test_a_vision_language_checkpoint_serves_its_language_model(tmp_path):
    """Qwen3.5 is published as Qwen3_5ForConditionalGeneration: its text_config and its language model's weights
    (model.language_model.*) serve text alone, the vision tower's skipped; tokens equal transformers' generate on
    the whole model given text."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from tests.tiny_models import _configs
    torch.manual_seed(0)
    cfg = Qwen3_5Config(text_config=_configs()["qwen3_5"]().to_dict(),
                        vision_config=dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2,
                                           out_hidden_size=64))
    hf = Qwen3_5ForConditionalGeneration(cfg).eval()
    hf.save_pretrained(tmp_path)
    assert ModelConfig.from_path(str(tmp_path)).architecture == "Qwen3_5ForCausalLM"
    llm = LLM(str(tmp_path), **ENGINE)
    for p, got in zip(prompts := random_prompts([5, 40], seed=1), greedy(llm, prompts, 10)):
        with torch.no_grad():
            assert got == hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False)[0, len(p):].tolist()


def test_qwen3_next_regroups_rows_quantised_at_load(tmp_path):
    """Qwen3-Next's grouped projections are regrouped by picking rows, so a matrix quantised by rows at load is
    regrouped as it is: each row of the fused input projection is its float row to within one int8 step."""
    from tokenmill.executor.layers.quant import dequantize_rows
    path, _ = build_tiny("qwen3_next", tmp_path)
    exact = LLM(path, **ENGINE).llm_engine.model.layers[0].linear_attn.in_proj
    quant = LLM(path, **ENGINE, quantization="int8").llm_engine.model.layers[0].linear_attn.in_proj
    w = exact.weight if exact.weight is not None else exact.weight_t.t()
    step = w.abs().amax(dim=1, keepdim=True) / 127
    assert quant.quant is not None and ((dequantize_rows(quant.quant) - w).abs() <= step).all()


# ---- GGUF ----------------------------------------------------------------------------------------------------------
def _interval_model(kind: str, path) -> tuple[str, object]:
    """The tiny model with every second layer attending (full_attention_interval 2), as the published models place
    theirs at every fourth: a GGUF keeps the interval, not each layer's type. Value heads as wide as key heads, as in
    the published models and as llama.cpp assumes."""
    from transformers import AutoModelForCausalLM
    from tests.tiny_models import _configs
    torch.manual_seed(0)
    cfg = _configs()[kind]()
    cfg.full_attention_interval = 2
    cfg.linear_value_head_dim = cfg.linear_key_head_dim       # llama.cpp takes value heads as wide as key heads
    if kind == "qwen3_next":
        cfg.mlp_only_layers = []        # every MLP experts, as published (and as llama.cpp's qwen3next takes it)
    cfg.layer_types = ["full_attention" if (i + 1) % 2 == 0 else "linear_attention"
                       for i in range(cfg.num_hidden_layers)]
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.randn_like(p) * 0.2)
    hf.save_pretrained(path)
    return str(path), hf


def _tiled(x, key_heads: int, width: int):
    """Value heads (blocks of width along the first axis) from grouped order (key head by key head) into tiled."""
    import numpy as np
    n = x.shape[0] // width
    return np.ascontiguousarray(x.reshape(key_heads, n // key_heads, width, *x.shape[1:]).swapaxes(0, 1)
                                .reshape(x.shape))


def write_qwen3_5_gguf(hf_path: str, out, qtype=None) -> None:
    """As llama.cpp's converter writes Qwen3.5, Qwen3.5-MoE and Qwen3-Next (qwen35, qwen35moe, qwen3next): every
    norm but the linear layers' gated one as 1 + w; A_log as ssm_a = -exp(A_log), dt_bias as ssm_dt.bias, the
    convolution as [channels, kernel]; Qwen3-Next's q/k/v/z split into attn_qkv (every q, k, v) and attn_gate, its
    b/a kept grouped (ssm_ba); Qwen3.5's value heads reordered into tiled order; the ssm sizes and the attention
    interval in the metadata. Matrices in qtype where their rows are whole blocks (else F32)."""
    import json
    import gguf
    import numpy as np
    from safetensors.numpy import load_file
    from tests.family_checks import gguf_put, gguf_shape
    cfg = json.loads(open(f"{hf_path}/config.json").read())
    sd = load_file(f"{hf_path}/model.safetensors")
    arch = {"qwen3_5_text": "qwen35", "qwen3_5_moe_text": "qwen35moe", "qwen3_next": "qwen3next"}[cfg["model_type"]]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, r = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], nv // nk
    w = gguf.GGUFWriter(str(out), arch)
    gguf_shape(w, {**cfg, "intermediate_size": cfg.get("intermediate_size") or cfg["moe_intermediate_size"]},
               cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    rot = int(cfg["head_dim"] * cfg["rope_parameters"]["partial_rotary_factor"])
    w.add_rope_dimension_count(rot)
    if arch != "qwen3next":       # M-RoPE's sections, rotary pairs a position axis each (as Qwen3.5's 11, 11, 10)
        pairs = rot // 2
        w.add_rope_dimension_sections(cfg["rope_parameters"].get("mrope_section")
                                      or [(pairs + 2) // 3, (pairs + 1) // 3, pairs // 3, 0])
    w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    w.add_ssm_state_size(dk)
    w.add_ssm_group_count(nk)
    w.add_ssm_time_step_rank(nv)
    w.add_ssm_inner_size(nv * dv)
    w.add_full_attention_interval(cfg["full_attention_interval"])
    w.add_tokenizer_model("none")     # no vocabulary: token ids in, as llama.cpp takes a weights-only file
    w.add_vocab_size(cfg["vocab_size"])
    if cfg.get("num_experts"):
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    put_any = gguf_put(w)

    def put(name, x, q=None):         # rows that are not whole blocks stay F32, as llama.cpp's quantiser keeps them
        put_any(name, x, q if x.shape[-1] % 32 == 0 else None)
    tiled = (lambda x, width: _tiled(x, nk, width)) if arch != "qwen3next" and nk != nv else (lambda x, width: x)
    put("token_embd.weight", sd["model.embed_tokens.weight"])
    put("output.weight", sd["lm_head.weight"], qtype)
    put("output_norm.weight", sd["model.norm.weight"] + 1)
    for i in range(cfg["num_hidden_layers"]):
        h, b = f"model.layers.{i}.", f"blk.{i}."
        put(b + "attn_norm.weight", sd[h + "input_layernorm.weight"] + 1)
        put(b + "post_attention_norm.weight", sd[h + "post_attention_layernorm.weight"] + 1)
        if cfg["layer_types"][i] == "full_attention":
            for hf, g in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")):
                put(f"{b}{g}.weight", sd[f"{h}self_attn.{hf}.weight"], qtype)
            put(b + "attn_q_norm.weight", sd[h + "self_attn.q_norm.weight"] + 1)
            put(b + "attn_k_norm.weight", sd[h + "self_attn.k_norm.weight"] + 1)
        else:
            la = h + "linear_attn."
            if arch == "qwen3next":       # per key head: q, k, its value heads' v, then z
                g = sd[la + "in_proj_qkvz.weight"].reshape(nk, 2 * dk + 2 * r * dv, -1)
                q, k, v, z = np.split(g, [dk, 2 * dk, 2 * dk + r * dv], axis=1)
                qkv = np.concatenate([t.reshape(-1, g.shape[-1]) for t in (q, k, v)])
                put(b + "attn_gate.weight", z.reshape(-1, g.shape[-1]), qtype)
                put(b + "ssm_ba.weight", sd[la + "in_proj_ba.weight"], qtype)
            else:
                qkv = sd[la + "in_proj_qkv.weight"].copy()
                qkv[2 * nk * dk:] = tiled(qkv[2 * nk * dk:], dv)
                put(b + "attn_gate.weight", tiled(sd[la + "in_proj_z.weight"], dv), qtype)
                put(b + "ssm_beta.weight", tiled(sd[la + "in_proj_b.weight"], 1), qtype)
                put(b + "ssm_alpha.weight", tiled(sd[la + "in_proj_a.weight"], 1), qtype)
            put(b + "attn_qkv.weight", qkv, qtype)
            conv = sd[la + "conv1d.weight"][:, 0].copy()
            conv[2 * nk * dk:] = tiled(conv[2 * nk * dk:], dv)
            put(b + "ssm_conv1d.weight", conv)
            put(b + "ssm_a", -np.exp(tiled(sd[la + "A_log"], 1)))
            put(b + "ssm_dt.bias", tiled(sd[la + "dt_bias"], 1))
            put(b + "ssm_norm.weight", sd[la + "norm.weight"])
            put(b + "ssm_out.weight", tiled(sd[la + "out_proj.weight"].T, dv).T, qtype)
        if h + "mlp.gate.weight" in sd:
            m = h + "mlp."
            put(b + "ffn_gate_inp.weight", sd[m + "gate.weight"])
            for hf, g in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")):
                put(f"{b}{g}.weight", np.stack([sd[f"{m}experts.{e}.{hf}.weight"] for e in range(cfg["num_experts"])]),
                    qtype)
            for hf, g in (("gate_proj", "ffn_gate_shexp"), ("up_proj", "ffn_up_shexp"), ("down_proj", "ffn_down_shexp")):
                put(f"{b}{g}.weight", sd[f"{m}shared_expert.{hf}.weight"], qtype)
            put(b + "ffn_gate_inp_shexp.weight", sd[m + "shared_expert_gate.weight"][0])
        else:
            for hf, g in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
                put(f"{b}{g}.weight", sd[f"{h}mlp.{hf}.weight"], qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next", "qwen3_5_moe"])
def test_gguf_gives_transformers_tokens(kind, tmp_path):
    """A GGUF written as llama.cpp's converter writes the family (Qwen3.5's value heads reordered into tiled order)
    reads back as the HF folder's model: the same config fields, and transformers' greedy tokens; Q8_0 matrices stay
    in their blocks and give the tokens of their weights dequantised at load."""
    import gguf
    from tests.family_checks import check_blocks_equal_dequantised
    path, hf = _interval_model(kind, tmp_path / "hf")
    write_qwen3_5_gguf(path, tmp_path / "f32.gguf")
    llm = LLM(str(tmp_path / "f32.gguf"), **ENGINE, tokenizer=None)
    mc, want = llm.llm_engine.model_config, ModelConfig.from_path(path)
    for field in ("linear_layers", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                  "linear_value_head_dim", "linear_conv_kernel_dim", "rotary_dim", "moe_layers", "num_experts",
                  "shared_expert_intermediate_size", "norm_topk_prob", "attn_output_gate", "zero_centered_norms"):
        assert getattr(mc, field) == getattr(want, field), field
    assert mc.linear_value_heads_tiled == (kind != "qwen3_next")
    prompts = random_prompts([40, 9, CHUNK + 3], seed=2)
    assert greedy(llm, prompts, 16) == [hf_greedy(hf, p, 16) for p in prompts]
    write_qwen3_5_gguf(path, tmp_path / "q8.gguf", gguf.GGMLQuantizationType.Q8_0)
    blocks = check_blocks_equal_dequantised(str(tmp_path / "q8.gguf"), ENGINE)
    assert blocks.llm_engine.model.layers[0].linear_attn.in_proj.quant is not None


# run by the python that has llama_cpp: argv = token ids (json), a GGUF path; prints the logits of every position
_LLAMA_CPP_LOGITS = """
import json, sys
import numpy as np
from llama_cpp import Llama
ids = json.loads(sys.argv[1])
llm = Llama(model_path=sys.argv[2], n_ctx=64, n_threads=1, verbose=False, logits_all=True)
llm.eval(ids)
print(json.dumps(np.asarray(llm.scores[:len(ids)]).tolist()))
"""


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next", "qwen3_5_moe"])
def test_llama_cpp_reads_these_files_as_transformers_runs_the_model(kind, tmp_path):
    """The writer above is llama.cpp's layout, as llama.cpp itself reads it: the F32 file's logits in llama.cpp
    (llama-cpp-python, skipped where it is not installed) are transformers' on the HF folder, to its float16 KV
    cache's rounding, and its greedy picks are the same."""
    import json
    import subprocess
    import numpy as np
    from tests.test_quantize import _llama_cpp_python
    python = _llama_cpp_python()            # skips where llama.cpp is not installed
    path, hf = _interval_model(kind, tmp_path / "hf")
    write_qwen3_5_gguf(path, tmp_path / "f32.gguf")
    ids = random_prompts([12], seed=4)[0]
    proc = subprocess.run([python, "-c", _LLAMA_CPP_LOGITS, json.dumps(ids), str(tmp_path / "f32.gguf")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logits = np.asarray(json.loads(proc.stdout.strip().splitlines()[-1]))
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(logits - want).max() < 0.01 * max(1.0, np.abs(want).max())
    assert (logits.argmax(-1) == want.argmax(-1)).all()


def test_a_failed_step_leaves_no_snapshot_behind(tmp_path):
    """A step that raises (the server fails its requests and serves on) planned a snapshot it never wrote: the
    next step drops it, so a later prefix hit cannot resume from an unwritten slot, and its slot goes back."""
    path, hf = build_tiny("qwen3_5", tmp_path)
    llm = LLM(path, **ENGINE)
    eng = llm.llm_engine
    base = random_prompts([40], seed=1)[0]
    greedy(llm, [base], 8)                           # blocks 0 and 1 cached; a snapshot at 32 only
    snaps = eng.scheduler.snapshots
    free = len(snaps.free_slots)
    run = eng.runner.execute

    def fails_once(*args, **kwargs):
        eng.runner.execute = run
        raise RuntimeError("a step that failed")
    eng.runner.execute = fails_once
    with pytest.raises(RuntimeError, match="a step that failed"):
        greedy(llm, [base[:16] + random_prompts([4], seed=2)[0]], 8)     # it planned a snapshot at 16
    assert greedy(llm, random_prompts([5], seed=9), 8)                   # a good step: nothing of it indexed
    assert not snaps.pending and len(snaps.free_slots) == free
    parted = base[:16] + random_prompts([8], seed=3)[0]
    assert _run(llm, [parted], hf) == [0]            # the hit at 16 has no snapshot: computed afresh, as transformers
