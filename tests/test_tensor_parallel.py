"""Tensor parallelism on CPU: two ranks (this process and one worker process, gloo on loopback), each holding half
the heads, half the MLP (or of every expert) and half the vocabulary, give transformers' greedy tokens, as one rank
does, in every family; a GGUF's quantised blocks are split as they are, and give one rank's tokens."""
from __future__ import annotations

import pytest

from tests.family_checks import check_under_pressure, greedy
from tests.tiny_models import build_tiny, hf_greedy, random_prompts
from tokenmill import LLM

ENGINE = dict(dtype="float32", kv_cache_memory_gb=0.02, max_model_len=512, tensor_parallel_size=2)


def test_two_ranks_give_transformers_tokens(tiny_llama):
    """A mixed batch with its prompts in chunks of 16 beside decodes, then prompts that hit the cached prefix."""
    path, hf = tiny_llama
    llm = LLM(path, **ENGINE, max_num_batched_tokens=16)
    assert llm.llm_engine.runner.workers[0].is_alive()
    prompts = random_prompts([5, 33, 70, 12, 1], seed=11)
    assert greedy(llm, prompts, 16) == [hf_greedy(hf, p, 16) for p in prompts]
    longer = [prompts[2] + random_prompts([n], seed=n)[0] for n in (3, 9)]
    outs = llm.generate([{"prompt_token_ids": p} for p in longer], None, use_tqdm=False)
    assert all(o.num_cached_tokens >= 64 for o in outs)
    assert greedy(llm, longer, 16) == [hf_greedy(hf, p, 16) for p in longer]


def test_collectives_per_step_are_the_formula(tiny_llama):
    """A prefill of 20 rows then two decodes of one: 2 all-reduces a layer and one for the embeddings, of float32
    rows of hidden, and one gather of the sampled row's half of the vocabulary, each step."""
    from tokenmill import SamplingParams
    from tokenmill.executor.parallel import collectives_per_step
    path, hf = tiny_llama
    c = hf.config
    llm = LLM(path, **ENGINE)
    group = llm.llm_engine.runner.group
    eng = llm.llm_engine
    eng.add_request("r", {"prompt_token_ids": random_prompts([20], seed=2)[0]},
                    SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    for tokens in (20, 1, 1):
        before = {k: getattr(group, k) for k in ("all_reduces", "all_reduce_bytes", "gathers", "gather_bytes")}
        eng.step()
        after = {k: getattr(group, k) - v for k, v in before.items()}
        assert after == collectives_per_step(c.num_hidden_layers, c.hidden_size, c.vocab_size, 2, tokens, 1)


@pytest.mark.slow
def test_preempted(tiny_llama):
    check_under_pressure(*tiny_llama, ENGINE, "preempted")


def test_one_kv_head_over_two_ranks_and_a_tied_head(tmp_path):
    """One kv head: both ranks hold it; the tied embeddings are split by vocabulary for the lookup and the head."""
    path, hf = build_tiny("llama_mqa_tied", tmp_path)
    llm = LLM(path, **ENGINE)
    prompts = random_prompts([9, 40], seed=3)
    assert greedy(llm, prompts, 16) == [hf_greedy(hf, p, 16) for p in prompts]


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "mistral_sw", "gemma2", "gemma3", "phi3", "mixtral", "qwen2_moe",
                                  "deepseek_v3", "gpt_oss"])
def test_the_other_families(kind, tmp_path):
    """Two ranks give transformers' tokens, with one all-reduce for the embeddings and two a layer in a step.
    Qwen2: q/k/v biases split with their rows; Qwen3: per-head q/k norms whole; Mistral: its window; Gemma 2/3:
    whole norms and soft caps, local layers' windows (shorter than the prompt) in their own KV group; Phi-3: its
    fused qkv_proj and gate_up_proj split part by part; Mixture-of-Experts: each expert's intermediate split, the
    router whole, one all-reduce after the experts and Qwen2-MoE's gated shared expert (Qwen3-MoE's layers are
    these without it); DeepSeek-V3: q_b_proj and kv_b_proj by heads, the latent whole on each rank, sigmoid routing
    with its bias; gpt-oss: each rank's heads' sinks, its share of every stacked expert (gate and up interleaved),
    down's biases added once."""
    path, hf = build_tiny(kind, tmp_path)
    llm = LLM(path, **ENGINE)
    prompts = random_prompts([7, 40], seed=5)
    assert greedy(llm, prompts, 12) == [hf_greedy(hf, p, 12) for p in prompts]
    group = llm.llm_engine.runner.group
    before = group.all_reduces
    greedy(llm, prompts[:1], 1)                 # an expert or a latent attention that all-reduced on its own fails
    assert group.all_reduces - before == 2 * hf.config.num_hidden_layers + 1


