"""GPTQ, AWQ and compressed-tensors folders: the config's checks, the weight forms' conversions, FP8 and the memory
planner. Loading folders made by the real tools is tests/test_quant_tools.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tokenmill.executor.layers.quant import (GroupWeight, PackedWeight, blocks_to_group, concat_groups,
                                            group_to_blocks, pack_codes)
from tokenmill.executor.loader import hf_quant
from tokenmill.executor.loader.quantize import quantize_fp8, quantize_groups


def _group_weight(bits: int, n: int, k: int, group: int, zero: bool, perm: bool, seed: int = 0) -> GroupWeight:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // group, generator=g).half()
    z = torch.randint(0, 1 << bits, (n, k // group), generator=g, dtype=torch.uint8) if zero else None
    p = torch.randperm(k, generator=g) if perm else None
    return GroupWeight(bits, pack_codes(codes, bits), scale, z, group, (n, k), p)


def _by_formula(w: GroupWeight) -> torch.Tensor:
    """W[n, perm[j]] = scale * (code - zero), element by element."""
    n, k = w.shape
    codes = w.unpacked().float()
    out = torch.empty(n, k)
    for j in range(k):
        zero = w.zero[:, j // w.group].float() if w.zero is not None else 2.0 ** (w.bits - 1)
        col = w.perm[j] if w.perm is not None else j
        out[:, col] = w.scale[:, j // w.group].float() * (codes[:, j] - zero)
    return out


@pytest.mark.parametrize("bits,group,zero,perm", [(4, 32, True, False), (4, 128, False, True), (8, 64, False, False),
                                                  (8, 256, True, True), (4, 256, True, True)])
def test_group_weight_dequantizes_by_its_formula(bits: int, group: int, zero: bool, perm: bool) -> None:
    w = _group_weight(bits, 24, 256, group, zero, perm)
    assert torch.equal(w.dequantize(), _by_formula(w))
    assert torch.equal(w.dequantize(5, 7), _by_formula(w)[5:12])


@pytest.mark.parametrize("bits,group,zero", [(4, 32, True), (4, 128, False), (4, 64, True), (8, 32, False),
                                             (8, 128, False)])
def test_groups_repack_into_cpu_blocks_exactly(bits: int, group: int, zero: bool) -> None:
    w = _group_weight(bits, 16, 256, group, zero, perm=True)
    p = group_to_blocks(w)
    assert isinstance(p, PackedWeight) and p.bits == bits
    # scale * code + (-scale * zero) against scale * (code - zero): float32 rounding only
    torch.testing.assert_close(p.dequantize(), w.dequantize(), rtol=0, atol=1e-6 * float(w.scale.max()) * 16)
    assert p.codes.numel() * p.codes.element_size() == 16 * 256 * bits // 8


def test_blocks_that_cannot_hold_a_group_weight_say_so() -> None:
    assert group_to_blocks(_group_weight(8, 16, 256, 64, zero=True, perm=False)) is None     # 8 bits, zero points
    assert group_to_blocks(_group_weight(4, 16, 48, 16, zero=False, perm=False)) is None     # groups of 16


def test_q8_0_and_q4_0_blocks_become_groups_exactly() -> None:
    from tokenmill.executor.layers.quant import pack_ggml
    from tokenmill.executor.loader.quantize import quantize
    w = torch.randn(8, 96)
    for t in ("Q8_0", "Q4_0"):
        p = pack_ggml(t, quantize(w, t), (8, 96))
        g = blocks_to_group(p)
        assert g is not None and g.group == 32
        torch.testing.assert_close(g.dequantize(), p.dequantize(), rtol=0, atol=1e-6)
    assert blocks_to_group(pack_ggml("Q4_1", quantize(w, "Q4_1"), (8, 96))) is None


def test_fused_shards_stack_only_when_alike() -> None:
    a, b = _group_weight(4, 8, 128, 32, True, False, 1), _group_weight(4, 4, 128, 32, True, False, 2)
    both = concat_groups([a, b])
    assert both is not None and both.shape == (12, 128)
    assert torch.equal(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    assert concat_groups([a, _group_weight(4, 4, 128, 64, True, False)]) is None
    assert concat_groups([_group_weight(4, 8, 128, 32, True, True, 1), _group_weight(4, 8, 128, 32, True, True, 2)]) \
        is None                                   # act orders differ: one input permutation cannot serve both


@pytest.mark.parametrize("bits,symmetric", [(4, True), (4, False), (8, True), (8, False)])
def test_round_to_nearest_groups_bound(bits: int, symmetric: bool) -> None:
    w = torch.randn(32, 256)
    q = quantize_groups(w, bits, 128, symmetric)
    g = w.view(32, 2, 128)
    step = (g.abs().amax(-1) / ((1 << (bits - 1)) - 1)) if symmetric else (g.amax(-1) - g.amin(-1)) / ((1 << bits) - 1)
    err = (q.dequantize() - w).abs().view(32, 2, 128).amax(-1)
    # half a step, plus the zero point's own rounding when asymmetric
    assert bool((err <= step * (0.5 if symmetric else 1.0) + 1e-6).all())


def test_fp8_weights_and_the_scaled_matmul() -> None:
    from tokenmill.executor.ops.fp8 import fp8_fits, fp8_linear
    torch.manual_seed(0)
    w, x = torch.randn(48, 64), torch.randn(5, 64)
    f = quantize_fp8(w)
    assert f.codes.dtype == torch.float8_e4m3fn and f.scale.shape == (48,)
    # e4m3 keeps 3 mantissa bits: each weight within 2^-4 of itself, relative
    assert bool(((f.dequantize() - w).abs() <= w.abs() / 16 + f.scale[:, None] * 2 ** -9).all())
    assert fp8_fits(f, torch.device("cpu")) is None
    exact = x @ f.dequantize().t()
    y = fp8_linear(x, f)
    # x to e4m3 per row as well: a relative error of a few 2^-4 of the row's scale
    assert (y - exact).abs().max() <= 0.1 * exact.abs().max()
    assert fp8_fits(quantize_fp8(torch.randn(40, 64)), torch.device("cpu")) is not None


# ------------------------------------------------------------------------------------------- the config


def _cfg(**qc) -> dict:
    return {"quantization_config": qc}


@pytest.mark.parametrize("qc,names", [
    (dict(quant_method="gptq", bits=3, group_size=128), ["3 bits", "supported"]),
    (dict(quant_method="gptq", bits=4, group_size=48), ["group_size 48"]),
    (dict(quant_method="awq", bits=4, group_size=128, version="gemv"), ["gemv"]),
    (dict(quant_method="bitsandbytes"), ["'bitsandbytes'"]),
    (dict(quant_method="compressed-tensors", format="pack-quantized", config_groups={"g": {"weights": {
        "num_bits": 4, "type": "int", "strategy": "tensor"}}}), ["strategy 'tensor'"]),
    (dict(quant_method="compressed-tensors", config_groups={"g": {"format": "float-quantized", "weights": {
        "num_bits": 4, "type": "float", "strategy": "channel"}}}), ["4 bits"]),
])
def test_unsupported_configs_are_named(qc: dict, names: list[str]) -> None:
    with pytest.raises(ValueError) as e:
        hf_quant.parse(_cfg(**qc))
    for n in names:
        assert n in str(e.value)
    assert "GPTQ: 4 or 8 bits" in str(e.value)


def test_the_quantization_option_must_name_the_folders_method() -> None:
    gptq = _cfg(quant_method="gptq", bits=4, group_size=128, sym=True, desc_act=False)
    assert hf_quant.parse(gptq, "gptq_marlin").method == "gptq"
    with pytest.raises(ValueError, match="quantised by gptq"):
        hf_quant.parse(gptq, "awq")
    with pytest.raises(ValueError, match="no quantization_config"):
        hf_quant.parse({}, "gptq")
    assert hf_quant.parse({}) is None


def _gptq_parts(k: int = 64, n: int = 32, bits: int = 4, group: int = 32) -> dict[str, torch.Tensor]:
    per = 32 // bits
    return {"qweight": torch.zeros(k // per, n, dtype=torch.int32), "qzeros": torch.zeros(k // group, n // per,
                                                                                          dtype=torch.int32),
            "scales": torch.ones(k // group, n, dtype=torch.float16), "g_idx": torch.arange(k, dtype=torch.int32) // group}


def test_a_packed_tensor_that_disagrees_with_the_config_names_itself() -> None:
    q = hf_quant.parse(_cfg(quant_method="gptq", bits=4, group_size=32))
    parts = _gptq_parts()
    parts["scales"] = torch.ones(3, 32, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.up_proj\.scales has shape \(3, 32\)"):
        list(hf_quant.quantized_tensors(q, ((f"model.layers.0.mlp.up_proj.{s}", t) for s, t in parts.items())))
    parts = _gptq_parts()
    del parts["qzeros"]
    with pytest.raises(ValueError, match=r"up_proj\.qzeros"):
        list(hf_quant.quantized_tensors(q, ((f"model.layers.0.mlp.up_proj.{s}", t) for s, t in parts.items())))


def test_a_quantised_folder_refuses_quantisation_at_load(tmp_path: Path, tiny_llama) -> None:
    from tokenmill import LLM
    folder = tmp_path / "q"
    folder.mkdir()
    for f in Path(tiny_llama[0]).iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quantization='int4' was asked for, but this folder is quantised by gptq"):
        LLM(str(folder), quantization="int4", tokenizer=None, kv_cache_memory_gb=0.01, max_model_len=64)
    with pytest.raises(ValueError, match="quantization='awq'.*no quantization_config"):
        LLM(str(tiny_llama[0]), quantization="awq", tokenizer=None, kv_cache_memory_gb=0.01, max_model_len=64)


def test_the_planner_sizes_group_formats() -> None:
    from tokenmill.bench.kvcalc import bits_per_weight, config_precision
    assert bits_per_weight("w4a16-g128") == pytest.approx(4 + (16 + 4) / 128)
    assert bits_per_weight("w4a16-g32") == pytest.approx(4 + 20 / 32)
    assert bits_per_weight("w8a16-g128") == pytest.approx(8 + 24 / 128)
    assert bits_per_weight("fp8") == 8
    assert config_precision(_cfg(quant_method="gptq", bits=4, group_size=128)) == "w4a16-g128"
    assert config_precision(_cfg(quant_method="compressed-tensors", config_groups={"g": {"weights": {
        "num_bits": 8, "type": "float", "strategy": "channel"}}})) == "fp8"
    assert config_precision({}) is None


def test_fp8_refused_before_compute_capability_8_9(tiny_llama, monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenmill.executor.loading import open_model
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"compute capability 8\.9 or later .* this GPU has 8\.0: use 'int8' or "
                                         r"'int4'"):
        open_model(tiny_llama[0], "fp8", torch.device("cuda"))
    with pytest.raises(ValueError, match="on a GPU use 'int8', 'int4' or 'fp8'"):
        open_model(tiny_llama[0], "q4_0", torch.device("cuda"))


def test_group_and_fp8_tables_look_up_rows() -> None:
    """A GGUF's Q8_0 / Q4_0 embedding table becomes a GroupWeight on a GPU: its rows are looked up as they are."""
    from tokenmill.executor.layers.quant import select_rows
    ids = torch.tensor([5, 0, 5, 11])
    for w in (_group_weight(8, 12, 64, 32, zero=False, perm=False), _group_weight(4, 12, 64, 32, zero=True,
                                                                                   perm=False),
              quantize_fp8(torch.randn(12, 64))):
        assert torch.equal(select_rows(w, ids).dequantize(), w.dequantize()[ids])

