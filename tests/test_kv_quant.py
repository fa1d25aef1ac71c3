"""A quantised KV cache (kv_cache_dtype="int8", "int4", "fp8_e4m3", "fp8_e5m2") cannot be token-exact, so its
error is bounded: against the float cache, over 256-token greedy continuations of 16 prompts, scored with the same
prefixes (tokenmill.bench.kvquality).
Kernel-level equality (attention over an int8 cache = attention over its dequantised values) is in
test_attention_backends.py."""
import pytest

from tests.tiny_models import build_tiny, random_prompts
from tokenmill.bench.kvquality import compare, kv_quality


def test_compare_counts_what_it_says() -> None:
    want = [[{1: -0.1, 2: -2.0}, {3: -0.5, 4: -0.6}, {5: -0.2, 6: -3.0}]]
    got = [[{1: -0.3, 2: -1.5}, {4: -0.4, 3: -0.7}, {7: -0.1, 5: -4.0}]]
    q = compare("int8", want, got, [0])
    assert (q.positions, q.agree, q.disagree_in_top5) == (3, 1, 1)
    assert q.max_logprob_gap == pytest.approx(0.2) and q.max_disagree_margin == float("inf")
    assert compare("int8", want, got, [1]).positions == 2        # positions before the continuation are not counted


# (tiny model, cache dtype, least agreement, largest float-cache margin at a disagreement, largest agreed gap).
# Random tiny models put their top tokens within hundredths of a nat of each other, so some near-ties flip. int8:
# at least 97% agree (BENCHMARKS.md: ~98%), every flip one the float cache barely prefers (< 0.1 nat), agreed
# logprobs move by < 0.1. fp8_e4m3 keeps 3 mantissa bits, so every value moves by up to 1/16 of itself (int8: 1/254
# of its head's largest) and it agrees less (BENCHMARKS.md: 94.6%, flips < 0.2 nat apart): held at 90% and 0.3.
TINY_BOUNDS = [("llama", "int8", 0.97, 0.1, 0.1), ("qwen2", "int8", 0.97, 0.1, 0.1),
               ("llama", "fp8_e4m3", 0.90, 0.3, 0.3)]


@pytest.mark.parametrize("name,dtype,agreement,margin,gap", TINY_BOUNDS, ids=[f"{n}-{d}" for n, d, *_ in TINY_BOUNDS])
def test_quantised_cache_bounded_on_tiny_models(tmp_path, name, dtype, agreement, margin, gap) -> None:
    """Every disagreement within each other's top-5, and the bounds above."""
    path, _ = build_tiny(name, tmp_path)
    prompts = random_prompts([8 + i for i in range(16)], seed=3)
    q = kv_quality(path, dtype, prompts, 256, dtype="float32", kv_cache_memory_gb=0.05)
    assert q.positions == 16 * 256
    assert q.agreement >= agreement
    assert q.disagree_in_top5 == q.positions - q.agree and q.max_disagree_margin < margin
    assert q.max_logprob_gap < gap


def test_int4_cache_bounded_on_a_tiny_model(tmp_path) -> None:
    """int4 (groups of 32) on a tiny random model with head_dim 256: a logprob moves by a twentieth of a nat on
    average (int8: a two-hundredth), so the near-ties flip far more often (BENCHMARKS.md: 81% agree); held at 75%,
    a mean gap under 0.1 and a largest under 0.5."""
    path, _ = build_tiny("head_dim256", tmp_path)
    prompts = random_prompts([8 + i for i in range(16)], seed=3)
    q = kv_quality(path, "int4", prompts, 256, dtype="float32", kv_cache_memory_gb=0.05)
    assert q.positions == 16 * 256
    assert q.agreement >= 0.75 and q.mean_logprob_gap < 0.1 and q.max_logprob_gap < 0.5


# dtype -> (least agreement, least share of disagreements within each other's top-5, largest agreed logprob gap);
# BENCHMARKS.md run y: int8 99.4%, 23/23, 0.18; int4 96.2%, 153/154, 1.02; fp8_e4m3 98.6%, 58/58, 0.43 (under
# the 99%: 3 mantissa bits, whatever the scale); fp8_e5m2 97.3%, 111/112, 0.95
BUNDLED_BOUNDS = {"int8": (0.99, 1.0, 0.5), "int4": (0.95, 0.99, 1.5), "fp8_e4m3": (0.98, 1.0, 1.0),
                  "fp8_e5m2": (0.965, 0.99, 1.5)}


@pytest.fixture(scope="module")
def bundled_reference(smollm2_tokenizer):
    """The float cache's continuations and scores on the bundled model, once for every cache dtype."""
    from tokenmill.bench.kvquality import bundled_passages, float_reference
    prompts = bundled_passages(smollm2_tokenizer, 16, 32)
    # float activations, as the bounds were measured: the cache's rounding alone
    return float_reference(None, prompts, 256, dtype="float32", kv_cache_memory_gb=0.2, int8_activations=False)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", list(BUNDLED_BOUNDS))
