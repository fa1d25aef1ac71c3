"""`tokenmill kv-calc` / `mem-plan` as a memory planner: parameter counts against transformers, weight bytes
per precision from gguf's block table, quantised KV dtypes, a GGUF file's real bytes, the CLI and its plot."""
from __future__ import annotations

import json

import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from tests.test_gguf import _write_tiny
from tests.tiny_models import build_tiny
from tokenmill.bench import kvcalc
from tokenmill.cli import main as tokenmill_main
from tokenmill.executor.loader.gguf import open_gguf

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Meta-Llama-3-8B's config.json (the parts that size it); 8,030,261,248 parameters
LLAMA3_8B = dict(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_size=4096,
                 intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False, model_type="llama")


def _split(model: torch.nn.Module) -> tuple[int, int]:
    """(matrix params, vector params) of a transformers model; tied weights count once."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.dim() >= 2), sum(p.numel() for p in params if p.dim() == 1)


# ---------------------------------------------------------------- parameters and weight bytes

@pytest.mark.parametrize("kind", ["llama", "llama_mqa_tied", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3",
                                  "mixtral", "qwen2_moe", "qwen3_moe"])
def test_param_count_matches_transformers(tmp_path, kind):
    path, model = build_tiny(kind, tmp_path / kind)
    cfg, _ = kvcalc.load_config(path)  # what a user passes: the saved config.json
    p = kvcalc.param_count(cfg)
    matrices, vectors = _split(model)
    assert p.total == sum(x.numel() for x in model.parameters())
    assert (p.matrices, p.vectors) == (matrices, vectors)
    assert (p.lm_head == 0) == bool(model.config.tie_word_embeddings)


def test_param_count_with_biases(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, attention_bias=True, mlp_bias=True)
    model = LlamaForCausalLM(cfg)
    p = kvcalc.param_count(cfg.to_dict())
    assert p.total == sum(x.numel() for x in model.parameters())
    assert (p.matrices, p.vectors) == _split(model)


def test_weight_bytes_per_precision(tmp_path):
    path, model = build_tiny("llama_mqa_tied", tmp_path / "m")  # every matrix row is whole 32-blocks
    p = kvcalc.param_count(kvcalc.load_config(path)[0])
    matrices, norms = _split(model)
    assert kvcalc.weight_bytes(p, "Q8_0") == matrices * 34 // 32 + norms * 4
    assert matrices * 34 % 32 == 0  # the line above is exact, not rounded
    assert kvcalc.weight_bytes(p, "int8") == kvcalc.weight_bytes(p, "Q8_0")
    assert kvcalc.weight_bytes(p, "int4") == kvcalc.weight_bytes(p, "Q4_1") == matrices * 20 // 32 + norms * 4
    assert kvcalc.weight_bytes(p, "fp32") == (matrices + norms) * 4
    assert kvcalc.weight_bytes(p, "bf16") == kvcalc.weight_bytes(p, "fp16") == matrices * 2 + norms * 4
    assert kvcalc.weight_bytes(p, "Q4_K") == -(-matrices * 144 // 256) + norms * 4
    # the table comes from gguf's block sizes: bits per weight as llama.cpp documents them
    want = {"Q8_0": 8.5, "Q6_K": 6.5625, "Q5_K": 5.5, "Q4_K": 4.5, "Q4_0": 4.5, "Q4_1": 5.0, "Q3_K": 3.4375,
            "Q2_K": 2.625, "bf16": 16, "fp32": 32}
    assert {k: kvcalc.bits_per_weight(k) for k in want} == want
    assert kvcalc.weight_precision("q4_k") == "Q4_K" and kvcalc.weight_precision("bfloat16") == "bf16"


def test_known_model_and_fits():
    p = kvcalc.param_count(LLAMA3_8B)
    assert p.total == 8_030_261_248 and p.vectors == 32 * 2 * 4096 + 4096
    plan = kvcalc.memory_plan(LLAMA3_8B, context=8192, memory_gb=24, weights="bf16")
    bf16 = plan.weight("bf16").bytes
    assert bf16 == p.matrices * 2 + p.vectors * 4
    per_seq = plan.kv_option("bf16").bytes_per_seq
    assert per_seq == 2**30  # 128 KiB per token x 8192
    assert plan.fits("bf16", "bf16") == int((24e9 - bf16) // 2**30) == 7
    assert plan.fits("fp32", "bf16") == 0  # 32 GB of weights alone overflow 24 GB
    assert plan.fits("Q4_K", "int4") > plan.fits("Q8_0", "bf16")
    d = plan.to_dict()
    assert d["fits"]["bf16"]["bf16"] == 7 and d["params"]["total"] == p.total and d["weights_precision"] == "bf16"
    text = kvcalc.format_plan(plan)
    assert "8,030,261,248" in text and "stay float32" in text and "7 sequences of 8,192 tokens" in text
    assert kvcalc.memory_plan(LLAMA3_8B, memory_gb=1).fits("bf16", "bf16") == 0


# ---------------------------------------------------------------- KV dtypes

def test_kv_bytes_per_dtype():
    s = kvcalc.kv_shape(LLAMA3_8B)  # 32 layers x 8 kv heads x head_dim 128
    heads = 2 * 32 * 8
    assert s.bytes_per_token("fp32") == heads * 128 * 4
    assert s.bytes_per_token("bf16") == heads * 128 * 2
    assert s.bytes_per_token("fp8") == heads * 128
    assert s.bytes_per_token("int8") == heads * (128 + 4 * 4)      # + a float32 scale per 32 values a head
    assert s.bytes_per_token("int4") == heads * (64 + 4 * (2 + 2))  # + fp16 scale and offset per 32
    # windows still cap quantised caches: Mistral-7B-v0.1 keeps 4096 tokens per layer past its window
    mistral = dict(LLAMA3_8B, sliding_window=4096)
    assert kvcalc.kv_calc(mistral, 8192, "int4")["bytes_per_seq"] == heads * 80 * 4096
    r = kvcalc.kv_calc(LLAMA3_8B, 100, "int8")
    assert r["head_bytes"] == 144 and "128 head_dim x 1 B + 16 B scales" in kvcalc.format_report(r)
    with pytest.raises(ValueError, match="unknown KV dtype 'int2'"):
        kvcalc.memory_plan(LLAMA3_8B, kv_dtype="int2")
    with pytest.raises(ValueError, match="unknown weight precision 'Q9_K'"):
        kvcalc.memory_plan(LLAMA3_8B, weights="Q9_K")
    with pytest.raises(ValueError, match="only for a .gguf model"):
        kvcalc.memory_plan(LLAMA3_8B, weights="gguf")
    with pytest.raises(ValueError, match="vocab_size"):  # a precision was asked for; the config cannot size it
        kvcalc.memory_plan(dict(num_hidden_layers=2, num_attention_heads=2, hidden_size=8), weights="bf16")


# ---------------------------------------------------------------- a GGUF file's own bytes

@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_reports_file_bytes(tmp_path, arch):
    path = tmp_path / f"{arch}.gguf"
    _write_tiny(path, arch=arch)
    tensors = open_gguf(path).tensors.values()
    src = kvcalc.load_model(str(path))
    assert src.gguf.n_bytes == sum(t.n_bytes for t in tensors)
    by_type = dict(src.gguf.types)
    assert set(by_type) == {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"}
    # independent of the reader's n_bytes: elements x bytes per block / block size, per tensor
    for name in ("Q4_1", "F16"):
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
        assert by_type[name] == sum(int(torch.tensor(t.shape).prod()) * size // block
                                    for t in tensors if t.type_name == name)
    # the count from the config (biases for qwen2, q/k norms for qwen3) matches the file's tensors
    assert kvcalc.param_count(src.config).total == src.gguf.n_params
    plan = kvcalc.memory_plan(src.config, 256, memory_gb=0.01, gguf=src.gguf)
    assert plan.highlight == "gguf" and plan.weights[0].bytes == src.gguf.n_bytes
    assert plan.fits("gguf", "bf16") == int((0.01e9 - src.gguf.n_bytes) // plan.kv_option("bf16").bytes_per_seq)
    text = kvcalc.format_plan(plan)
    assert f"GGUF file: {src.gguf.n_bytes:,} B" in text and "Q8_0" in text and "%" in text
    assert kvcalc.memory_plan(src.config, gguf=src.gguf, weights="q8_0").highlight == "Q8_0"


# ---------------------------------------------------------------- the CLI

def test_mem_plan_alias_and_plot(tmp_path, capsys):
    gguf_path = tmp_path / "tiny.gguf"
    _write_tiny(gguf_path)
    common = ["--model", str(gguf_path), "--context", "128", "--memory-gb", "0.01"]
    assert tokenmill_main(["kv-calc", *common]) == 0
    old = capsys.readouterr().out
    assert tokenmill_main(["mem-plan", *common]) == 0
    new = capsys.readouterr().out
    assert new == old and "parameters:" in old and "GGUF file:" in old and "fit in 0.01 GB" in old

    assert tokenmill_main(["mem-plan", *common, "--kv-dtype", "int4", "--weights", "Q4_K", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["kv_dtype"] == "int4" and d["weights_precision"] == "Q4_K"
    assert d["gguf"]["n_bytes"] == sum(t.n_bytes for t in open_gguf(gguf_path).tensors.values())
    free = 0.01e9 - d["weights"]["Q4_K"]["bytes"]
    assert d["fits"]["Q4_K"]["int4"] == int(free // d["kv"]["int4"]["bytes_per_seq"]) > 0

    png = tmp_path / "plan.png"
    assert tokenmill_main(["mem-plan", *common, "--plot", str(png)]) == 0
    assert f"plot: {png}" in capsys.readouterr().out
    import matplotlib.image as mpimg
    assert png.read_bytes()[:8] == PNG_MAGIC
    img = mpimg.imread(png)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100

    assert tokenmill_main(["mem-plan", *common, "--weights", "q9"]) == 2
    assert "unknown weight precision 'q9'" in capsys.readouterr().err
    assert tokenmill_main(["kv-calc", *common, "--kv-dtype", "fp4"]) == 2
    assert "unknown KV dtype 'fp4'" in capsys.readouterr().err


def test_plot_needs_weights(tmp_path, capsys):
    cfg = tmp_path / "shape_only.json"  # layers and heads only: KV is known, weights are not
    cfg.write_text(json.dumps(dict(num_hidden_layers=2, num_attention_heads=2, hidden_size=8)))
    assert tokenmill_main(["mem-plan", "--config", str(cfg), "--memory-gb", "1"]) == 0
    assert "parameters: not counted" in capsys.readouterr().out
    assert tokenmill_main(["mem-plan", "--config", str(cfg), "--plot", str(tmp_path / "x.png")]) == 2
    assert "--plot needs the weights" in capsys.readouterr().err and not (tmp_path / "x.png").exists()