def test_a_dead_worker_is_an_error_not_a_hang(tiny_llama):
    llm = LLM(tiny_llama[0], **ENGINE)
    llm.llm_engine.runner.workers[0].kill()
    llm.llm_engine.runner.workers[0].join()
    with pytest.raises(RuntimeError, match="Connection closed by peer|Connection reset|Broken pipe"):
        greedy(llm, random_prompts([5], seed=1), 4)


def test_a_dead_worker_stops_the_server_engine(tiny_llama):
    """Under the server's AsyncLLM: the request in flight fails, the engine reports itself dead (the server's
    health and every later request answer 503 with this error) and nothing hangs."""
    import asyncio
    from tokenmill import SamplingParams
    from tokenmill.engine.async_engine import AsyncLLM, EngineDeadError
    llm = AsyncLLM.from_engine_args(tiny_llama[0], **ENGINE)

    async def one() -> None:
        stream = await llm.add_request({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4))
        async for _ in stream:
            pass
    asyncio.run(one())                               # both ranks serve
    worker = llm.engine.runner.workers[0]
    worker.kill()
    worker.join()
    with pytest.raises(EngineDeadError):
        asyncio.run(one())
    llm._thread.join(timeout=30)
    assert not llm.is_running and "a tensor-parallel worker process died" in llm.error
    with pytest.raises(EngineDeadError, match="a tensor-parallel worker process died"):
        asyncio.run(one())


def test_what_cannot_split_is_refused(tiny_llama, tmp_path):
    import os
    path = tiny_llama[0]             # 6 heads, 2 kv heads, intermediate 80, vocabulary 320
    with pytest.raises(ValueError, match=f"tensor_parallel_size={os.cpu_count() + 1} exceeds the {os.cpu_count()} "
                                         f"cores here"):
        LLM(path, **{**ENGINE, "tensor_parallel_size": os.cpu_count() + 1})
    if os.cpu_count() >= 4:
        with pytest.raises(ValueError, match=r"tensor_parallel_size=4 does not divide attention heads \(6\)"):
            LLM(path, **{**ENGINE, "tensor_parallel_size": 4})
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1, got 0"):
        LLM(path, **{**ENGINE, "tensor_parallel_size": 0})
    import dataclasses
    import torch
    from tokenmill.config import ModelConfig
    from tokenmill.executor.parallel import check_tensor_parallel
    other = dataclasses.replace(ModelConfig.from_path(path), architecture="FalconForCausalLM")    # a family to come
    with pytest.raises(ValueError, match="splits LlamaForCausalLM, .* so far, not FalconForCausalLM"):
        check_tensor_parallel(other, 2, torch.device("cpu"), path, True)


RANK0 = """
import json, sys
from tokenmill import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(sys.argv[1], dtype="float32", kv_cache_memory_gb=0.02, max_model_len=512, tensor_parallel_size=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in json.loads(sys.argv[2])],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    print("TOKENS", json.dumps([o.outputs[0].token_ids for o in outs]))
"""


