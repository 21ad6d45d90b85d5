"""The inline PTX of inference/int4.py's and int8.py's one-row GEMVs, run bit for bit by tests/ptx_emulator.py on
the CPU (no GPU, no triton): the shipped asm text, fed as the kernels feed it (their packing of inputs and zero
points mirrored here), against the arithmetic their comments state."""
import math
import random
from fractions import Fraction
from pathlib import Path

import pytest
from ptx_emulator import BF16, F16, F32, asm_blocks, decode, encode, round_to, run, to_bits, value

SRC = Path(__file__).resolve().parent.parent / "src" / "shardlm" / "inference"
MASK = 0xFFFFFFFF


def int4_asm() -> str:
    (asm,) = asm_blocks(SRC / "int4.py")
    return asm


def int8_asms() -> tuple[str, str]:
    dot, half_pair = asm_blocks(SRC / "int8.py")
    return dot, half_pair


def int4_dot8(asm: str, word: int, x: list[int], zero: int) -> tuple[int, int]:
    """_int4_gemv_kernel's BF16X2 branch for one word: x the 8 inputs' bf16 bits; the two bf16 halves' bits."""
    xw = [x[0] | x[1] << 16, x[2] | x[3] << 16, x[4] | x[5] << 16, x[6] | x[7] << 16]  # little-endian words
    x01, x23, x45, x67 = xw
    x04 = (x45 << 16 | x01 & 0xFFFF) & MASK
    x15 = (x45 & 0xFFFF0000) | (x01 >> 16 & 0xFFFF)
    x26 = (x67 << 16 | x23 & 0xFFFF) & MASK
    x37 = (x67 & 0xFFFF0000) | (x23 >> 16 & 0xFFFF)
    zero2 = (zero | 0xC300) * 65537 & MASK
    dot = run(asm, [word, x04, x15, x26, x37, zero2])
    return dot & 0xFFFF, dot >> 16


def nibbles(word: int) -> list[int]:
    return [word >> (4 * j) & 15 for j in range(8)]


def bf16_chain(terms) -> Fraction:
    """The documented arithmetic of a half: the running sum rounded to bf16 after each product."""
    acc = Fraction(0)
    for q, x in terms:
        acc = round_to(q * x + acc, BF16)
    return acc


def test_int4_every_nibble_at_every_place_less_every_zero_point_is_exact():
    """Each value 0..15 at each of a word's 8 places, each zero point 0..15, x one-hot at that place (1, and
    -3.5): the halves hold exactly (q - zero) x, at the half that pairs the place (places 0-3 low, 4-7 high)."""
    asm = int4_asm()
    for j in range(8):
        for q in range(16):
            word = (0x5A3C1E7B & ~(15 << 4 * j)) | q << 4 * j  # other nibbles set: they must not leak
            for zero in range(16):
                for xv in (1.0, -3.5):
                    x = [0] * 8
                    x[j] = to_bits(xv, BF16)
                    lo, hi = int4_dot8(asm, word, x, zero)
                    got, other = (value(lo, BF16), value(hi, BF16))[::1 if j < 4 else -1]
                    assert got == (q - zero) * xv and other == 0, (j, q, zero, xv, got, other)


def random_bf16(rng: random.Random, lo: int, hi: int) -> int:
    """A random finite bf16 of exponent in [lo, hi), either sign."""
    while True:
        bits = rng.getrandbits(16)
        v = decode(bits, BF16)
        if isinstance(v, Fraction) and v != 0 and lo <= math.floor(math.log2(abs(v))) < hi:
            return bits


@pytest.mark.parametrize("lo, hi", [(-3, 3), (-40, 40), (-133, -120), (100, 120)])
def test_int4_halves_are_the_documented_bf16_chain(lo, hi):
    """Random words, zero points and inputs (ordinary, widely spread, bf16-subnormal, and as large as the products
    stay finite): each half is the running sum of (q_j - zero) x_j rounded to bf16 after each product, bit for
    bit, and within 4 roundings (2^-6) of the sum of the products' magnitudes of the exact sum."""
    asm = int4_asm()
    rng = random.Random(lo * 1000 + hi)
    for _ in range(300):
        word, zero = rng.getrandbits(32), rng.randrange(16)
        x = [random_bf16(rng, lo, hi) for _ in range(8)]
        xs = [decode(b, BF16) for b in x]
        q = nibbles(word)
        halves = int4_dot8(asm, word, x, zero)
        for half, places in zip(halves, (range(4), range(4, 8))):
            terms = [(q[j] - zero, xs[j]) for j in places]
            want = bf16_chain(terms)
            assert value(half, BF16) == float(want), (hex(word), zero, [float(v) for v in xs])
            exact = sum(a * b for a, b in terms)
            mags = sum(abs(a * b) for a, b in terms)
            assert abs(want - exact) <= mags * Fraction(1, 64) + Fraction(2) ** -133


