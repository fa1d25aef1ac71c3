"""Quantisation into llama.cpp's block formats, and `tokenmill quantize` writing GGUFs llama.cpp loads.

Oracles: gguf-py's `gguf.quants` (numpy, bit-exact with ggml's reference quantisers) for the block bytes;
transformers' tiny random models for the weights and config; llama.cpp itself (llama-cpp-python, in this
interpreter or the peer venv) for "llama.cpp can load it". The llama.cpp tests skip when it is absent.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from tests.tiny_models import VOCAB, build_tiny
from tokenmill.cli import main
from tokenmill.executor.loader import gguf_writer
from tokenmill.executor.loader.gguf import open_gguf, read_gguf
from tokenmill.executor.loader.gguf_writer import LLAMA_CPP_TYPES, OUR_TYPES, peer_llama_cpp_python
from tokenmill.executor.loader.quantize import (BLOCK_TYPES, QUANTIZATION, can_quantize, quantize, row_bytes,
                                                supported_types)

ALL_TYPES = list(BLOCK_TYPES) + ["F16", "BF16", "F32"]


# ------------------------------------------------------------------------------ part 1: the quantisers

def _hard_matrix(k: int = 256, seed: int = 0) -> torch.Tensor:
    """Random rows plus the cases the rounding rules differ on."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(40, k, generator=g)
    w[0] = 0                                                    # an all-zero row (d = 0, inverse 0)
    w[1] *= 1e-30                                               # tiny: fp16 scale underflows to 0
    w[2] *= 1e30                                                # huge: fp16 scale overflows to inf
    w[3, 17] = 1e4                                              # one outlier in a block
    w[4] = torch.randint(-127, 128, (k,), generator=g).float()  # Q8_0 codes exactly, d = 1 where 127 is in
    w[4, ::32] = 127
    w[5] = w[4] + 0.5                                           # exact .5 ties: away from zero, not to even
    w[5, ::32] = 127
    w[6] = torch.round(w[6] * 2) / 2                            # more ties for the 4/5-bit codes
    w[7, :32] = torch.tensor([2.0, -2.0] * 16)                  # +max and -max tie: the first one wins
    w[7, 32:64] = torch.tensor([-3.0] + [3.0] * 31)
    w[8, :32] = -0.0                                            # signed zeros
    w[8, 40] = -0.0
    w[9] *= 1e-6                                                # fp16-subnormal scales
    w[10] = w[10].abs() + 5                                     # one-sided rows (Q4_1/Q5_1 offset)
    w[11] = -w[11].abs() - 5
    w[12, :32] = torch.tensor(np.nextafter(np.float32(0.5), np.float32(0)))  # 0.49999997: rounds down
    w[12, 0] = 127 * 0.5
    w[13] *= 1e-3
    w[14] *= 65504 * 127                                        # scale right at the fp16 limit
    return w


def _gguf_bytes(w: torch.Tensor, type_name: str) -> np.ndarray:
    out = gguf_quantize(w.numpy(), GGMLQuantizationType[type_name])
    return out.view(np.uint8).reshape(*w.shape[:-1], -1)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # gguf-py's casts of the huge rows' scales overflow