@pytest.mark.slow
def test_two_torchrun_nodes_on_loopback(tiny_llama, tmp_path):
    """Two torchrun invocations joining one rendezvous, as two machines would (docs/parallelism.md): node 0
    runs the engine, node 1 `python -m tokenmill.executor.parallel`; the tokens are transformers'."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    from tokenmill.executor.parallel import free_port
    path, hf = tiny_llama
    prompts = random_prompts([5, 33, 12], seed=21)
    (tmp_path / "rank0.py").write_text(RANK0)
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--nnodes", "2", "--nproc-per-node", "1",
                "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    node1 = subprocess.Popen([*torchrun, "--node-rank", "1", "-m", "tokenmill.executor.parallel"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        node0 = subprocess.run([*torchrun, "--node-rank", "0", str(tmp_path / "rank0.py"), path, json.dumps(prompts)],
                               capture_output=True, text=True, timeout=120)
        assert node0.returncode == 0, node0.stderr[-3000:]
        assert node1.wait(timeout=30) == 0, node1.stdout.read()[-3000:]
    finally:
        node1.kill()
    got = json.loads(next(line for line in node0.stdout.splitlines() if line.startswith("TOKENS"))[7:])
    assert got == [hf_greedy(hf, p, 12) for p in prompts]


# ---- GGUF: matrices split in their blocks ----------------------------------------------------------------------------
GGUF_ENGINE = {**ENGINE, "max_model_len": 256, "tokenizer": None}


@pytest.fixture(scope="module")
def llama_mqa(tmp_path_factory):
    """A tiny Llama with one kv head and tied embeddings whose every split is whole blocks of 32 (o_proj's 64 input
    columns and down_proj's 128 are 32 and 64 a rank)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=1, tie_word_embeddings=True, max_position_embeddings=256,
                      initializer_range=0.1, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    hf = LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("llama_mqa")
    hf.save_pretrained(path)
    return str(path), hf


def write_llama_gguf(hf, out, f16: tuple[str, ...]) -> None:
    """The HF Llama hf as llama.cpp's converter writes it (q/k rows interleaved per head), the GGUF tensor kinds in
    f16 as F16 and the rest F32; hf's weights of those kinds are rounded to float16 in place, as the file keeps
    them."""
    import gguf
    import numpy as np
    import torch
    from tests.test_gguf import _permute, add_shape
    c = hf.config
    w = gguf.GGUFWriter(str(out), "llama")
    add_shape(w, dict(layers=c.num_hidden_layers, hidden=c.hidden_size, ffn=c.intermediate_size,
                      heads=c.num_attention_heads, kv_heads=c.num_key_value_heads), c.rms_norm_eps, 10000.0)

    def put(name: str, p: torch.nn.Parameter, heads: int = 0) -> None:
        if name.split(".")[-2] in f16:
            p.data = p.data.half().float()
        x = p.detach().numpy()
        x = _permute(x, heads) if heads else x
        w.add_tensor(name, x.astype(np.float16 if name.split(".")[-2] in f16 else np.float32))
    put("token_embd.weight", hf.model.embed_tokens.weight)
    for i, layer in enumerate(hf.model.layers):
        a, m = layer.self_attn, layer.mlp
        for name, p, heads in (("attn_norm", layer.input_layernorm.weight, 0),
                               ("attn_q", a.q_proj.weight, c.num_attention_heads),
                               ("attn_k", a.k_proj.weight, c.num_key_value_heads), ("attn_v", a.v_proj.weight, 0),
                               ("attn_output", a.o_proj.weight, 0), ("ffn_norm", layer.post_attention_layernorm.weight, 0),
                               ("ffn_gate", m.gate_proj.weight, 0), ("ffn_up", m.up_proj.weight, 0),
                               ("ffn_down", m.down_proj.weight, 0)):
            put(f"blk.{i}.{name}.weight", p, heads)
    put("output_norm.weight", hf.model.norm.weight)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_float_gguf_over_two_ranks_gives_transformers_tokens(llama_mqa, tmp_path):
    """F16 and F32 matrices, q/k unpermuted before the split, one kv head held by both ranks, a tied head."""
    from tokenmill.executor.layers.quant import GGMLWeight
    _, hf = llama_mqa
    write_llama_gguf(hf, tmp_path / "f16.gguf", f16=("token_embd", "attn_q", "attn_k", "attn_output", "ffn_up"))
    llm = LLM(str(tmp_path / "f16.gguf"), **GGUF_ENGINE)
    o_proj = llm.llm_engine.model.layers[0].self_attn.o_proj
    assert isinstance(o_proj.quant, GGMLWeight) and o_proj.quant.shape == (64, 32)     # its F16 columns, halved
    prompts = random_prompts([9, 40], seed=3)
    assert greedy(llm, prompts, 12) == [hf_greedy(hf, p, 12) for p in prompts]


def test_quantization_at_load_quantises_each_share(llama_mqa):
    """quantization='int8' over two ranks: each rank quantises its share of the float checkpoint, the same Q8_0
    blocks as one rank's (every split here falls on a block boundary), so the same tokens."""
    from tokenmill.executor.layers.quant import PackedWeight
    path, _ = llama_mqa
    two = LLM(path, **GGUF_ENGINE, quantization="int8")
    down = two.llm_engine.model.layers[0].mlp.down_proj
    assert isinstance(down.quant, PackedWeight) and down.quant.shape == (64, 64)
    prompts = random_prompts([5, 33], seed=8)
    got = greedy(two, prompts, 12)
    del two
    one = LLM(path, **{**GGUF_ENGINE, "tensor_parallel_size": 1}, quantization="int8")
    assert got == greedy(one, prompts, 12)


QUANT_MIX = dict(embd="Q8_0", q="Q8_0", k="Q4_K", v="Q6_K", o="Q4_0", gate="Q4_K", up="F16", down="Q4_K", out="Q6_K")


def test_quantised_gguf_blocks_split_as_one_rank_reads_them(tmp_path):
    """Q8_0, Q4_0, K-quant and F16 blocks split by rows and by columns (o_proj's Q4_0 and down_proj's Q4_K at a
    block boundary): each rank holds its slice of the file's blocks, and two ranks give one rank's tokens."""
    from tests.test_gblocks import write_model
    from tokenmill.executor.layers.quant import GGMLWeight, PackedWeight
    write_model(tmp_path / "q.gguf", QUANT_MIX)         # hidden 256, 4 heads of 64, 2 kv heads, MLP 512, vocab 64
    two = LLM(str(tmp_path / "q.gguf"), **GGUF_ENGINE)
    layer = two.llm_engine.model.layers[0]
    assert isinstance(layer.self_attn.o_proj.quant, PackedWeight) and layer.self_attn.o_proj.quant.shape == (256, 128)
    assert isinstance(layer.mlp.down_proj.quant, GGMLWeight) and layer.mlp.down_proj.quant.shape == (256, 256)
    prompts = random_prompts([3, 30], seed=7)
    prompts = [[t % 64 for t in p] for p in prompts]
    got = greedy(two, prompts, 12)
    del two
    one = LLM(str(tmp_path / "q.gguf"), **{**GGUF_ENGINE, "tensor_parallel_size": 1})
    assert got == greedy(one, prompts, 12)


def test_a_split_that_cuts_a_block_is_refused(tmp_path):
    """Q4_K's blocks are 256 weights: o_proj's 256 input columns cannot be 128 a rank. Refused from the file's
    header, before any worker starts."""
    from tests.test_gblocks import MIXES, write_model
    write_model(tmp_path / "k.gguf", MIXES["q4_k_m"])
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 would cut the quantised blocks of "
                                         r"model\.layers\.0\.self_attn\.o_proj\.weight \(Q4_K\): its 256 input "
                                         r"columns would be 128 a rank, not a multiple of its blocks of 256"):
        LLM(str(tmp_path / "k.gguf"), **GGUF_ENGINE)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "F16"])
