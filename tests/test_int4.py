"""Weight-only int4 (inference/int4.py): the packing, the per-group rounding, the layer on the CPU (the weight
dequantised whole), which layers --quantize int4 takes, and both Triton kernels run by Triton's interpreter on
the CPU where triton is installed (tests/test_gpu.py runs them on a GPU)."""
import dataclasses

import pytest
import torch
from torch import nn

from shardlm.config import ConfigError, load_config
from shardlm.inference.int4 import Int4Linear, to_int4
from shardlm.inference.int4_format import (BLOCK, GROUPS, blocked, dequantize, group_size, pack, quantize_weight,
                                           unblocked, unpack)
from shardlm.model import build_model

@pytest.mark.timeout(60)
def test_pack_holds_each_input_in_its_nibble_and_unpack_reads_it_back():
    """Word (b, r, o) holds q[8b + o, 8r + j] in bits 4j..4j+3: every value at every position, the top nibble's
    8-15 included (the int32's sign bit), read back by unpack and by shifting the words as the kernels do; each
    block of 8 outputs one contiguous run along K; blocked/unblocked lay per-group values out the same way."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (40, 64), generator=g)
    q[:16, :8] = torch.arange(16)[:, None]  # each value at each of a word's positions
    words = pack(q)
    assert words.dtype == torch.int32 and words.shape == (5, 8, BLOCK) and words.is_contiguous()
    assert torch.equal(unpack(words), q.int())
    w = words.long() & 0xFFFFFFFF
    for j in range(8):
        for o in range(BLOCK):
            assert torch.equal((w[:, :, o] >> (4 * j)) & 15, q[o::BLOCK, j::8]), (j, o)
    per_group = torch.randn(40, 3, generator=g)
    assert blocked(per_group).shape == (5, 3, BLOCK) and torch.equal(blocked(per_group)[1, 2], per_group[8:16, 2])
    assert torch.equal(unblocked(blocked(per_group)), per_group)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_dequantised_weight_is_q_less_the_groups_zero_times_its_scale(dtype):
    """quantize_weight's groups, one loop at a time: scale the range of the group and 0 over 15 (as stored, in
    the weight's dtype), zero the level of 0 (an integer, uint8), q the nearest level in 0..15; dequantize gives
    (q - zero) * scale, exactly in fp32. A group of one constant keeps it (to its scale's rounding), one of
    zeros stays zero."""
    g = torch.Generator().manual_seed(1)
    n, k, group = 24, 192, 64
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    w[3, 64:128] = 0.25  # all positive: the range [0, 0.25], zero 0, every q 15
    w[5, :64] = -0.5  # all negative: zero 15, every q 0
    w[6, 128:] = 0  # the dtype's tiniest scale, every q the zero
    words, scale, zero = quantize_weight(w, group)
    assert scale.shape == zero.shape == (n // BLOCK, k // group, BLOCK) and scale.dtype == dtype
    assert zero.dtype == torch.uint8
    q = unpack(words)  # [N, K]
    scale, zero = unblocked(scale), unblocked(zero)  # [N, K/G]
    deq = dequantize(words, blocked(scale), blocked(zero), torch.float32)
    assert deq.shape == (n, k)
    for i in range(n):
        for c in range(k // group):
            cols = slice(c * group, (c + 1) * group)
            wg = w[i, cols].float()
            s, z = scale[i, c], zero[i, c].item()
            lo, hi = wg.min().clamp(max=0), wg.max().clamp(min=0)
            assert s == ((hi - lo) / 15).clamp_min(torch.finfo(dtype).tiny).to(dtype)
            assert z == (-lo / s.float()).round().clamp(0, 15).item()
            levels = ((wg / s.float()).round() + z).clamp(0, 15)
            assert torch.equal(q[i, cols], levels.int())
            assert torch.equal(deq[i, cols], (q[i, cols] - z) * s.float())
    assert torch.equal(deq[3, 64:128], (15 * scale[3, 1].float()).expand(64))  # 0.25 to the scale's rounding
    assert torch.equal(deq[5, :64], (-15 * scale[5, 0].float()).expand(64))
    assert (deq[3, 64:128] - 0.25).abs().max() <= 0.25 * 2**-7 and (deq[5, :64] + 0.5).abs().max() <= 0.5 * 2**-7
    assert torch.equal(deq[6, 128:], torch.zeros(64))
    assert torch.equal(dequantize(words, blocked(scale), blocked(zero)), deq.to(dtype))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("k, group, bound", [(1024, 128, 0.11), (320, 64, 0.10), (96, 32, 0.09)])
def test_int4_rounding_error_of_normal_weights(k, group, bound):
    """Normal weights: the relative error of the weight about one level over sqrt(12) of the range that its
    group spans (about 5.2 standard deviations for 128 samples, less for fewer): 0.100 at 128, 0.093 at 64,
    0.084 at 32; the bound a tenth above; and no weight moved by more than half a level."""
    assert group_size(k) == group
    w = torch.randn(256, k, generator=torch.Generator().manual_seed(2))
    words, scale, zero = quantize_weight(w, group)
    deq = dequantize(words, scale, zero)
    assert ((deq - w).norm() / w.norm()).item() < bound
    assert ((deq - w).abs() <= unblocked(scale).repeat_interleave(group, 1) / 2 + 1e-6).all()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_linear_on_the_cpu_is_the_dequantised_product(dtype):
    """On the CPU the layer multiplies by its weight dequantised whole, plus its bias, for any leading
    dimensions; the state dict holds the packed weight, scales and zero points; an input of the wrong size is refused
    by name."""
    torch.manual_seed(0)  # the 0.1 bound on the largest error is exceeded by about 1 layer in 700
    layer = nn.Linear(256, 200).to(dtype)
    q = Int4Linear(layer)
    assert (q.in_features, q.out_features, q.group) == (256, 200, 128)
    assert set(q.state_dict()) == {"words", "scale", "zero", "bias"}
    with pytest.raises(ValueError, match="an input of 128 features against a weight of 256"):
        q(torch.randn(1, 128).to(dtype))
    x = torch.randn(2, 3, 256).to(dtype)
    with torch.no_grad():
        want = x @ dequantize(q.words, q.scale, q.zero, dtype).t() + layer.bias
        assert torch.equal(q(x), want)
        near = layer(x).float()
        assert ((q(x).float() - near).abs().max() / near.abs().max()).item() < 0.1


def test_groups_fall_back_and_odd_shapes_are_refused():
    from shardlm.plan.inference import INT4_GROUPS
    assert GROUPS == INT4_GROUPS == (128, 64, 32)
    assert [group_size(k) for k in (4096, 11008, 320, 96, 72, 40)] == [128, 128, 64, 32, None, None]
    with pytest.raises(ValueError, match="int4 needs an input size that a group of 128, 64, 32 divides and an "
                                         "output size that 8 divides, not 72 -> 8"):
        Int4Linear(nn.Linear(72, 8))
    with pytest.raises(ValueError, match="not 64 -> 12"):
        Int4Linear(nn.Linear(64, 12))
    with pytest.raises(ValueError, match="int4 takes groups of 128, 64, 32 inputs and blocks of 8 outputs: a group "
                                         "of 24"):
        quantize_weight(torch.randn(8, 48), 24)


@pytest.mark.timeout(120)
def test_to_int4_swaps_the_blocks_linears_it_can():
    """to_int4 takes each block's linear layers whose input a group divides (here all but the MLP's down
    projection, of 72 inputs), leaves those and a mixture of experts' router as they are, and the output head
    (16 bits, as int8's); a model none of whose layers it can take is refused."""
    base = load_config("tiny").model
    model = build_model(dataclasses.replace(base, ffn_hidden_size=72), seed=0).eval()
    ids = torch.randint(0, base.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids)
    head = model.lm_head
    assert to_int4(model) == 6
    for block in model.blocks():
        quantised = {name for name, m in block.named_modules() if isinstance(m, Int4Linear)}
        assert quantised == {"attn.qkv", "attn.out", "mlp.up"}, quantised
        assert isinstance(block.mlp.down, nn.Linear)
    assert model.lm_head is head and isinstance(head, nn.Linear)
    with torch.no_grad():
        got = model(ids)
    assert ((got - want).abs().max() / want.abs().max()).item() < 0.1
    moe = build_model(load_config("mixtral-tiny").model, seed=0).eval()
    routers = [block.mlp.router for block in moe.blocks()]
    assert to_int4(moe) > 0
    assert [block.mlp.router for block in moe.blocks()] == routers
    odd = build_model(dataclasses.replace(base, hidden_size=40, ffn_hidden_size=72, num_heads=2, num_kv_heads=2))
    with pytest.raises(ConfigError, match="int4 needs an input size that a group of 128, 64, 32 divides"):
        to_int4(odd)


# ---- the Triton kernels, run by Triton's interpreter on the CPU -----------------------------------------------

def check_kernels_interpreted() -> None:
    """Run under TRITON_INTERPRET=1 (in a subprocess: the variable is read when triton is imported). The
    kernels in fp16 (the interpreter's bf16 is broken) against the product in fp64 of the dequantised weight:
    one row (the one-row GEMV, called twice: the same bits; steps of rows that do and do not divide K's), 2, 16
    and 64 rows (the op's default form by rows, and int4_mm's forms at several tiles, K split evenly and not); outputs
    not a multiple of a tile, groups of 128, 64 and 32; and every nibble read exactly (scale 1, zero 0, x of
    ones: integer sums, exact in fp32, rounded once to fp16). The forms that dequantise before the product
    ("dequant"; "planes" with groups under 128, whose dot spans several) multiply by the weight rounded to fp16
    as dequantize rounds it, and int4_dequant writes dequantize's bits."""
    from shardlm.inference import int4
    g = torch.Generator().manual_seed(0)
    worst = {}
    # (form, bm, bn, warps): int4_mm's launches (dequant: bn rows of words a program, none of bm)
    launches = (("tiles", 16, 32, 4), ("tiles", 64, 128, 8), ("planes", 16, 64, 4), ("planes", 32, 32, 4),
                ("planes", 64, 128, 8), ("dequant", 0, 16, 4), ("dequant", 0, 64, 2))
    for k, n in ((256, 200), (384, 200), (320, 72), (96, 136), (128, 128), (1536, 16)):
        group = group_size(k)
        words, scale, zero = quantize_weight(torch.randn(n, k, generator=g).half(), group)
        w = dequantize(words, scale, zero, torch.float64)
        rounded = dequantize(words, scale, zero, torch.float16)
        for rows in (16, 64):
            assert torch.equal(int4.int4_dequant(words, scale, zero, torch.float16, rows), rounded), (k, n, rows)
        for rows in (1, 2, 16, 64):
            x = torch.randn(rows, k, generator=g).half()
            want = x.double() @ w.t()
            y = torch.ops.shardlm.int4_mm(x, words, scale, zero)
            assert y.dtype == torch.float16 and y.shape == (rows, n)
            assert torch.equal(torch.ops.shardlm.int4_mm(x, words, scale, zero), y)
            default = "gemv" if rows == 1 else int4.MM_FORM if rows <= int4.MM_PLANES_ROWS else "dequant"
            exact = default in ("gemv", "tiles") or (default == "planes" and group == 128)
            ref = want if exact else x.double() @ rounded.double().t()
            err = (y.double() - ref).abs()
            # fp16's rounding of the result (half a unit in the last place: 2^-11 of it) and fp32's sums
            assert (err <= ref.abs() * 2**-11 + 1e-3).all(), (k, n, rows, err.max().item())
            worst[rows] = max(worst.get(rows, 0.0), err.max().item())
            for form, bm, bn, warps in launches if rows > 1 else ():
                if bm > max(16, rows):
                    continue
                y = int4.int4_mm(x, words, scale, zero, form, bm, bn, warps)
                exact = form == "tiles" or (form == "planes" and group == 128)
                ref = want if exact else x.double() @ rounded.double().t()
                err = (y.double() - ref).abs()
                assert y.shape == (rows, n) and (err <= ref.abs() * 2**-11 + 1e-3).all(), (
                    form, bm, bn, k, n, rows, err.max().item())
                worst[form] = max(worst.get(form, 0.0), err.max().item())
            if rows == 1:
                for step in (16, 128):  # 1536 inputs: 192 rows of words, which steps of 128 do not divide
                    again = int4.int4_gemv(x, words, scale, zero, rows=step, warps=2)
                    assert ((again.double() - want).abs() <= want.abs() * 2**-11 + 1e-3).all(), (k, n, step)
        q = torch.randint(0, 16, (n, k), generator=g)
        ones = blocked(torch.ones(n, k // group, dtype=torch.float16))
        zeros = torch.zeros_like(ones, dtype=torch.uint8)
        for rows in (1, 16):
            y = torch.ops.shardlm.int4_mm(torch.ones(rows, k, dtype=torch.float16), pack(q), ones, zeros)
            # integer sums, exact in fp32, rounded once to fp16
            assert torch.equal(y, q.sum(1).half().expand(rows, n)), (k, rows)
        for form, bm, bn, warps in launches:
            for rows in (2, 64):
                y = int4.int4_mm(torch.ones(rows, k, dtype=torch.float16), pack(q), ones, zeros, form, bm, bn, warps)
                assert torch.equal(y, q.sum(1).half().expand(rows, n)), (form, bm, bn, k, rows)
    # K split: 2 tiles of 200 outputs (MM_BN 128) asked for 8 programs split 10 groups (or chunks of 128 inputs)
    # 3, 3, 3, 1; 320 inputs in groups of 64: 5 groups split 2, 2, 1, or 3 chunks of 128 (the last half full)
    # 1, 1, 1; 1280 in groups of 64: 20 groups 5 each, or 10 chunks of two groups each 3, 3, 3, 1
    assert int4.MM_BN == 128
    int4.MM_PROGRAMS = 8
    for k, group in ((1280, 128), (320, 64), (1280, 64)):
        words, scale, zero = quantize_weight(torch.randn(200, k, generator=g).half(), group)
        x = torch.randn(5, k, generator=g).half()
        for form in ("tiles", "planes"):
            exact = form == "tiles" or group == 128
            want = x.double() @ dequantize(words, scale, zero, torch.float64 if exact else torch.float16).double().t()
            err = (int4.int4_mm(x, words, scale, zero, form).double() - want).abs()
            assert (err <= want.abs() * 2**-11 + 1e-3).all(), (form, k, err.max().item())
    print("max abs error against the fp64 product, by rows (the op) and by form:", worst)


@pytest.mark.timeout(240)
def test_int4_kernels_in_tritons_interpreter():
    from helpers import run_in_tritons_interpreter
    print(run_in_tritons_interpreter("test_int4", "check_kernels_interpreted"))


@pytest.mark.timeout(240)
def test_adapters_per_request_over_int4_weights(tmp_path):
    """serve's adapters over --quantize int4: the engine sizes each adapter by the layers' in_features and
    out_features (int4's packed weight is [out/8, in/8, 8]); the adapter's rows change, the base's do not."""
    peft = pytest.importorskip("peft")
    from helpers import hf_model, save_hf
    from shardlm.inference import Engine, Request, load_pretrained
    from shardlm.inference.quantize import quantize
    save_hf("llama", tmp_path / "hf")
    torch.manual_seed(10)  # init_lora_weights=False: random A and B, so the adapter changes the model
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                           init_lora_weights=False)
    peft.get_peft_model(hf_model("llama"), lora).save_pretrained(tmp_path / "lora")
    model, _, _ = load_pretrained(tmp_path / "hf")
    assert quantize(model, "int4") == 8
    prompt = list(range(3, 12))
    alone = Engine(model, 2, 32, compile=False).run([Request(prompt, 8)])[0].tokens
    engine = Engine(model, 2, 32, compile=False)
    engine.add_adapter("lora", tmp_path / "lora")
    base, adapted = engine.run([Request(prompt, 8), Request(prompt, 8, adapter="lora")])
    assert base.tokens == alone and adapted.tokens != alone