@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_bit_equal_to_gguf_py(type_name: str) -> None:
    for seed, k in [(0, 256), (1, 64), (2, 4096)]:
        w = _hard_matrix(k, seed)
        ours = quantize(w, type_name)
        assert ours.dtype == np.uint8 and ours.shape == (w.shape[0], row_bytes(type_name, k))
        ref = _gguf_bytes(w, type_name)
        bad = np.nonzero((ours != ref).any(axis=1))[0]
        assert bad.size == 0, f"{type_name}: rows {bad.tolist()} differ from gguf-py (K={k})"


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
def test_bit_equal_in_every_chunk_and_shape(type_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows split over several chunks, 1-D and 3-D inputs, and half-precision inputs (gguf-py widens to
    float32 first, as we do)."""
    from tokenmill.executor.loader import quantize as q
    monkeypatch.setattr(q, "_CHUNK_WEIGHTS", 3 * 64)  # 3 rows a chunk: 7 chunks, the last one short
    w = torch.randn(20, 64) * torch.logspace(-3, 3, 20).unsqueeze(1)
    assert np.array_equal(quantize(w, type_name), _gguf_bytes(w, type_name))
    assert np.array_equal(quantize(w[0], type_name), _gguf_bytes(w[0], type_name))
    w3 = w.reshape(4, 5, 64)
    assert np.array_equal(quantize(w3, type_name), _gguf_bytes(w3, type_name))
    for dtype in (torch.float16, torch.bfloat16):
        low = w.to(dtype)
        assert np.array_equal(quantize(low, type_name), _gguf_bytes(low.float(), type_name))


def test_round_trip_values() -> None:
    """The bytes decode (gguf-py's dequantize) to the grid they promise: Q8_0 within half a step, plus the
    fp16 rounding of the stored scale (codes come from the unrounded one) times the largest code."""
    w = torch.randn(8, 128)
    back = gguf_dequantize(quantize(w, "Q8_0"), GGMLQuantizationType.Q8_0)
    step = w.reshape(8, 4, 32).abs().amax(-1, keepdim=True) / 127
    err = (torch.from_numpy(back).reshape(8, 4, 32) - w.reshape(8, 4, 32)).abs()
    assert (err <= step * (0.5 + 127 * 2.0 ** -11)).all()


def test_types_and_options() -> None:
    assert QUANTIZATION == {"int8": "Q8_0", "int4": "Q4_1"}
    assert set(QUANTIZATION.values()) <= set(supported_types())
    assert set(supported_types()) == set(ALL_TYPES)
    assert can_quantize("q4_1") and can_quantize("Q8_0", 4096) and not can_quantize("Q8_0", 48)
    assert can_quantize("F16", 48) and not can_quantize("Q4_K")
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.zeros(2, 48), "Q8_0")
    with pytest.raises(ValueError, match="Q4_0"):
        quantize(torch.zeros(2, 64), "Q4_K")


# ---------------------------------------------------------------------- part 2: `tokenmill quantize`

def _tiny_tokenizer(folder: Path, vocab: int = VOCAB) -> None:
    """A byte-level BPE tokenizer.json with `vocab` tokens (256 bytes, one special, the rest merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog, again and again",
                             "tokenmill writes weights in blocks that llama.cpp reads"] * 20, trainer)
    tok.save(str(folder / "tokenizer.json"))


def _tiny_folder(kind: str, path: Path):
    folder, model = build_tiny(kind, path)
    _tiny_tokenizer(path)
    return folder, model


def _quantize(src: str, out: Path, type_name: str, *extra: str) -> None:
    assert main(["quantize", src, str(out), "--type", type_name, *extra]) == 0
    assert out.exists() and not Path(f"{out}.part").exists()


def _hf_weights(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(Path(folder) / "model.safetensors"))


def _expected(w: torch.Tensor, type_name: str) -> torch.Tensor:
    """gguf-py's quantise -> dequantise of an HF weight (row permutations commute with it, so llama's q/k
    interleaving, undone by read_gguf, does not matter)."""
    if type_name == "F32":
        return w.float()
    qtype = GGMLQuantizationType[type_name]
    return torch.from_numpy(np.asarray(gguf_dequantize(gguf_quantize(w.float().numpy(), qtype), qtype),
                                       dtype=np.float32).reshape(w.shape))


def _check_against_hf(gguf_path: Path, hf_folder: str, hf_model: Any, head_type: str, target: str) -> None:
    ck = read_gguf(str(gguf_path))
    cfg = hf_model.config
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings"):
        assert ck.config[key] == getattr(cfg, key), key
    assert ck.config["head_dim"] == (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    assert ck.config["rms_norm_eps"] == pytest.approx(cfg.rms_norm_eps)
    assert ck.config["rope_theta"] == cfg.rope_parameters["rope_theta"]
    if cfg.rope_parameters.get("rope_type", "default") != "default":
        assert ck.config["rope_scaling"]["rope_type"] == cfg.rope_parameters["rope_type"]
        assert ck.config["rope_scaling"]["factor"] == cfg.rope_parameters["factor"]
    types = {info.name: info.type_name for info in open_gguf(str(gguf_path)).tensors.values()}
    head = "output.weight" if "output.weight" in types else "token_embd.weight"
    ours = dict(ck.tensors())
    hf = _hf_weights(hf_folder)
    if cfg.tie_word_embeddings:
        hf.pop("lm_head.weight", None)
    assert set(ours) == set(hf)
    by_hf = {gguf_writer.gguf_tensor_name(n): n for n in hf}
    for gguf_name, type_name in types.items():
        w = hf[by_hf[gguf_name]]
        want = "F32" if w.dim() == 1 else head_type if gguf_name == head else target
        assert type_name == want, gguf_name
        assert torch.equal(ours[by_hf[gguf_name]], _expected(w, type_name)), gguf_name


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, tuple[str, Any]]:
    """tied embeddings + linear rope (llama, q/k permuted), q/k/v biases (qwen2), q/k norms and a head_dim
    that is not hidden / heads (qwen3)."""
    return {kind: _tiny_folder(kind, tmp_path_factory.mktemp(kind)) for kind in ("llama_mqa_tied", "qwen2", "qwen3")}


@pytest.mark.parametrize("kind", ["llama_mqa_tied", "qwen2", "qwen3"])
@pytest.mark.parametrize("target", ["q8_0", "q4_0"])
def test_hf_folder_round_trip(kind: str, target: str, tiny_models, tmp_path: Path) -> None:
    folder, model = tiny_models[kind]
    out = tmp_path / f"{kind}.{target}.gguf"
    _quantize(folder, out, target)
    head = "Q8_0"  # Q8_0 stays Q8_0; under Q4_0 the output head is kept 8-bit, as llama.cpp keeps it
    _check_against_hf(out, folder, model, head, OUR_TYPES[target])
    meta = open_gguf(str(out)).metadata
    assert meta["general.file_type"] == {"q8_0": 7, "q4_0": 2}[target]
    assert meta["tokenizer.ggml.model"] == "gpt2" and len(meta["tokenizer.ggml.tokens"]) == VOCAB
    assert meta["tokenizer.ggml.merges"] and meta["tokenizer.ggml.pre"] == "gpt-2"


def test_gguf_input_requantised(tiny_models, tmp_path: Path) -> None:
    """GGUF in: every key copied (tokenizer included) but the file type; each matrix dequantised and
    quantised again, bit-equal to gguf-py; a tensor already in the target type copied as it is."""
    folder, _ = tiny_models["llama_mqa_tied"]
    q8 = tmp_path / "a.q8_0.gguf"
    _quantize(folder, q8, "q8_0")
    q5 = tmp_path / "b.q5_1.gguf"
    _quantize(str(q8), q5, "q5_1")
    src, dst = open_gguf(str(q8)), open_gguf(str(q5))
    changed = {"general.file_type"}
    assert {k: v for k, v in src.metadata.items() if k not in changed} == \
           {k: v for k, v in dst.metadata.items() if k not in changed}
    assert dst.metadata["general.file_type"] == 9
    for name, info in dst.tensors.items():
        before = src.tensors[name]
        if info.type_name == before.type_name:  # the head stays Q8_0: bytes copied
            assert np.array_equal(dst.raw(info), src.raw(before)), name
            continue
        assert info.type_name == "Q5_1", name
        w = torch.from_numpy(gguf_dequantize(src.raw(before), GGMLQuantizationType.Q8_0))
        assert np.array_equal(dst.raw(info), _gguf_bytes(w, "Q5_1")), name


def test_rows_not_whole_blocks_fall_back_to_f16(tmp_path: Path) -> None:
    """hidden 48: rows of 48 weights are no whole 32-blocks, so those matrices are written F16; llama3 rope
    scaling goes out as llama.cpp's rope_freqs tensor."""
    folder, _ = _tiny_folder("llama", tmp_path / "llama")
    out = tmp_path / "llama.q8_0.gguf"
    _quantize(folder, out, "q8_0")
    f = open_gguf(str(out))
    types = {name: info.type_name for name, info in f.tensors.items()}
    assert types["blk.0.attn_q.weight"] == "F16"          # K = hidden = 48
    assert types["blk.0.ffn_down.weight"] == "F16"        # K = intermediate = 80
    assert types["rope_freqs.weight"] == "F32"
    assert f.metadata["llama.rope.freq_base"] == 500000.0


@pytest.mark.parametrize("pre, name", [
    ({"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}, "gpt-2"),
    ({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True},
                                            {"type": "ByteLevel", "use_regex": True}]}, "smollm"),
    ({"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": gguf_writer._LLAMA3_REGEX}},
                                            {"type": "ByteLevel", "use_regex": False}]}, "llama-bpe"),
    ({"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": gguf_writer._QWEN2_REGEX}},
                                            {"type": "ByteLevel", "use_regex": False}]}, "qwen2"),
    ({"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": "x"}}]}, None),
])
def test_pre_tokenizer_names(pre: dict[str, Any], name: str | None) -> None:
    """llama.cpp's tokenizer.ggml.pre for the pre-tokenizers of GPT-2, SmolLM, Llama 3 and Qwen 2/3 (all
    checked by hand to tokenize as transformers does in llama.cpp); unknown ones are left out, so llama.cpp
    falls back to its default with a warning rather than refusing the file."""
    assert gguf_writer._pre_tokenizer({"pre_tokenizer": pre}) == name


