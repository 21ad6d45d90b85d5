"""Fused GPU kernels (Triton) for the optimizer step over flat buffers, with identical PyTorch fallbacks.

`adamw_master_step` does in one pass what mixed-precision AdamW otherwise does in five (cast the 16-bit
gradient to fp32, unscale and clip it, update the moments, update the fp32 master, write the 16-bit
weight back): about 28 bytes of memory traffic per parameter instead of about 52. The unscale/clip
factor and the skip flag are device tensors, so a step never waits for the host. The math is torch's
AdamW (decoupled weight decay, bias-corrected moments); the fallback runs the same formulas with torch
ops, which is what CPU runs and what the GPU test compares the kernel against.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os

import torch

from . import cpu_adam

try:  # Triton ships with CUDA builds of PyTorch; CPU builds run the fallbacks
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

BLOCK = 4096


def on_device(t: torch.Tensor):
    """A context in which Triton's launches for `t` go to its GPU: Triton launches on the thread's current
    device, which need not be the tensors' (`generate --device cuda:1`, a second serving replica's thread: its
    kernels ran on cuda:0 with cuda:1's addresses). Nothing on the CPU (Triton's interpreter)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def triton_ok(t: torch.Tensor) -> bool:
    # SHARDLM_DISABLE_TRITON=1 forces the PyTorch fallbacks (for measuring what the kernels are worth).
    return triton is not None and t.is_cuda and os.environ.get("SHARDLM_DISABLE_TRITON", "0") != "1"


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def packed_ok(t: torch.Tensor) -> bool:
    """Whether `t`'s GPU can run the one-row int8/int4 GEMVs' packed asm: cvt.rn.f16x2.f32 and the bf16x2 FMAs
    are sm_80's, and ptxas refuses them for a T4 or a V100 (whose fp32 forms of the kernels compile). Cached
    per device: this is asked on every decode step's every product."""
    if not t.is_cuda:
        return False
    return _capability(torch.cuda.current_device() if t.device.index is None else t.device.index) >= (8, 0)


def pdl_launch(t: torch.Tensor) -> dict:
    """A decode kernel's launch options for `t`'s GPU: programmatic dependent launch where it has it (Hopper on,
    Triton's griddepcontrol ops): the kernel is launched while the previous one in the stream still runs and
    waits inside (wait_for_inputs, its first step) until that one has finished and its writes are visible, so
    that the launch and the start of its programs overlap the previous kernel's tail. {} elsewhere (and with
    SHARDLM_PDL=0)."""
    if not (t.is_cuda and gdc is not None and os.environ.get("SHARDLM_PDL", "1") != "0"):
        return {}
    index = torch.cuda.current_device() if t.device.index is None else t.device.index
    return {"PDL": True, "launch_pdl": True} if _capability(index) >= (9, 0) else {}


try:  # Triton's grid dependency control (3.4 on)
    from triton.language.extra.cuda import gdc
except ImportError:  # pragma: no cover - depends on the install
    gdc = None

if triton is not None:
    @triton.jit
    def wait_for_inputs(PDL: tl.constexpr):
        """A kernel's first step under pdl_launch, in every program before it reads or writes anything another
        kernel may touch (weights apart): wait for the previous kernel, then let the next one launch. Every
        program waits, so this kernel ends after the previous one, and a kernel launched the usual way after it
        finds both done."""
        if PDL:
            gdc.gdc_wait()
            gdc.gdc_launch_dependents()
else:  # pragma: no cover - depends on the install
    wait_for_inputs = None