def test_quantised_cache_bounded_on_the_bundled_model(dtype, bundled_reference) -> None:
    """The bundled SmolLM2 on 16 passages of the bundled text, 256 tokens each: the issue's targets (int8 99%,
    int4 95% of positions agree; fp8_e4m3 at what it reaches, 98%), disagreements within each other's top-5,
    agreed logprobs close."""
    from tokenmill.bench.kvquality import against_reference
    q = against_reference(bundled_reference, dtype)
    agreement, in_top5, gap = BUNDLED_BOUNDS[dtype]
    assert q.positions == 16 * 256
    assert q.agreement >= agreement
    assert q.disagree_in_top5 >= in_top5 * (q.positions - q.agree)
    assert q.max_logprob_gap < gap


@pytest.mark.slow
def test_int8_cache_holds_on_natural_text(smollm2_tokenizer) -> None:
    """Natural text, where the float model is less sure than on its own continuations: 16 passages of the bundled
    text, every position after a passage's first, teacher-forced. int8's scale per 32 values holds the issue's 99%
    (a scale per head did not: BENCHMARKS.md, run ww), every flip within each other's top 5."""
    from tokenmill.bench.kvquality import against_reference, bundled_passages, text_reference
    ref = text_reference(None, bundled_passages(smollm2_tokenizer, 16, 256), dtype="float32",
                         kv_cache_memory_gb=0.2, int8_activations=False)
    q = against_reference(ref, "int8")
    assert q.positions == 16 * 255
    assert q.agreement >= 0.99 and q.disagree_in_top5 == q.positions - q.agree


# ---- prefix caching, chunked prefill, preemption and sliding window on quantised blocks -------------------------
# Each of these paths writes and reads the same quantised bytes as the plain run of the same cache dtype (a cached
# block holds what a recompute would write), so greedy tokens are equal, as they are with a float cache.

GREEDY_16 = dict(temperature=0, max_tokens=16, ignore_eos=True)


def _run(path, prompts, kv_cache_dtype, **kw):
    from tokenmill import LLM, SamplingParams
    kw.setdefault("kv_cache_memory_gb", 0.02)
    kw.setdefault("max_model_len", 256)
    llm = LLM(path, dtype="float32", kv_cache_dtype=kv_cache_dtype, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**GREEDY_16), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """int8 and fp8 on tiny_llama's shape (head_dim 8), int4 on head_dim 256 (groups of 32), int8 with a sliding
    window."""
    llama = build_tiny("llama", tmp_path_factory.mktemp("q8"))[0]
    return {"int8": llama, "fp8_e5m2": llama,
            "int4": build_tiny("head_dim256", tmp_path_factory.mktemp("q4"))[0],
            "int8-window": build_tiny("mistral_sw", tmp_path_factory.mktemp("q8sw"))[0]}