def test_bad_input(tmp_path: Path, tiny_models, capsys: pytest.CaptureFixture[str],
                   monkeypatch: pytest.MonkeyPatch) -> None:
    folder, _ = tiny_models["qwen2"]
    out = tmp_path / "out.gguf"
    assert main(["quantize", folder, str(out), "--type", "q3_x"]) == 2
    err = capsys.readouterr().err
    assert "q3_x" in err and "q8_0" in err and "q4_k_m" in err  # the valid types are listed
    assert main(["quantize", str(tmp_path / "nope"), str(out), "--type", "q8_0"]) == 2
    assert "does not exist" in capsys.readouterr().err
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert main(["quantize", str(gpt2), str(out), "--type", "q8_0"]) == 2
    assert "'gpt2' is not supported" in capsys.readouterr().err
    no_tok = tmp_path / "no_tok"
    build_tiny("qwen2", no_tok)
    assert main(["quantize", str(no_tok), str(out), "--type", "q8_0"]) == 2
    assert "no tokenizer.json" in capsys.readouterr().err
    assert not out.exists()

    out.write_bytes(b"keep me")
    assert main(["quantize", folder, str(out), "--type", "q8_0"]) == 2
    assert "--force" in capsys.readouterr().err and out.read_bytes() == b"keep me"
    _quantize(folder, out, "Q8_0", "--force")                # type names are case-insensitive
    assert open_gguf(str(out)).metadata["general.file_type"] == 7

    # K-quants without llama.cpp anywhere: a clear error naming the package and what we write ourselves
    monkeypatch.setattr(gguf_writer, "_import_llama_cpp", lambda: None)
    monkeypatch.setenv("PEERS_DIR", str(tmp_path / "no-peers"))
    assert main(["quantize", folder, str(tmp_path / "k.gguf"), "--type", "q4_k_m"]) == 2
    err = capsys.readouterr().err
    assert "pip install llama-cpp-python" in err and "q4_0" in err
    assert not list(tmp_path.glob("k.gguf*"))