if triton is not None:
    @triton.jit
    def _adamw_kernel(master_ptr, param_ptr, grad_ptr, m_ptr, v_ptr, n, scale_ptr, skip_ptr,
                      lr, beta1, beta2, eps, decay, step_size, inv_bc2_sqrt, table_ptr,
                      WRITE_PARAM: tl.constexpr, TABLE: tl.constexpr, BLOCK: tl.constexpr):
        if tl.load(skip_ptr) != 0:
            return
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        if TABLE > 0:  # weight decay only inside this block's TABLE intervals [a, b) (empty: a == b)
            row = table_ptr + tl.program_id(0).to(tl.int64) * (2 * TABLE)
            hit = offs < 0
            for k in tl.static_range(TABLE):
                hit = hit | ((offs >= tl.load(row + 2 * k)) & (offs < tl.load(row + 2 * k + 1)))
            decay = tl.where(hit, decay, 1.0)
        g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32) * tl.load(scale_ptr)
        # fp32 or bf16 (train.optimizer_dtype) masters and moments; the math is fp32 either way
        p = tl.load(master_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        p = p * decay
        m = m + (1.0 - beta1) * (g - m)
        v = beta2 * v + (1.0 - beta2) * g * g
        p = p - step_size * m / (tl.sqrt(v) * inv_bc2_sqrt + eps)
        tl.store(master_ptr + offs, p.to(master_ptr.dtype.element_ty), mask=mask)  # round to nearest (even)
        tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
        tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)
        if WRITE_PARAM:
            tl.store(param_ptr + offs, p.to(param_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _sum_rows_kernel(rows_ptr, own_ptr, out_ptr, n, ROWS: tl.constexpr, OWN: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(ROWS):
            if j == OWN:
                acc += tl.load(own_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            else:
                acc += tl.load(rows_ptr + j * n + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _sumsq_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        tl.store(out_ptr + tl.program_id(0), tl.sum(x * x, axis=0))


def sum_over_ranks(rows: torch.Tensor, own: torch.Tensor, rank: int, out: torch.Tensor) -> None:
    """out = the sum in fp32, in rank order, of rows[j] over the ranks j, with `own` standing in for
    rows[rank] (which is never read), rounded once to out's dtype; `out` may be `own`. One pass: a
    separate fp32 sum and a cast took four times as long, on the SMs that backward needs."""
    if triton_ok(out):
        n = out.numel()
        _sum_rows_kernel[(triton.cdiv(n, BLOCK),)](rows, own, out, n, ROWS=rows.shape[0], OWN=rank, BLOCK=BLOCK)
        return
    out.copy_(torch.stack([own if j == rank else rows[j] for j in range(rows.shape[0])]).sum(0, dtype=torch.float32))


def sum_of_squares(x: torch.Tensor) -> torch.Tensor:
    """sum(x^2) in fp32 as a 0-dim device tensor, deterministic (block partials, then one sum)."""
    partial = torch.empty(square_parts(x), device=x.device, dtype=torch.float32)
    sum_of_squares_into(x, partial)
    return partial.sum()


def square_parts(x: torch.Tensor) -> int:
    """How many partial sums `sum_of_squares_into` writes for x (their sum is sum(x^2))."""
    return triton.cdiv(x.numel(), BLOCK) if triton_ok(x) else 1


def sum_of_squares_into(x: torch.Tensor, out: torch.Tensor) -> None:
    """Write the square_parts(x) fp32 partial sums of x^2 into `out`, one per block of x: whoever sums them
    in a fixed order gets the same bits every time."""
    if x.numel() == 0:
        out.zero_()
    elif triton_ok(x):
        _sumsq_kernel[(out.numel(),)](x, out, x.numel(), BLOCK=BLOCK)
    else:
        # torch.sum sums pairwise on CPU (vector_norm there loses ~1e-6); a chunk at a time keeps the fp32
        # temporaries in cache instead of allocating (and page-faulting) two copies of a large gradient.
        chunk = 1 << 20
        out.copy_(torch.stack([c.float().pow(2).sum() for c in x.split(chunk)]).sum() if x.numel() > chunk
                  else x.float().pow(2).sum())


def adamw_master_step(master: torch.Tensor, param: torch.Tensor | None, grad: torch.Tensor,
                      exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, scale: torch.Tensor, skip: torch.Tensor,
                      *, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                      decay_table=None, consume_grad: bool = False, host_kernel: bool = False) -> None:
    """One AdamW step on fp32 `master` from `grad` x `scale` (any float dtype), unless `skip` is set;
    writes the rounded result to the 16-bit `param` when one is given. Step counts start at 1.
    `master`, `exp_avg` and `exp_avg_sq` may instead be bf16 (train.optimizer_dtype): each is read into fp32,
    updated in fp32 and rounded once to bf16 (`_lowp_step`; on the GPU the same kernel).
    `decay_table` (GPU only, from `decay_table()`): `weight_decay` applies only inside its intervals.
    `consume_grad`: an fp32 CPU `grad` may be left scaled in place, which saves a pass over it.
    `host_kernel`: on the CPU, cpu_adam.py's compiled pass where it builds (offload's optimizer, whose ranks each
    update their own shard; a replicated update keeps torch's kernel, the same on every rank)."""
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step
    if triton_ok(master):
        n = master.numel()
        _adamw_kernel[(triton.cdiv(n, BLOCK),)](
            master, param if param is not None else master, grad, exp_avg, exp_avg_sq, n, scale, skip,
            lr, beta1, beta2, eps, 1.0 - lr * weight_decay, lr / bc1, 1.0 / math.sqrt(bc2),
            decay_table if decay_table is not None else master,
            WRITE_PARAM=param is not None, TABLE=0 if decay_table is None else decay_table.shape[1],
            BLOCK=BLOCK)
        return
    if decay_table is not None:
        raise ValueError("adamw_master_step: a decay table needs the Triton kernel (CUDA tensors)")
    if bool(skip):
        return
    if _low_precision(master, exp_avg, exp_avg_sq):
        def update(p, g, m, v):
            p.mul_(1 - lr * weight_decay)
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            p.addcdiv_(m, v.sqrt().div_(math.sqrt(bc2)).add_(eps), value=-lr / bc1)
            return p, m, v
        _lowp_step(update, master, param, grad, scale, exp_avg, exp_avg_sq)
        return
    lib = cpu_adam.load() if host_kernel and master.device.type == "cpu" and grad.dtype == torch.float32 and \
        beta1 > 0.5 and (param is None or param.dtype == torch.bfloat16) else None
    if lib is not None and all(t.is_contiguous() for t in (master, grad, exp_avg, exp_avg_sq)) and \
            (param is None or param.is_contiguous()):
        # One pass that also writes the 16-bit weight (cpu_adam.py; bench/offload_step.py times it).
        cpu_adam.adamw_step(lib, master, grad, exp_avg, exp_avg_sq, param, scale=float(scale), lr=lr, beta1=beta1,
                            beta2=beta2, eps=eps, weight_decay=weight_decay, bc1=bc1, bc2=bc2)
        return
    fused = master.device.type == "cpu" and hasattr(torch, "_fused_adamw_")
    unscale = None  # the fused kernel divides the gradient by it as it reads it (in place)
    if fused and consume_grad and grad.dtype == torch.float32 and float(scale) != 1.0 and float(scale) > 1e-30:
        g, unscale = grad, (1.0 / scale.float()).reshape(())
    else:
        g = grad.float() * scale if (grad.dtype != torch.float32 or float(scale) != 1.0) else grad
    if fused:
        # The vectorised, multi-threaded kernel behind torch.optim.AdamW(fused=True) on the CPU: one pass
        # over the four tensors instead of six (bench/README.md times it against the ops below); it is what
        # makes optimizer offload usable. The step count is read, not incremented.
        torch._fused_adamw_([master], [g], [exp_avg], [exp_avg_sq], [], [torch.tensor(float(step))], lr=lr,
                            beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False,
                            maximize=False, grad_scale=unscale, found_inf=None)
    else:
        master.mul_(1 - lr * weight_decay)
        exp_avg.lerp_(g, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        master.addcdiv_(exp_avg, exp_avg_sq.sqrt().div_(math.sqrt(bc2)).add_(eps), value=-lr / bc1)
    if param is not None:
        param.copy_(master)


def decay_table(intervals: list[tuple[int, int]], n: int, device) -> torch.Tensor:
    """The elements [a, b) of a flat buffer of n that take weight decay, cut at the kernel's block
    boundaries: a (blocks, K, 2) int64 table of each block's intervals, K the most any block holds,
    unused rows (0, 0). The one-launch step over many buckets reads it; blocks stay aligned, so its
    loads stay vectorised (a table of unaligned chunks would not be: bench/README.md)."""
    blocks = -(-n // BLOCK)
    if not intervals:
        return torch.zeros(blocks, 1, 2, dtype=torch.int64, device=device)
    starts, ends = [], []
    for a, b in intervals:
        blk = torch.arange(a // BLOCK, (b - 1) // BLOCK + 1, dtype=torch.int64)
        starts.append(torch.clamp(blk * BLOCK, min=a))
        ends.append(torch.clamp((blk + 1) * BLOCK, max=b))
    starts, ends = torch.cat(starts), torch.cat(ends)
    blk = starts // BLOCK  # intervals come sorted, so their pieces are sorted by block
    slot = torch.arange(len(blk)) - torch.searchsorted(blk, blk)
    table = torch.zeros(blocks, int(slot.max()) + 1, 2, dtype=torch.int64)
    table[blk, slot, 0], table[blk, slot, 1] = starts, ends
    return table.to(device)


def _low_precision(*state: torch.Tensor) -> bool:
    return any(t.dtype != torch.float32 for t in state)


def _lowp_step(update, master: torch.Tensor, param: torch.Tensor | None, grad: torch.Tensor, scale: torch.Tensor,
               *state: torch.Tensor) -> None:
    """A step on 16-bit masters and states (train.optimizer_dtype bf16) the way the GPU kernel runs it: a chunk
    at a time, each read into fp32, `update(master, grad x scale, *state)` (fp32 tensors, updated in place or
    returned) and each result rounded once to its dtype (to nearest), not once per torch op."""
    factor = scale.float()
    chunk = 1 << 16 if master.device.type == "cpu" else 1 << 24  # the CPU's fp32 temporaries stay in cache
    for lo in range(0, master.numel(), chunk):
        sl = slice(lo, lo + chunk)
        g = grad[sl].float() * factor
        new = update(master[sl].float(), g, *(t[sl].float() for t in state))
        for t, v in zip((master, *state), new):
            t[sl].copy_(v)
        if param is not None:
            param[sl].copy_(master[sl])


def sgd_master_step(master: torch.Tensor, param: torch.Tensor | None, grad: torch.Tensor, momentum_buf: torch.Tensor,
                    scale: torch.Tensor, skip: torch.Tensor, *, step: int, lr: float, momentum: float,
                    weight_decay: float) -> None:
    """SGD with momentum as torch.optim.SGD (coupled weight decay; the first step seeds the buffer). bf16
    `master` and `momentum_buf` (train.optimizer_dtype): the step in fp32, each result rounded once."""
    if bool(skip):
        return
    if _low_precision(master, momentum_buf):
        def update(p, g, buf):
            if weight_decay:
                g = g.add(p, alpha=weight_decay)
            buf = g if step == 1 else buf.mul_(momentum).add_(g)
            return p.add_(buf, alpha=-lr), buf
        _lowp_step(update, master, param, grad, scale, momentum_buf)
        return
    g = grad.float() * scale
    if weight_decay:
        g = g.add(master, alpha=weight_decay)
    if step == 1:
        momentum_buf.copy_(g)
    else:
        momentum_buf.mul_(momentum).add_(g)
    master.add_(momentum_buf, alpha=-lr)
    if param is not None:
        param.copy_(master)
