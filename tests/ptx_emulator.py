"""A bit-exact emulator of the few PTX instructions in inference/int4.py's and int8.py's inline asm, for checking
their arithmetic on a machine without a GPU: each packed half rounded once to nearest even (subnormals kept, as
PTX's .rn without .ftz does), computed exactly in rationals first, so no double rounding hides a wrong bit.
Scalars only: slow, but every edge case of a word can be enumerated. Signed zeros come out as +0 (the kernels
only sum them). `asm_blocks(path)` reads a module's asm strings from its source, so the emulator runs the
shipped text, not a copy of it."""
from __future__ import annotations

import math
import re
from fractions import Fraction
from pathlib import Path

# (significand bits with the hidden one, least normal exponent, largest exponent, exponent bits)
BF16, F16, F32 = (8, -126, 127, 8), (11, -14, 15, 5), (24, -126, 127, 8)
MASK = 0xFFFFFFFF


def decode(bits: int, fmt) -> Fraction | float:
    p, emin, emax, ebits = fmt
    width = p + ebits
    sign = -1 if bits >> (width - 1) & 1 else 1
    e = bits >> (p - 1) & ((1 << ebits) - 1)
    m = bits & ((1 << (p - 1)) - 1)
    if e == (1 << ebits) - 1:
        return sign * math.inf if m == 0 else math.nan
    if e == 0:
        return sign * Fraction(m) * Fraction(2) ** (emin - p + 1)
    return sign * Fraction(m + (1 << (p - 1))) * Fraction(2) ** (e - emax - p + 1)


def round_to(v, fmt):
    """v (a Fraction, or a float inf/nan) rounded to nearest even in `fmt`: a Fraction, or inf/nan."""
    if isinstance(v, float):
        return v
    p, emin, emax, _ = fmt
    if v == 0:
        return Fraction(0)
    a = abs(v)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    quantum = Fraction(2) ** (max(e, emin) - p + 1)
    n = a / quantum
    whole = n.numerator // n.denominator
    rest = n - whole
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and whole % 2):
        whole += 1
    r = whole * quantum
    if r >= Fraction(2) ** (emax + 1):
        return math.copysign(math.inf, v)
    return r if v > 0 else -r


def encode(v, fmt) -> int:
    p, emin, emax, ebits = fmt
    width = p + ebits
    if isinstance(v, float) and math.isnan(v):
        return (1 << (width - 1)) - 1  # PTX's canonical NaN
    sign = (1 << (width - 1)) if v < 0 else 0
    if isinstance(v, float):
        return sign | (((1 << ebits) - 1) << (p - 1))
    a = abs(v)
    if a == 0:
        return 0
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    if e < emin:
        m = a / Fraction(2) ** (emin - p + 1)
        assert m.denominator == 1, "not representable"
        return sign | int(m)
    m = a / Fraction(2) ** (e - p + 1)
    assert m.denominator == 1, "not representable"
    return sign | (e + emax) << (p - 1) | (int(m) - (1 << (p - 1)))


def _op(kind: str, args):
    if any(isinstance(a, float) for a in args):
        f = [float(a) for a in args]
        return {"add": lambda: f[0] + f[1], "mul": lambda: f[0] * f[1],
                "fma": lambda: f[0] * f[1] + f[2]}[kind]()
    return {"add": lambda: args[0] + args[1], "mul": lambda: args[0] * args[1],
            "fma": lambda: args[0] * args[1] + args[2]}[kind]()


def packed(kind: str, fmt, regs):
    """An x2 instruction: each 16-bit half computed exactly, rounded once."""
    out = 0
    for shift in (0, 16):
        args = [decode(r >> shift & 0xFFFF, fmt) for r in regs]
        out |= encode(round_to(_op(kind, args), fmt), fmt) << shift
    return out


def prmt(a: int, b: int, sel: int) -> int:
    data = (b << 32) | a  # bytes 0-3 from a, 4-7 from b
    out = 0
    for i in range(4):
        s = sel >> (4 * i) & 0xF
        byte = data >> (8 * (s & 7)) & 0xFF
        if s & 8:  # sign replication
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def lop3(a: int, b: int, c: int, lut: int) -> int:
    out = 0
    for i in range(8):
        if lut >> i & 1:
            out |= (a if i & 4 else ~a) & (b if i & 2 else ~b) & (c if i & 1 else ~c)
    return out & MASK


def asm_blocks(path: Path) -> list[str]:
    """The inline asm strings of a source file, in order."""
    return re.findall(r'asm="""(\{.*?\})"""', Path(path).read_text(), re.S)


def run(asm: str, inputs: list[int]) -> int:
    """The asm's $0 for 32-bit inputs $1..$n."""
    regs = {f"${i + 1}": v & MASK for i, v in enumerate(inputs)}

    def val(tok: str) -> int:
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        if tok.startswith("0f"):
            return int(tok[2:], 16)
        return int(tok, 0) & MASK

    body = asm.strip()[1:-1]
    for line in body.split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        if op == "mov.b32" and "{" in rest:
            if rest.lstrip().startswith("{"):  # mov.b32 {lo, hi}, a
                pair, src = rest.split("}")
                lo, hi = (t.strip() for t in pair.strip(" {").split(","))
                v = val(src.strip(" ,"))
                regs[lo], regs[hi] = v & 0xFFFF, v >> 16
            else:  # mov.b32 d, {lo, hi}
                d, pair = rest.split(",", 1)
                lo, hi = (t.strip() for t in pair.strip(" {}").split(","))
                regs[d.strip()] = (val(hi) << 16 | val(lo)) & MASK
            continue
        ops = [t.strip() for t in rest.split(",")]
        d, a = ops[0], [val(t) for t in ops[1:]]
        if op == "mov.b32":
            r = a[0]
        elif op == "lop3.b32":
            r = lop3(*a)
        elif op == "shr.u32":
            r = a[0] >> a[1]
        elif op == "xor.b32":
            r = a[0] ^ a[1]
        elif op == "prmt.b32":
            r = prmt(*a)
        elif op in ("add.rn.f16x2", "mul.rn.f16x2", "fma.rn.f16x2", "fma.rn.bf16x2"):
            r = packed(op.split(".")[0], F16 if "f16x2" in op and "bf16" not in op else BF16, a)
        elif op == "cvt.f32.f16":
            r = encode(decode(a[0] & 0xFFFF, F16), F32)
        elif op in ("add.rn.f32", "mul.rn.f32"):
            r = encode(round_to(_op(op.split(".")[0], [decode(v, F32) for v in a]), F32), F32)
        elif op == "cvt.rn.f16x2.f32":  # d's upper half from a, its lower from b
            hi, lo = (encode(round_to(decode(v, F32), F16), F16) for v in a)
            r = hi << 16 | lo
        else:
            raise NotImplementedError(op)
        regs[d] = r & MASK
    return regs["$0"]


def to_bits(x: float, fmt) -> int:
    """x (a Python float, exact in fmt) as fmt's bits."""
    if math.isinf(x) or math.isnan(x):
        return encode(x, fmt)
    v = Fraction(x)
    assert round_to(v, fmt) == v, f"{x} is not exact in this format"
    return encode(v, fmt)


def value(bits: int, fmt) -> float:
    return float(decode(bits, fmt))