# --------------------------------------------------------------------------------- llama.cpp loads it

def _llama_cpp_python() -> str:
    if importlib.util.find_spec("llama_cpp") is not None:
        return sys.executable
    peer = peer_llama_cpp_python()
    if peer is None:
        pytest.skip("llama.cpp is not available: llama_cpp does not import here and there is no peer venv at "
                    "${PEERS_DIR:-${TMPDIR:-/tmp}/tokenmill-peers}/llamacpp (pip install llama-cpp-python)")
    return peer


# run by the python that has llama_cpp: argv = json request, then GGUF paths; prints one json line
_LLAMA_CPP_SCRIPT = """
import json, sys
import numpy as np
from llama_cpp import Llama
req = json.loads(sys.argv[1])
out = {}
for path in sys.argv[2:]:
    llm = Llama(model_path=path, n_ctx=64, n_threads=1, verbose=False, logits_all=True)
    llm.eval(req["ids"])
    out[path] = {"logits": np.asarray(llm.scores[:len(req["ids"])]).tolist(), "n_vocab": llm.n_vocab(),
                 "tokens": llm.tokenize(req["text"].encode(), add_bos=False, special=True),
                 "metadata": dict(llm.metadata)}
print(json.dumps(out))
"""


def _llama_cpp(paths: list[Path], ids: list[int], text: str = "") -> dict[str, dict[str, Any]]:
    proc = subprocess.run([_llama_cpp_python(), "-c", _LLAMA_CPP_SCRIPT, json.dumps({"ids": ids, "text": text}),
                           *map(str, paths)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"llama.cpp could not load {paths}:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@torch.no_grad()
def _hf_logits(model: Any, ids: list[int]) -> np.ndarray:
    return model(torch.tensor([ids])).logits[0].numpy()


def test_llama_cpp_loads_our_files(tiny_models, tiny_text_model, tmp_path: Path) -> None:
    """q8_0 and q4_0 files load in llama.cpp and give finite logits; an f32 file gives transformers' logits
    (so metadata, q/k interleaving and rope scaling mean to llama.cpp what they meant to transformers); a real
    tokenizer (SmolLM2's) tokenizes the same in llama.cpp as in transformers, chat template included."""
    _llama_cpp_python()  # skip early
    from transformers import AutoTokenizer
    ids = [1, 5, 17, 42, 100, 7, 300, 2, 250, 64]
    folders = {kind: tiny_models[kind] for kind in ("llama_mqa_tied", "qwen3")}
    files = {}
    for kind, (folder, _) in folders.items():
        for target in ("f32", "q8_0", "q4_0") if kind == "llama_mqa_tied" else ("f32",):
            files[kind, target] = tmp_path / f"{kind}.{target}.gguf"
            _quantize(folder, files[kind, target], target)
    text_folder, text_model = tiny_text_model
    for target in ("q8_0", "q4_0"):
        files["text", target] = tmp_path / f"text.{target}.gguf"
        _quantize(text_folder, files["text", target], target)
    text = "Hello world! Tokenmill 123 writes <|im_start|>GGUF files."
    got = _llama_cpp(list(files.values()), ids, text)
    for (kind, target), path in files.items():
        res = got[str(path)]
        logits = np.asarray(res["logits"])
        assert logits.shape == (len(ids), res["n_vocab"]) and np.isfinite(logits).all(), path
        model = text_model if kind == "text" else folders[kind][1]
        ref = _hf_logits(model, ids)
        # f32: llama.cpp's f16 KV cache is all that differs; the quantised files stay near
        atol = {"f32": 0.02, "q8_0": 0.05, "q4_0": 0.5}[target]
        assert np.abs(logits - ref).max() < atol * max(1.0, np.abs(ref).max()), (path, np.abs(logits - ref).max())
    tok = AutoTokenizer.from_pretrained(text_folder)
    for target in ("q8_0", "q4_0"):
        res = got[str(files["text", target])]
        assert res["tokens"] == tok.encode(text, add_special_tokens=False)
        assert res["metadata"]["tokenizer.chat_template"] == tok.chat_template
        assert int(res["metadata"]["tokenizer.ggml.eos_token_id"]) == tok.eos_token_id


def _hidden256(path: Path) -> tuple[str, Any]:
    """Rows of 256 weights, so llama.cpp's K-quants (256-weight super-blocks) apply to every matrix."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.05, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                      pad_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path)
    _tiny_tokenizer(path)
    return str(path), model


def test_k_quant_through_llama_cpp(tmp_path: Path) -> None:
    _llama_cpp_python()  # skip early
    folder, model = _hidden256(tmp_path / "h256")
    out = tmp_path / "h256.q4_k_m.gguf"
    _quantize(folder, out, "q4_k_m")
    assert not list(tmp_path.glob("h256.q4_k_m.gguf.*"))  # the float intermediate is gone
    types = {info.type_name for info in open_gguf(str(out)).tensors.values()}
    assert {"Q4_K", "Q6_K"} <= types and types <= {"Q4_K", "Q6_K", "F32"}
    ck = read_gguf(str(out))
    assert ck.config["hidden_size"] == 256 and ck.config["num_key_value_heads"] == 2
    hf = dict(model.named_parameters())
    for name, w in ck.tensors():
        ref = hf[name].detach()
        assert (w - ref).abs().max() < 0.1 * ref.abs().max() + 1e-6, name  # 4-6 bits of the same weights
    ids = [3, 14, 15, 92, 65]
    logits = np.asarray(_llama_cpp([out], ids)[str(out)]["logits"])
    assert np.isfinite(logits).all()
    assert np.abs(logits - _hf_logits(model, ids)).max() < 0.5 * max(1.0, np.abs(_hf_logits(model, ids)).max())
    # llama.cpp's own Q4_K/Q6_K file: tokenmill reading its blocks with float activations gives the same greedy
    # tokens as the same model dequantised at load, in every kernel variant
    from tests.test_plans import assert_same
    from tokenmill import LLM, SamplingParams
    from tokenmill.executor.kernels import runnable_variants
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": p} for p in ([3, 14, 15, 92, 65], [7], list(range(40, 80)))]

    def run(**kw):
        llm = LLM(str(out), dtype="float32", kv_cache_memory_gb=0.01, max_model_len=128, tokenizer=None, **kw)
        return [o.outputs[0] for o in llm.generate(prompts, greedy, use_tqdm=False)]

    want = run(quantized_kernels=False, cpu_kernels="reference")
    for isa in runnable_variants():
        assert_same(run(cpu_kernels=isa, int8_activations=False), want)


def test_llama_cpp_types_named_as_llama_cpp() -> None:
    """Every K-quant --type maps to a file type llama-cpp-python defines (checked where it is installed)."""
    assert not set(OUR_TYPES) & set(LLAMA_CPP_TYPES)
    python = _llama_cpp_python()
    names = json.dumps(sorted(set(LLAMA_CPP_TYPES.values())))
    code = f"import json, llama_cpp; print(all(hasattr(llama_cpp, n) for n in json.loads({names!r})))"
    assert subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120).stdout.strip() == "True"


def test_qwen3_decodes_through_the_one_call_layer(tiny_models, tmp_path: Path) -> None:
    """Qwen3's q/k norms run inside the one-call decode layer: every layer of a Q8_0 file takes it, and its tokens
    and logprobs equal the same kernels called op by op."""
    from tests.family_checks import check_one_call_layer
    from tests.tiny_models import random_prompts
    from tokenmill import LLM
    out = tmp_path / "qwen3.q8_0.gguf"
    _quantize(tiny_models["qwen3"][0], out, "q8_0")
    llm = LLM(str(out), dtype="float32", kv_cache_memory_gb=0.02, max_model_len=256, enable_prefix_caching=False)
    check_one_call_layer(llm, [{"prompt_token_ids": p} for p in random_prompts([9, 30, 4], seed=5)], 12, tol=0.0)