@pytest.mark.parametrize("case", ["int8", "int4", "fp8_e5m2", "int8-window"])
def test_quantised_blocks_through_every_path(models, case) -> None:
    from tokenmill.executor.kv_cache import LayerKV
    path, dtype = models[case], case.split("-")[0]
    shared = random_prompts([40], seed=5)[0]
    prompts = [shared + s for s in random_prompts([3, 30, 9, 17, 1, 25], seed=6)]
    plain, _ = _run(path, prompts, dtype, enable_prefix_caching=False)
    chunked, _ = _run(path, prompts, dtype, enable_prefix_caching=False, max_num_batched_tokens=7)
    assert chunked == plain
    hits, llm = _run(path, prompts, dtype)
    assert hits == plain
    # under a sliding window the engine does not cache prefixes (their early blocks are freed as it slides)
    assert (llm.get_stats()["prefix_cache_hits"] > 0) == (llm.llm_engine.model_config.sliding_window is None)
    eng = llm.llm_engine
    mc = eng.model_config
    block = mc.num_hidden_layers * 16 * LayerKV.bytes_per_slot(mc.num_key_value_heads, mc.head_dim, dtype)
    # the fewest blocks the engine accepts (one request's worth; under a sliding window, the window and two
    # blocks, where prompts longer than that go in shorter chunks), and one more without a window
    n = -(-min(128, (mc.sliding_window or 128) + 32) // 16) + (0 if mc.sliding_window else 1)
    tight, llm = _run(path, prompts, dtype, enable_prefix_caching=False, max_model_len=128,
                      kv_cache_memory_gb=n * block / 2 ** 30)
    assert llm.llm_engine.kv.num_blocks == n and llm.get_stats()["num_preemptions"] > 0
    assert tight == plain


# ---- fp8 scales from the data (calculate_kv_scales) -----------------------------------------------------------------

def test_calculated_fp8_scales_come_from_a_fixed_passage(tiny_text_model) -> None:
    """calculate_kv_scales=True: a fixed passage (the bundled text's first 256 tokens) runs at start-up, and each
    layer's scale per kv head is its largest |K| over 200 and |V| over 100, as transformers computes K and V on the
    passage (the scales come from codes first written at 1.0: within fp8_e4m3's 1/16). Every start gets the same
    scales, whatever comes first; the calibration is not counted as traffic; chunked and cached runs give the plain
    run's tokens."""
    import torch
    from tokenmill import LLM
    from tokenmill.bench.perplexity import default_text_path, strip_header
    from tokenmill.engine.engine import CALIBRATION_TOKENS
    path, hf = tiny_text_model
    llm = LLM(path, dtype="float32", kv_cache_dtype="fp8_e4m3", calculate_kv_scales=True, kv_cache_memory_gb=0.02,
              max_model_len=512)
    eng = llm.llm_engine
    ids = eng.tokenizer.encode(strip_header(default_text_path().read_text()))[:CALIBRATION_TOKENS]
    with torch.no_grad():
        cache = hf(torch.tensor([ids]), use_cache=True).past_key_values
    for layer, kv in enumerate(eng.runner.kv_tensors):
        k, v = cache.layers[layer].keys[0], cache.layers[layer].values[0]        # [KV, T, D]
        torch.testing.assert_close(kv.k_scale, k.abs().amax(dim=(1, 2)) / 200, rtol=1 / 16, atol=0)
        torch.testing.assert_close(kv.v_scale, v.abs().amax(dim=(1, 2)) / 100, rtol=1 / 16, atol=0)
        assert not torch.equal(kv.k_scale, torch.ones_like(kv.k_scale))
    assert llm.get_stats()["prefix_cache_queries"] == 0 and eng.stats.num_steps == eng.stats.prefill_tokens == 0
    shared = random_prompts([40], seed=5)[0]
    prompts = [shared + s for s in random_prompts([3, 30, 9], seed=6)]
    plain, again = _run(path, prompts, "fp8_e4m3", enable_prefix_caching=False, calculate_kv_scales=True)
    assert [c.k_scale.tolist() for c in again.llm_engine.runner.kv_tensors] == \
        [c.k_scale.tolist() for c in eng.runner.kv_tensors]
    chunked, _ = _run(path, prompts, "fp8_e4m3", max_num_batched_tokens=7, calculate_kv_scales=True)
    hits, cached = _run(path, prompts, "fp8_e4m3", calculate_kv_scales=True)
    assert chunked == hits == plain and cached.get_stats()["prefix_cache_hits"] > 0


def test_calculated_scales_are_refused_where_they_cannot_run(tmp_path) -> None:
    from tokenmill import LLM
    path = build_tiny("llama", tmp_path / "llama")[0]
    with pytest.raises(ValueError, match="calculate_kv_scales=True computes an fp8 cache's scales, and kv_cache_dtype "
                                         "is 'int8'"):
        LLM(path, kv_cache_dtype="int8", calculate_kv_scales=True, kv_cache_memory_gb=0.02)
    with pytest.raises(ValueError, match="calculate_kv_scales=True with tensor_parallel_size > 1"):
        LLM(path, kv_cache_dtype="fp8", calculate_kv_scales=True, kv_cache_memory_gb=0.02, tensor_parallel_size=2)
    linear = build_tiny("qwen3_5", tmp_path / "q35")[0]
    with pytest.raises(ValueError, match="calculate_kv_scales=True with Qwen3_5ForCausalLM's linear-attention"):
        LLM(linear, kv_cache_dtype="fp8", calculate_kv_scales=True, kv_cache_memory_gb=0.02)


def test_kv_quality_command_scores_natural_text_and_continuations(tiny_text_model, capsys) -> None:
    """`tokenmill bench kv-quality`: each dtype against the float cache on passages of the bundled text (every
    position after a passage's first) and on the model's greedy continuations; fp8 again with calculated scales."""
    import json
    from tokenmill.cli import main
    path, _ = tiny_text_model
    assert main(["bench", "kv-quality", "int8", "fp8_e4m3", "--model", path, "--passages", "2", "--text-len", "24",
                 "--prompt-len", "8", "--continue", "16", "--dtype", "float32", "--calculate-kv-scales",
                 "--kv-cache-memory-gb", "0.02", "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(r["dtypes"]) == ["int8", "fp8_e4m3", "fp8_e4m3+scales"]
    for per in r["dtypes"].values():
        assert per["natural"]["positions"] == 2 * 23 and per["continuations"]["positions"] == 2 * 16
        assert 0 < per["natural"]["agreement"] <= 1
