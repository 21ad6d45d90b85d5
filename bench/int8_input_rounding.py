"""What int8's f16x2 one-row GEMV (inference/int8.py) costs in accuracy at small inputs, on the CPU: its
arithmetic emulated in numpy's fp16 (inputs rounded to fp16, each byte over 256 times its input rounded, plus
its neighbour's product rounded, the halves summed in fp32; tests/test_quant_asm.py checks that arithmetic
against the shipped asm bit for bit), for normal inputs of several magnitudes, against the fp64 product of the
dequantised weight; beside it the first form's (inputs times 2^-10 in fp16, the bytes as they are), the output's
own rounding and int8's rounding of the weight. Statistics only (numpy adds the second product in fp32 before
rounding: rarely a different last bit from the fused HFMA2).

    python bench/int8_input_rounding.py [--k 4096] [--n 512]
"""
from __future__ import annotations

import argparse

import numpy as np
import torch


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--n", type=int, default=512)
    a = p.parse_args()
    k, n = a.k, a.n
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.02
    scale = np.abs(w).max(1) / 127.5
    q = np.clip(np.round(w / scale[:, None]), -128, 127).astype(np.int8)
    deq = q.astype(np.float64) * scale[:, None].astype(np.float64)
    qq = q.reshape(n, k // 4, 4).astype(np.float16)

    def half2(x, x_scale, w_scale):
        xs = (x.astype(np.float32) * np.float32(x_scale)).astype(np.float16).reshape(k // 4, 4)
        ws = (qq * np.float16(w_scale)).astype(np.float16)  # exact: a byte times a power of two
        halves = []
        for a0, a1 in ((0, 1), (2, 3)):
            first = (ws[..., a0] * xs[:, a0]).astype(np.float16)
            halves.append((ws[..., a1].astype(np.float32) * xs[:, a1] + first).astype(np.float16))
        total = (halves[0].astype(np.float32) + halves[1].astype(np.float32)).astype(np.float64).sum(1)
        return total * scale / (x_scale * w_scale)

    def rel(err, ref):
        return np.sqrt((err**2).mean() / (ref**2).mean())

    for dtype in (torch.bfloat16, torch.float16):
        for sigma in (1.0, 0.1, 0.03, 0.01, 3e-3, 1e-3, 1e-4):
            x = torch.tensor(rng.standard_normal(k) * sigma).to(dtype).double().numpy()
            ref = deq @ x
            own = torch.tensor(ref).to(dtype).double().numpy() - ref
            now, first = half2(x, 1.0, 2.0**-8), half2(x, 2.0**-10, 1.0)
            print(f"{str(dtype)[6:]} inputs of rms {sigma:g}: f16x2 error {rel(now - ref, ref):.2e} of the output "
                  f"(the first form's {rel(first - ref, ref):.2e}), its own rounding {rel(own, ref):.2e}, int8's of "
                  f"the weight {rel(w @ x - ref, ref):.2e}")


if __name__ == "__main__":
    main()
