"""What every model family added beside the first four shows against transformers: greedy tokens under chunked
prefill, preemption and prefix-cache hits, and a quantised GGUF's blocks against the same weights dequantised."""
from __future__ import annotations

from tests.tiny_models import hf_greedy, random_prompts
from tokenmill import LLM, SamplingParams

# chunked: prompts in chunks of 16 beside decodes; preempted: a pool with room for about two requests
PRESSURE = {"chunked": dict(max_num_batched_tokens=16), "preempted": dict(kv_blocks=14, max_model_len=128)}


def greedy(llm: LLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def check_greedy(path: str, hf, engine: dict, lengths: list[int], n: int = 12, seed: int = 2) -> None:
    """Random prompts of these lengths give transformers' greedy tokens."""
    prompts = random_prompts(lengths, seed=seed)
    assert greedy(LLM(path, **engine), prompts, n) == [hf_greedy(hf, p, n) for p in prompts]


def check_past_the_window(path: str, hf, engine: dict, backend: str) -> None:
    """Prompts of up to 4x a window of 16, and 30 tokens each, in one batch, through the attention backend named
    ('auto' is the CPU kernels')."""
    llm = LLM(path, **engine, attention_backend=backend)
    assert llm.llm_engine.runner.backend.name == ("cpu" if backend == "auto" else backend)
    prompts = random_prompts([60, 10, 45, 17, 33], seed=2)
    for p, got in zip(prompts, greedy(llm, prompts, 30)):
        assert got == hf_greedy(hf, p, 30), len(p)


def check_under_pressure(path: str, hf, engine: dict, pressure: str) -> None:
    kw = {**engine, **PRESSURE[pressure]}
    if kw.pop("kv_blocks", None):        # room for about two of the requests below at their longest
        eng = LLM(path, **engine).llm_engine
        kw["kv_cache_memory_gb"] = 2.2 * eng.kv.blocks_needed(100) * eng.kv_bytes_per_block() / 2 ** 30
    llm = LLM(path, **kw)
    prompts = random_prompts([37, 5, 60, 22, 48, 9], seed=4)
    for p, got in zip(prompts, greedy(llm, prompts, 40)):
        assert got == hf_greedy(hf, p, 40), len(p)
    if pressure == "preempted":
        assert llm.llm_engine.stats.num_preemptions > 0
    llm.llm_engine.kv.check_integrity()


def check_prefix_hits(path: str, hf, engine: dict) -> None:
    """Two prompts extending a cached 48-token one: both hit its blocks and give transformers' tokens."""
    base = random_prompts([48], seed=6)[0]
    prompts = [base + random_prompts([n], seed=7 + n)[0] for n in (3, 11)]
    llm = LLM(path, **engine)
    greedy(llm, [base], 1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.num_cached_tokens >= 32 and o.outputs[0].token_ids == hf_greedy(hf, p, 20)


def check_blocks_equal_dequantised(gguf_path: str, engine: dict) -> LLM:
    """A quantised GGUF read from its blocks gives the tokens of its weights dequantised at load; returns the
    blocks' engine for the caller to inspect."""
    blocks = LLM(gguf_path, **engine, tokenizer=None, int8_activations=False)   # the float route: exact
    plain = LLM(gguf_path, **engine, tokenizer=None, quantized_kernels=False)
    prompts = random_prompts([9, 33, 4], seed=9)
    assert greedy(blocks, prompts, 16) == greedy(plain, prompts, 16)
    return blocks


def gguf_shape(w, cfg: dict, kv_heads: int) -> None:
    """The shape keys every GGUF architecture has, from the HF config dict cfg, on the gguf.GGUFWriter w."""
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base((cfg.get("rope_parameters") or {}).get("rope_theta") or cfg.get("rope_theta"))


def gguf_put(w):
    """put(name, x, qtype=None) adding x to the gguf.GGUFWriter w: float32, or quantised to qtype (a
    gguf.GGMLQuantizationType)."""
    import gguf
    import numpy as np

    def put(name: str, x, qtype=None) -> None:
        x = np.ascontiguousarray(x, dtype=np.float32)
        w.add_tensor(name, x if qtype is None else gguf.quants.quantize(x, qtype), raw_dtype=qtype)
    return put


def check_one_call_layer(llm: LLM, prompts: list, max_tokens: int, tol: float) -> None:
    """Every layer of llm takes the CPU plan's one-call decode layer; with it and without it (the same kernels
    called op by op from Python) the greedy tokens are equal and their logprobs within tol."""
    ops = llm.llm_engine.model.ops
    assert len(ops._layers) == len(llm.llm_engine.model.layers)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    fused = llm.generate(prompts, sp, use_tqdm=False)
    layers = dict(ops._layers)
    ops._layers.clear()
    plain = llm.generate(prompts, sp, use_tqdm=False)
    ops._layers.update(layers)
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            (ta, pa), = la.items()
            (tb, pb), = lb.items()
            assert ta == tb and abs(pa.logprob - pb.logprob) <= tol