def int8_dot4(word: int, x: list[float], asms) -> int:
    """_int8_gemv_kernel's HALF2 branch for one word: x the 4 inputs (fp32 values); the fp32 bits it adds."""
    dot, half_pair = asms
    x02 = run(half_pair, [to_bits(x[0], F32), to_bits(x[2], F32)])
    x13 = run(half_pair, [to_bits(x[1], F32), to_bits(x[3], F32)])
    return run(dot, [word, x02, x13])


def int8_documented(word: int, x: list[float]):
    """int8.py's stated arithmetic: x rounded to fp16, bytes (0, 2) over 256 times (x0, x2) rounded, plus bytes
    (1, 3) over 256 times (x1, x3) rounded, the halves' sum in fp32."""
    w = [(word >> (8 * i) & 0xFF) - (256 if word >> (8 * i) & 0x80 else 0) for i in range(4)]
    xs = [round_to(Fraction(v), F16) for v in x]
    halves = []
    for a, b in ((0, 1), (2, 3)):
        p = round_to(Fraction(w[a], 256) * xs[a], F16) if not isinstance(xs[a], float) else w[a] * xs[a]
        s = (round_to(Fraction(w[b], 256) * xs[b] + p, F16) if not any(isinstance(v, float) for v in (xs[b], p))
             else w[b] * xs[b] + p)
        halves.append(s)
    if any(isinstance(h, float) for h in halves):
        return float(halves[0]) + float(halves[1])
    return round_to(halves[0] + halves[1], F32)


def test_int8_every_byte_at_every_place_is_exact():
    """Each byte value -128..127 at each of a word's 4 places, x one-hot (1, -2.5, 4096: products exact in fp16):
    the word's sum is exactly w x / 256, the other bytes (set) contributing nothing."""
    asms = int8_asms()
    for i in range(4):
        for w in range(-128, 128):
            word = (0x9C3F81E5 & ~(0xFF << 8 * i)) | (w & 0xFF) << 8 * i
            for xv in (1.0, -2.5, 4096.0):
                x = [0.0] * 4
                x[i] = xv
                got = value(int8_dot4(word, x, asms), F32)
                assert got == w * xv / 256, (i, w, xv, got)


@pytest.mark.parametrize("scale", [1.0, 1e-3, 3e4, 2.0**-20])
def test_int8_words_are_the_documented_f16x2_arithmetic(scale):
    """Random words and inputs of several magnitudes (fp16-subnormal, and near fp16's largest): the asm's fp32
    result, bit for bit, is the stated arithmetic."""
    asms = int8_asms()
    rng = random.Random(int(scale * 1e6) + 7)
    for _ in range(300):
        word = rng.getrandbits(32)
        x = [float(round_to(Fraction(rng.gauss(0, scale)), BF16)) for _ in range(4)]  # a bf16 model's inputs
        got = value(int8_dot4(word, x, asms), F32)
        want = int8_documented(word, x)
        assert got == float(want) or (math.isnan(got) and math.isnan(float(want))), (hex(word), x, got, want)


def test_int8_inputs_within_fp16s_range_stay_finite():
    """|x| up to bf16's largest below fp16's 65504 (65280) with every weight -128 (each product -x / 2, each
    word's two-term sum -x): finite; past fp16's range (2^16) an input itself is inf in fp16."""
    asms = int8_asms()
    word = 0x80808080
    assert math.isfinite(value(int8_dot4(word, [65280.0] * 4, asms), F32))
    assert math.isfinite(value(int8_dot4(word, [-65280.0] * 4, asms), F32))
    assert math.isinf(value(int8_dot4(word, [2.0**16] * 4, asms), F32))


