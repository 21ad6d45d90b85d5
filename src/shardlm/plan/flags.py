"""Ranges of the planner's numeric flags that argparse's types do not check.

argparse takes `--gpu-tflops -5` and `--dp 0` as numbers; the planner then printed a negative step time, and
`--dp 0` became 1 through a falsy default. Each is refused here, naming the flag, its value and what it must be.
"""
from __future__ import annotations

import math

from .layout import PlanError

AT_LEAST_ONE = ("dp", "global_batch", "top", "layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "top_k")
FINITE = ("tokens", "price_per_gpu_hour", "params")


def check_numbers(a) -> None:
    for name in AT_LEAST_ONE:
        value = getattr(a, name, None)
        if value is not None and value < 1:
            raise PlanError(f"--{name.replace('_', '-')} {value} must be at least 1")
    if getattr(a, "experts", 0) < 0:
        raise PlanError(f"--experts {a.experts} must not be negative (0: a dense MLP)")
    for name in FINITE:
        value = getattr(a, name, None)
        if value is not None and not math.isfinite(value):
            raise PlanError(f"--{name.replace('_', '-')} {value} must be a finite number")
    tflops = getattr(a, "gpu_tflops", None)
    if tflops is not None and not (math.isfinite(tflops) and tflops > 0):
        raise PlanError(f"--gpu-tflops {tflops:g} must be a positive, finite number of TFLOP/s (the GPU's dense "
                        "16-bit peak)")