def test_block_slices_are_slices_of_the_weights(type_name):
    """Rows (a fused projection's ranges) and block-aligned columns of a quantised weight, sliced in its blocks,
    dequantise to the same slices of the dequantised weight; a column split that cuts a block is refused."""
    import numpy as np
    import torch
    from tests.test_gblocks import random_blocks
    from tokenmill.config import ModelConfig
    from tokenmill.executor.layers.quant import GGMLWeight, ggml_block, pack_ggml
    from tokenmill.executor.parallel import shard_tensor
    n, k = 8, 512                               # 8 rows: a fused qkv of 4 q, 2 k and 2 v heads
    raw = random_blocks(type_name, n, k, np.random.default_rng(1))
    w = pack_ggml(type_name, raw, (n, k)) or GGMLWeight(type_name, torch.from_numpy(raw), (n, k))
    assert isinstance(w, GGMLWeight) == (type_name in ("Q4_K", "F16"))
    whole = w.dequantize()
    mc = ModelConfig("LlamaForCausalLM", vocab_size=64, hidden_size=k, intermediate_size=k, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=1, rms_norm_eps=1e-6,
                     rope_theta=1e4)             # head_dim 1: a row is a head
    for rank in (0, 1):
        rows = shard_tensor("model.layers.0.self_attn.qkv_proj.weight", w, mc, rank, 2)   # 4 q, 2 k, 2 v rows
        want = torch.cat([whole[2 * rank:2 * rank + 2], whole[4 + rank:5 + rank], whole[6 + rank:7 + rank]])
        assert torch.equal(rows.dequantize(), want)
        cols = shard_tensor("model.layers.0.mlp.down_proj.weight", w, mc, rank, 2)
        assert torch.equal(cols.dequantize(), whole[:, rank * 256:(rank + 1) * 256])
    for rank, head in enumerate((0, 0, 1, 1)):      # 2 kv heads over 4 ranks: each rank reads its query heads' one
        assert torch.equal(shard_tensor("model.layers.0.self_attn.k_proj.weight", w, mc, rank, 4).dequantize(),
                           whole[head:head + 1])
    block = ggml_block(type_name)[0]
    if block > 1:
        with pytest.raises(ValueError, match=f"its {k} input columns would be {k // 32} a rank, not a multiple of "
                                             f"its blocks of {32 if block == 32 else 256}"):
            shard_tensor("model.layers.0.mlp.down_proj.weight", w, mc, 0, 32)