def test_emulator_rounds_to_nearest_even():
    """The emulator itself: ties to even, subnormals kept, overflow to inf, against numpy's fp16 for a sweep."""
    np = pytest.importorskip("numpy")
    rng = random.Random(3)
    for _ in range(2000):
        v = rng.uniform(-7e4, 7e4) * 2.0 ** rng.randint(-30, 0)
        with np.errstate(over="ignore"):
            want = float(np.float16(np.float64(v)))  # numpy rounds float64 to fp16 once, to nearest even
        got = round_to(Fraction(v), F16)
        assert float(got) == want, v
        if math.isfinite(want):
            assert encode(got, F16) == int(np.float16(want).view(np.uint16))
    assert round_to(Fraction(1) + Fraction(1, 256), BF16) == 1  # a tie: to the even significand
    assert round_to(Fraction(1) + Fraction(3, 256), BF16) == Fraction(1) + Fraction(1, 64)


# ---- which GPUs take the packed asm ---------------------------------------------------------------------------

def test_packed_asm_only_on_sm80_and_later(monkeypatch):
    """cvt.rn.f16x2.f32 and the bf16x2 FMAs are sm_80's: a T4 (7.5) or a V100 (7.0) takes the GEMVs' fp32 forms,
    an A100 or H100 the packed ones; a CPU tensor never (Triton's interpreter runs no asm)."""
    from types import SimpleNamespace

    import torch

    from shardlm import kernels
    for capability, want in (((7, 0), False), ((7, 5), False), ((8, 0), True), ((8, 6), True), ((9, 0), True)):
        kernels._capability.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index, c=capability: c)
        assert kernels.packed_ok(SimpleNamespace(is_cuda=True, device=torch.device("cuda", 1))) is want, capability
    kernels._capability.cache_clear()
    assert not kernels.packed_ok(torch.zeros(1))


class Launch:
    """A kernel's stand-in: records the constexprs a launch passes."""

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.kwargs = kwargs
        return launch


@pytest.mark.parametrize("packed", [False, True])
def test_the_gemvs_take_packed_asm_only_where_packed_ok_says(monkeypatch, packed):
    """int8_gemv's HALF2 and int4_gemv's BF16X2 follow kernels.packed_ok (int4's also needs bf16 and an x at an
    address of 4 bytes, read as 32-bit pairs): before, any CUDA tensor took the asm, which a T4 cannot compile."""
    pytest.importorskip("triton")
    import torch

    from shardlm.inference import int4, int8
    from shardlm.inference.int4_format import quantize_weight
    monkeypatch.setattr(int8, "packed_ok", lambda t: packed)
    monkeypatch.setattr(int4, "packed_ok", lambda t: packed)
    monkeypatch.setattr(int8, "_int8_gemv_kernel", launch8 := Launch())
    monkeypatch.setattr(int4, "_int4_gemv_kernel", launch4 := Launch())
    int8.int8_gemv(torch.zeros(1, 64, dtype=torch.float16), torch.zeros(8, 64, dtype=torch.int8), torch.ones(8))
    assert launch8.kwargs["HALF2"] is packed
    words, scale, zero = quantize_weight(torch.randn(8, 64), 32)
    for dtype, offset in ((torch.bfloat16, 0), (torch.float16, 0), (torch.bfloat16, 1)):
        x = torch.zeros(65, dtype=dtype)[offset:offset + 64][None]
        int4.int4_gemv(x, words, scale.to(dtype), zero)
        assert launch4.kwargs["BF16X2"] is (packed and dtype == torch.bfloat16 and offset == 0), (dtype, offset)


