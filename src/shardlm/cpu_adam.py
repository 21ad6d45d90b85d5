"""The CPU AdamW of optimizer offload as one pass of C (ZeRO-Offload's CPU-Adam: Ren et al. 2021, section 5.1;
DeepSpeed's `cpu_adam` is its implementation). Each element's gradient (times the unscale/clip factor),
fp32 master and two moments are read once, the three written back and the rounded 16-bit weight written
beside them, while the four are in registers: torch's fused CPU AdamW makes the same update but leaves the
16-bit copy to a second pass over the masters. The update is memory-bound, so that pass is most of what
separates the two (bench/offload_step.py times both and DeepSpeedCPUAdam). Beta1 above one half only
(torch's lerp takes another form otherwise): kernels.adamw_master_step uses torch's kernel there.
Offload's optimizer uses these passes (each rank updates its own shard); a replicated update keeps torch's
kernels, so that ranks whose machines build differently still agree.

The source is compiled at first use with the system's C compiler for this machine's CPU (`-march=native`,
OpenMP), into a cache directory keyed by the source, the flags and the CPU, and loaded with ctypes (which
releases the GIL for the call). Without a compiler, or with SHARDLM_CPU_ADAM=torch, `load()` returns None
and the caller uses torch's kernel. The math is torch's fused AdamW, operation for operation in fp32 with
the same fused multiply-adds: measured, the two agree to the bit on all but a few elements in a million
(torch's scalar tail, which rounds once more), and those by one rounding.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline uint16_t round_to_bf16(float f) {  /* round to nearest even, as torch's bfloat16 cast */
    uint32_t b;
    memcpy(&b, &f, 4);
    if ((b & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  /* NaN */
    return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

/* m = m + c1 (g - m); v = b2 v + c2 g^2; p = p decay - step_size m / (sqrt(v) / bc2_sqrt + eps), g = grad * scale
   (c1 = 1 - b1, c2 = 1 - b2, decay = 1 - lr wd, step_size = lr / bc1); `out` (may be NULL) gets p in bf16.
   The operations of torch's fused CPU AdamW as its build contracts them into fused multiply-adds. */
void adamw_step(float *restrict p, const float *restrict grad, float *restrict m, float *restrict v,
                uint16_t *restrict out, int64_t n, float scale, float beta2, float c1, float c2, float eps,
                float decay, float step_size, float bc2_sqrt, int threads) {
    const int64_t block = 1 << 14;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t start = 0; start < n; start += block) {
        const int64_t end = start + block < n ? start + block : n;
        #pragma omp simd
        for (int64_t i = start; i < end; i++) {
            const float g = grad[i] * scale;
            const float mi = fmaf(c1, g - m[i], m[i]);  /* torch's lerp, for a weight below one half */
            const float vi = fmaf(c2 * g, g, v[i] * beta2);
            const float pi = p[i] * decay + (-step_size * mi) / (sqrtf(vi) / bc2_sqrt + eps);
            m[i] = mi;
            v[i] = vi;
            p[i] = pi;
            if (out) out[i] = round_to_bf16(pi);
        }
    }
}

/* partial[k] = sum of x[i]^2 over block k (BLOCK elements), accumulated in double: the blocks do not depend
   on the thread count, so neither does the sum of the partials taken in order. */
#define SQUARES_BLOCK 16384
void sum_squares(const float *restrict x, int64_t n, double *restrict partial, int threads) {
    const int64_t blocks = (n + SQUARES_BLOCK - 1) / SQUARES_BLOCK;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t k = 0; k < blocks; k++) {
        const int64_t start = k * SQUARES_BLOCK, end = start + SQUARES_BLOCK < n ? start + SQUARES_BLOCK : n;
        double acc = 0.0;
        #pragma omp simd reduction(+:acc)
        for (int64_t i = start; i < end; i++) acc += (double)x[i] * (double)x[i];
        partial[k] = acc;
    }
}

/* dst = (write ? 0 : dst) + src, src bf16 (a gradient shard fresh from the GPU), in one pass; with `partial`,
   also the block partial sums of the result's squares, as sum_squares takes them. */
void fold_bf16(float *restrict dst, const uint16_t *restrict src, int64_t n, int write, double *restrict partial,
               int threads) {
    const int64_t blocks = (n + SQUARES_BLOCK - 1) / SQUARES_BLOCK;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t k = 0; k < blocks; k++) {
        const int64_t start = k * SQUARES_BLOCK, end = start + SQUARES_BLOCK < n ? start + SQUARES_BLOCK : n;
        double acc = 0.0;
        #pragma omp simd reduction(+:acc)
        for (int64_t i = start; i < end; i++) {
            uint32_t bits = (uint32_t)src[i] << 16;
            float g;
            memcpy(&g, &bits, 4);
            const float d = write ? g : dst[i] + g;
            dst[i] = d;
            acc += (double)d * (double)d;
        }
        if (partial) partial[k] = acc;
    }
}
"""
SQUARES_BLOCK = 16384
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC"]


def _target(cc: str) -> str:
    """What -march=native compiles for on this machine: the compiler's own answer (its version and the
    resolved target options), else the CPU's description; with the architecture's name either way."""
    parts = [platform.machine()]
    for args in (["--version"], ["-march=native", "-Q", "--help=target"]):
        try:
            parts.append(subprocess.run([cc, *args], capture_output=True, text=True, timeout=30).stdout)
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        keep = ("model name", "flags", "Features", "CPU implementer", "CPU part")
        lines = [line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith(keep)]
        parts.extend(dict.fromkeys(lines))  # once each: the first core's lines
    except OSError:
        parts.append(platform.processor())
    return "\n".join(parts)