def compiles_for(fn, signature: dict, constexprs: dict, capability: int) -> bool:
    """Whether Triton's ptxas takes `fn` for sm_<capability> (no GPU needed)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(signature.values()) if t.startswith("*")}
    try:
        triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                       target=GPUTarget("cuda", capability, 32), options=dict(num_warps=4, num_stages=2))
    except Exception as e:  # ptxas's refusal comes as a RuntimeError or triton's PTXASError by version
        assert "requires .target sm_80" in str(e), str(e)[-2000:]
        return False
    return True


@pytest.mark.timeout(240)
def test_the_packed_asm_needs_sm80_and_the_fp32_forms_do_not():
    """Compiled on the CPU by Triton's ptxas: for sm_75 the GEMVs' packed forms are refused (why packed_ok
    exists) and their fp32 forms compile; for sm_80 both do."""
    pytest.importorskip("triton.backends.nvidia")
    from shardlm.inference import int4, int8
    sig8 = {"x_ptr": "*fp16", "w_ptr": "*i8", "s_ptr": "*fp16", "y_ptr": "*fp16", "N": "i32", "sw": "i32",
            "magic": "i32", "K": "constexpr", "BN": "constexpr", "BK": "constexpr", "HALF2": "constexpr"}
    sig4 = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*u8", "y_ptr": "*bf16", "magic": "i32",
            "K": "constexpr", "G": "constexpr", "ROWS": "constexpr", "BF16X2": "constexpr"}
    for capability, packed_compiles in ((75, False), (80, True)):
        for packed in (False, True):
            want = packed_compiles or not packed
            assert compiles_for(int8._int8_gemv_kernel, sig8, dict(K=256, BN=8, BK=128, HALF2=packed),
                                capability) is want, ("int8", capability, packed)
            assert compiles_for(int4._int4_gemv_kernel, sig4, dict(K=256, G=128, ROWS=16, BF16X2=packed),
                                capability) is want, ("int4", capability, packed)


@pytest.mark.timeout(240)
def test_the_decode_kernels_wait_for_their_inputs_under_programmatic_dependent_launch():
    """kernels.pdl_launch's flag, compiled for sm_90 on the CPU: each decode kernel's PTX waits for the kernel
    before it (griddepcontrol.wait) ahead of its first load or store (of a weight apart), and lets the next one
    launch; without the flag neither appears."""
    pytest.importorskip("triton.backends.nvidia")
    import triton
    from triton.backends.compiler import GPUTarget
    from test_decode_attention import split_kernel_signature
    from triton.compiler import ASTSource

    from shardlm.inference import decode_attention as da
    from shardlm.inference import gemv_all_reduce_ll as ll
    from shardlm.inference import int4, int8, step_kernels
    from shardlm.model import gemv
    split = split_kernel_signature()
    kernels = [
        (gemv._gemv_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "sw": "i32"},
         dict(N=64, K=256, BN=4, BK=128)),
        (int8._int8_gemv_kernel, {"x_ptr": "*fp16", "w_ptr": "*i8", "s_ptr": "*fp16", "y_ptr": "*fp16", "N": "i32",
                                  "sw": "i32", "magic": "i32"}, dict(K=256, BN=8, BK=128, HALF2=True)),
        (int4._int4_gemv_kernel, {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*u8",
                                  "y_ptr": "*bf16", "magic": "i32"}, dict(K=256, G=128, ROWS=16, BF16X2=True)),
        (da._split_kernel, split, dict(HEADS=8, GROUP=2, D=64, SPLIT=da.SPLIT, BLOCK=da.BLOCK, FUSED=True,
                                       ROPE=True)),
        (da._combine_kernel, {"acc_ptr": "*fp32", "max_ptr": "*fp32", "sum_ptr": "*fp32", "y_ptr": "*bf16"},
         dict(SPLITS=8, BLOCK=16, D=64)),
        (ll._gemv_all_reduce_ll_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "buffers_ptr": "*i64",
                                         "epochs_ptr": "*i32", "status_ptr": "*i32", "sw": "i32"},
         dict(N=64, K=256, RANK=0, WORLD=2, BN=4, BK=128, PER=2, REDUCE=True, MAX_SPINS=1 << 30, STRONG=False)),
        (step_kernels._add_rms_norm_kernel, {"x_ptr": "*bf16", "d_ptr": "*bf16", "w_ptr": "*bf16", "sum_ptr": "*bf16",
                                             "h_ptr": "*bf16", "eps": "fp32"}, dict(K=4096, BLOCK=4096)),
        (step_kernels._silu_mul_kernel, {"h_ptr": "*bf16", "y_ptr": "*bf16"}, dict(F=11008, BLOCK=1024)),
    ]
    for fn, signature, constexprs in kernels:
        for pdl in (False, True):
            modes = {**constexprs, "PDL": pdl}
            sig = {**signature, **dict.fromkeys(modes, "constexpr")}
            attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t.startswith("*")}
            ptx = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=modes, attrs=attrs),
                                 target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4)).asm["ptx"]
            body = ptx[ptx.index(".entry"):]
            assert ("griddepcontrol.wait" in body) is pdl and ("griddepcontrol.launch_dependents" in body) is pdl
            if pdl:  # the norm's weight (no kernel writes it) is loaded before the wait
                ops = ("st.global",) if fn is step_kernels._add_rms_norm_kernel else ("ld.global", "st.global")
                first = min(body.find(op) for op in ops if op in body)
                assert body.index("griddepcontrol.wait") < first, fn.__name__