def _cache_dirs() -> list[Path]:
    """Where the library is built and kept: $SHARDLM_CACHE, else the user's cache, then the temp directory
    (a read-only home)."""
    if os.environ.get("SHARDLM_CACHE"):
        return [Path(os.environ["SHARDLM_CACHE"])]
    home = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
    return [Path(home) / "shardlm", Path(tempfile.gettempdir()) / f"shardlm-{os.getuid()}"]


def _build(cc: str, lib_path: Path) -> None:
    lib_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib_path.parent) as tmp:
        src, built = Path(tmp) / "cpu_adam.c", Path(tmp) / "cpu_adam.so"
        src.write_text(SOURCE)
        done = subprocess.run([cc, *FLAGS, str(src), "-o", str(built)], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise OSError(f"{cc} failed: {done.stderr.strip()[-500:]}")
        os.replace(built, lib_path)  # atomic: ranks building at once each install a whole file


@functools.lru_cache(maxsize=1)
def load():
    """The compiled library (`adamw_step`, `sum_squares`, `fold_bf16`), or None (no C compiler, a failed
    build, or SHARDLM_CPU_ADAM=torch). Built once per machine and cached; a cached file that does not load
    (another machine's, a damaged one) is built again."""
    if os.environ.get("SHARDLM_CPU_ADAM", "") == "torch":
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    key = hashlib.sha256("\0".join([SOURCE, cc, *FLAGS, _target(cc)]).encode()).hexdigest()[:16]
    errors = []
    for directory in _cache_dirs():
        lib_path = directory / f"cpu_adam-{key}.so"
        for attempt in range(2):
            try:
                if attempt or not lib_path.exists():
                    _build(cc, lib_path)
                lib = ctypes.CDLL(str(lib_path))
                break
            except (OSError, subprocess.SubprocessError) as e:
                errors.append(str(e))
        else:
            continue
        break
    else:
        warnings.warn(f"shardlm: the compiled CPU AdamW did not build ({errors[-1]}); using torch's kernels",
                      stacklevel=2)
        return None
    lib.adamw_step.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] + [ctypes.c_float] * 8 + [ctypes.c_int]
    lib.adamw_step.restype = None
    lib.sum_squares.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    lib.sum_squares.restype = None
    lib.fold_bf16.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p,
                              ctypes.c_int]
    lib.fold_bf16.restype = None
    return lib


def _check(what: str, t: torch.Tensor, dtype: torch.dtype, n: int) -> None:
    """The C code reads raw memory: only contiguous CPU tensors of the dtype and size it assumes reach it."""
    if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous() or t.numel() != n:
        raise ValueError(f"cpu_adam: {what} must be a contiguous {dtype} CPU tensor of {n} elements, "
                         f"not {t.dtype} on {t.device} of {t.numel()}{'' if t.is_contiguous() else ', strided'}")


def fold_bf16(lib, dst: torch.Tensor, src: torch.Tensor, write: bool, squares: bool) -> torch.Tensor | None:
    """dst (+)= src in one pass (fp32 `dst`, bf16 `src`, contiguous CPU tensors); with `squares`, the result's
    sum of squares as sum_squares takes it (0-dim fp32), else None."""
    _check("dst", dst, torch.float32, dst.numel())
    _check("src", src, torch.bfloat16, dst.numel())
    partial = torch.zeros(max(1, -(-dst.numel() // SQUARES_BLOCK)), dtype=torch.float64) if squares else None
    if dst.numel():
        lib.fold_bf16(dst.data_ptr(), src.data_ptr(), dst.numel(), int(write),
                      None if partial is None else partial.data_ptr(), torch.get_num_threads())
    return None if partial is None else partial.sum().float()


def sum_squares(lib, x: torch.Tensor) -> torch.Tensor:
    """sum(x^2) of a contiguous fp32 CPU tensor as a 0-dim fp32 tensor, by blocks in double (deterministic)."""
    _check("x", x, torch.float32, x.numel())
    partial = torch.zeros(max(1, -(-x.numel() // SQUARES_BLOCK)), dtype=torch.float64)
    if x.numel():
        lib.sum_squares(x.data_ptr(), x.numel(), partial.data_ptr(), torch.get_num_threads())
    return partial.sum().float()


def adamw_step(lib, master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               out: torch.Tensor | None, *, scale: float, lr: float, beta1: float, beta2: float, eps: float,
               weight_decay: float, bc1: float, bc2: float) -> None:
    """One step of the compiled kernel (`lib` from load()) over contiguous fp32 CPU tensors; `out`: bf16 or None.
    torch's lerp for the first moment takes this form for 1 - beta1 below one half: beta1 > 0.5 only."""
    n = master.numel()
    for what, t in (("master", master), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        _check(what, t, torch.float32, n)
    if out is not None:
        _check("out", out, torch.bfloat16, n)
    if not beta1 > 0.5:
        raise ValueError(f"cpu_adam: beta1 = {beta1}: the compiled pass serves beta1 > 0.5")
    # The coefficients in double, each rounded to fp32 once, as torch's kernel takes them.
    lib.adamw_step(master.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
                   None if out is None else out.data_ptr(), n, scale, beta2, 1 - beta1, 1 - beta2, eps,
                   1 - lr * weight_decay, lr / bc1, bc2 ** 0.5, torch.get_num_threads())
