"""The optimizer step with fp32 master weights, global-norm clipping and the learning-rate schedule.

`MasterWeightOptimizer` keeps an fp32 copy of the 16-bit parameters (one flat buffer, see flat.py) and
runs AdamW (Loshchilov & Hutter 2019) or SGD with momentum on it in one fused pass (kernels.py), as
mixed-precision training prescribes; in fp32 the parameters are their own masters. With
`train.optimizer_dtype = "bf16"` the masters and moments are bf16 (Megatron's precision-aware optimizer, HF's
pure-bf16 training): each update is computed in fp32 and rounded once to bf16, and bf16 parameters are their
own masters wherever the optimizer is not sharded. Gradients are unscaled, clipped by the global L2 norm
(Pascanu et al. 2013), and a step whose norm is not finite is skipped. Its state is saved by parameter name,
so a checkpoint does not depend on how parameters are laid out or sharded. Offloaded: parallel/offload.py.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .comm.collectives import all_gather_into_tensor
from .config import TrainConfig
from .flat import FlatParams
from .sharded_read import read_ahead, read_flat
from .grad_norm import sum_of_squares_over
from .kernels import adamw_master_step, decay_table, sgd_master_step, triton_ok
from .precision import DynamicLossScaler
from .runtime.device import host_empty


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup over warmup_steps, then cosine, linear or constant decay to lr * min_lr_ratio."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    low = cfg.lr * cfg.min_lr_ratio
    if cfg.lr_schedule == "linear":
        return cfg.lr - (cfg.lr - low) * progress
    return low + (cfg.lr - low) * 0.5 * (1 + math.cos(math.pi * progress))



def warmup_note(cfg: TrainConfig) -> str | None:
    """What a warmup longer than the run leaves out of the schedule: a note, not an error (short test runs
    may mean it)."""
    if cfg.warmup_steps <= cfg.steps:
        return None
    return (f"note: train.warmup_steps = {cfg.warmup_steps} exceeds train.steps = {cfg.steps}: the learning rate "
            f"climbs only to {lr_at(cfg.steps - 1, cfg):.2e}, not train.lr = {cfg.lr:.2e}, and never decays; lower "
            f"train.warmup_steps to {cfg.steps} at most for the whole schedule")

class NonFiniteGradient(FloatingPointError):
    """A bf16/fp32 step's gradient was not finite; the step was skipped. `step`: the first such step."""

    def __init__(self, step: int, norm: float):
        super().__init__(f"the gradient of step {step} was not finite (its norm: {norm})")
        self.step, self.norm = step, norm


@dataclass(frozen=True)
class Segment:
    """Elements [lo, hi) of this rank's shard of a bucket that share one weight decay."""
    bucket: int
    lo: int
    hi: int
    weight_decay: float


def _joined(parts: list, offsets: list[int]) -> torch.Tensor | None:
    """The one tensor that `parts` (bucket b's part at element offsets[b]) are consecutive views of, or None."""
    if any(p is None for p in parts):
        return None
    first = parts[0]
    size = first.element_size()
    for p, o in zip(parts, offsets):
        same_buffer = p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        if p.dtype != first.dtype or not p.is_contiguous() or not same_buffer or p.data_ptr() != first.data_ptr() + o * size:
            return None
    n = offsets[-1] + parts[-1].numel()
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (n,))


class MasterWeightOptimizer:
    """AdamW or SGD on this rank's shard of every bucket, with fp32 master weights.

    Unsharded (one process, DDP, classic DP) the shard of a bucket is the whole bucket; under ZeRO it is
    the rank's 1/N slice, and the global gradient norm sums the shards' squares over the group. The
    caller says where each bucket's gradient shard is (`grad_shard`) and where the updated 16-bit
    weights go (`param_shard`). `step` never waits for the host unless it must (fp16's loss scale): the
    norm, the clip/unscale factor and the skip flag stay on the device.
    """
    offloaded = False  # the masters and moments live on the CPU and the step runs there (parallel/offload.py)
    consume_grads = False  # the step may leave the gradient buffers scaled in place (offload's own host copy)

    def __init__(self, flat: FlatParams, cfg: TrainConfig, loss_scaler, group=None, shard: bool = False,
                 initial_shards=None, params_kept: bool = True):
        self.flat, self.cfg, self.scaler, self.group = flat, cfg, loss_scaler, group
        self.world = dist.get_world_size(group) if (shard and group is not None) else 1
        self.rank = dist.get_rank(group) if (shard and group is not None) else 0
        self.sharded = self.world > 1
        self.names, self.params = flat.names, flat.params
        self.device = flat.device
        home = torch.device("cpu") if self.offloaded else self.device
        self.shard_len = [b.numel // self.world for b in flat.buckets]
        self.master_off = [sum(self.shard_len[:i]) for i in range(len(flat.buckets))]
        self.total = sum(self.shard_len)
        # The masters' and moments' dtype: fp32, or bf16 with train.optimizer_dtype "bf16" (not offloaded: refused
        # by config.checks, as the CPU step and the offload buffers are fp32's).
        self.state_dtype = torch.bfloat16 if getattr(cfg, "optimizer_dtype", "fp32") == "bf16" else torch.float32
        if self.state_dtype != torch.float32 and (self.offloaded or flat.dtype != self.state_dtype):
            raise ValueError(f"bf16 optimizer state needs bf16 parameters on the device (parameters {flat.dtype}, "
                             f"offloaded: {self.offloaded})")
        # Weights in the state's dtype on one rank's full buckets whose storage stays (`params_kept`; ZeRO-3
        # frees it between uses): the parameters are their own masters.
        self.alias = params_kept and not (self.sharded or self.offloaded or flat.dtype != self.state_dtype)
        if self.alias:
            self.master_parts = [b.data for b in flat.buckets]
            self.master = None
        else:
            self.master = self._state_buffer("master", self.total, home)
            with torch.no_grad():
                for b in flat.buckets:
                    src = initial_shards[b.index] if initial_shards is not None else self.shard_of(b.data, b.index)
                    self.master_part(b.index).copy_(src)
            self.master_parts = [self.master_part(b.index) for b in flat.buckets]

        def zeros(key):  # one buffer per state, laid out like the masters, viewed per bucket
            flat = self._zeroed_state_buffer(key, self.total, home)
            return [flat[o:o + n] for o, n in zip(self.master_off, self.shard_len)]
        keys = ("exp_avg", "exp_avg_sq") if cfg.optimizer == "adamw" else ("momentum_buffer",)
        self.state = {k: zeros(k) for k in keys}
        self.segments = []
        for b in flat.buckets:
            lo, hi = self.rank * self.shard_len[b.index], (self.rank + 1) * self.shard_len[b.index]
            for s_lo, s_hi, wd in ((0, b.decay_numel, cfg.weight_decay), (b.decay_numel, b.numel, 0.0)):
                a, z = max(lo, s_lo), min(hi, s_hi)
                if z > a:
                    self.segments.append(Segment(b.index, a - lo, z - lo, wd))
        # The one-launch step over all buckets (see step) needs where weight decay applies, as a table. It
        # serves unsharded buffers only: ZeRO's gradient shards are separate allocations, never joined.
        self.decay_table = None
        if self.device.type == "cuda" and not self.offloaded and not self.sharded:
            self.decay_table = decay_table([(self.master_off[s.bucket] + s.lo, self.master_off[s.bucket] + s.hi)
                                            for s in self.segments if s.weight_decay], self.total, self.device)
        self.duplicates: list[tuple[int, int, int]] = []
        self.norm_group = None  # the ranks whose counted squares add up to the global norm (count_once)
        # Unsharded replicas (DDP) hold the whole reduced gradient: replica r of R counts slice r of each bucket.
        self.replica, self.replicas = 0, 1
        self.given_sumsq: torch.Tensor | None = None  # the global sum of squares, where a caller adds groups'
        self.updates_scaler = True  # one optimizer per step moves fp16's loss scale (GroupedEngine's first)
        self.steps_taken = 0
        self._skip = torch.zeros((), dtype=torch.int32, device=self.device)
        self._nonfinite = torch.zeros((), dtype=torch.int32, device=self.device)
        self._first_nonfinite = torch.zeros((), dtype=torch.int64, device=self.device)  # its step; 0: none
        self._first_norm = torch.zeros((), device=self.device)  # its norm: later steps' may be finite again
        self.last_norm = torch.zeros((), device=self.device)

    def _state_buffer(self, name: str, n: int, home: torch.device) -> torch.Tensor:
        """Storage for the masters or one optimizer state, all buckets' shards end to end, in `state_dtype`
        (fp32 unless train.optimizer_dtype is bf16; offload: fp32 in host memory, the masters pinned where
        there is a GPU; or in a file: parallel/offload_disk.py)."""
        if home.type != "cpu":
            return torch.empty(n, dtype=self.state_dtype, device=home)
        return host_empty(n, self.state_dtype, pin=self.offloaded and name == "master" and torch.cuda.is_available())

    def _zeroed_state_buffer(self, name: str, n: int, home: torch.device) -> torch.Tensor:
        return self._state_buffer(name, n, home).zero_()

    def count_once(self, duplicates: list[tuple[int, int, int]], norm_group) -> None:
        """The ranks of `norm_group` (the world; classic DP: its roots) hold different parts and copies of one
        model; each counts the squares of the gradient elements it alone owns and the global norm adds them
        over the group in one all-reduce. `duplicates` are (bucket, lo, hi) element ranges this rank holds
        that another rank counts (tensor-parallel replicas, a tied embedding's second copy)."""
        self.duplicates, self.norm_group = duplicates, norm_group

    def count_replica_slice(self, group) -> None:
        """Unsharded data parallelism: the ranks of `group` hold the same reduced gradient; rank r of R counts
        elements [r n/R, (r+1) n/R) of each bucket of n (padded to a multiple of R) and no other."""
        self.replica, self.replicas = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)

    def counted_range(self, b: int) -> tuple[int, int, int]:
        """(lo, hi) of bucket b's elements this rank counts, and where grads[b] starts in the bucket."""
        if self.sharded:
            lo = self.rank * self.shard_len[b]
            return lo, lo + self.shard_len[b], lo
        n = self.flat.buckets[b].numel // self.replicas
        return self.replica * n, (self.replica + 1) * n, 0

    def owned_sumsq(self, grads: list[torch.Tensor], sumsq: torch.Tensor | None = None,
                    joined_grad: torch.Tensor | None = None) -> torch.Tensor:
        """The squares of the gradient elements this rank alone counts (its shard or replica slice, less what
        another rank counts), as an fp32 device scalar; `sumsq`: those of the shard or slice where the
        caller took them as the reduction went."""
        if sumsq is None:
            if self.replicas > 1:
                parts = [grads[b][lo:hi] for b, (lo, hi, _) in enumerate(map(self.counted_range, range(len(grads))))]
            else:
                parts = [joined_grad] if joined_grad is not None else grads
            sumsq = sum_of_squares_over(parts, self.device)
        parts = []
        for b, lo, hi in self.duplicates:
            own_lo, own_hi, start = self.counted_range(b)
            a, z = max(lo, own_lo), min(hi, own_hi)
            if z > a:
                parts.append(grads[b][a - start:z - start])
        return sumsq - sum_of_squares_over(parts, self.device) if parts else sumsq

    def global_sumsq(self, owned: torch.Tensor) -> torch.Tensor:
        """The sum over `norm_group` of each rank's owned squares (inf or nan anywhere: everywhere)."""
        if self.norm_group is None or dist.get_world_size(self.norm_group) == 1:
            return owned
        total = owned.clone()  # `owned` may be a transport's buffer
        dist.all_reduce(total, group=self.norm_group)
        return total

    # ---- layout ---------------------------------------------------------------------------------
    def shard_of(self, bucket_buf: torch.Tensor, b: int) -> torch.Tensor:
        n = self.shard_len[b]
        return bucket_buf[self.rank * n:(self.rank + 1) * n]

    def master_part(self, b: int) -> torch.Tensor:
        return self.master[self.master_off[b]:self.master_off[b] + self.shard_len[b]]

    @property
    def masters(self) -> list[torch.Tensor]:
        """Unsharded only: each parameter's master (fp32, or bf16 with a bf16 optimizer), shaped like it."""
        assert not self.sharded
        return [self.flat.view(self.master_parts[self.flat.where[i][0]], i) for i in range(len(self.params))]

    # ---- the step ---------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, lr: float, step: int, grad_shard, param_shard, grad_factor: float = 1.0,
             sumsq: torch.Tensor | None = None) -> bool:
        """Clip by the global norm and apply. `grad_shard(b)`: bucket b's gradient shard (any float dtype,
        equal to grad_factor x the true gradient x the loss scale); `param_shard(b)`: where the updated
        16-bit weights go, or None; `sumsq`: the squares of this rank's shard or replica slice where the
        caller took them as the reduction went (see `owned_sumsq`). Returns False when fp16 overflowed and the
        step was skipped."""
        cfg = self.cfg
        grads = [grad_shard(b.index) for b in self.flat.buckets]
        params = [None if self.alias else param_shard(b.index) for b in self.flat.buckets]
        joined = self._joined(grads, params)
        scale = self.clip_scale(step, grads, grad_factor, sumsq, joined[2] if joined is not None else None)
        if scale is None:
            return False
        self.steps_taken += 1
        if joined is not None:
            adamw_master_step(*joined, scale, self._skip, step=self.steps_taken, lr=lr, beta1=cfg.beta1,
                              beta2=cfg.beta2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                              decay_table=self.decay_table)
        else:
            self._apply(lr, grads, params, scale, self._skip)
        return True

    def clip_scale(self, step: int, grads: list, grad_factor: float, sumsq: torch.Tensor | None,
                   joined_grad: torch.Tensor | None = None) -> torch.Tensor | None:
        """The global norm's bookkeeping (`last_norm`, the skip flag, fp16's scale schedule, non-finite
        steps) and the factor that turns the gradients into the step's clipped mean gradient; None when
        fp16 overflowed and the step is skipped. `grads`: the shards by bucket (`joined_grad`: all of them
        as one tensor, where they are views of one buffer, squared in one pass)."""
        cfg = self.cfg
        loss_scale = self.scaler.scale
        if self.given_sumsq is not None:
            sumsq = self.given_sumsq
        else:
            sumsq = self.global_sumsq(self.owned_sumsq(grads, sumsq, joined_grad))
        norm = sumsq.sqrt() * (grad_factor / loss_scale)
        finite = torch.isfinite(norm)
        self._skip.copy_(~finite)
        self.last_norm = norm
        if isinstance(self.scaler, DynamicLossScaler):  # fp16: the scale schedule is decided on the host
            applied = bool(finite)
            if self.updates_scaler:
                self.scaler.update(not applied, step)
            if not applied:
                return None
        else:
            self._nonfinite += self._skip  # reported (and fatal) at the next sync
            first = (self._first_nonfinite == 0) & ~finite
            self._first_nonfinite.copy_(torch.where(first, step, self._first_nonfinite))
            self._first_norm.copy_(torch.where(first, norm, self._first_norm))
        scale = torch.full((), grad_factor / loss_scale, device=self.device)
        if cfg.grad_clip > 0:
            scale = scale * torch.clamp(cfg.grad_clip / (norm + 1e-6), max=1.0)
        return scale

    def skip_flag(self) -> torch.Tensor:
        """Whether the last clip_scale found the gradient not finite (its update then changes nothing)."""
        return self._skip

    def _joined(self, grads: list, params: list) -> list | None:
        """(master, param, grad, exp_avg, exp_avg_sq), each one tensor over all buckets, where every per-bucket
        tensor is a view of one buffer (DDP, one process): the step is then one norm and one update launch
        in all, not several per bucket, whose small tails add up (bench/README.md). None otherwise."""
        if self.cfg.optimizer != "adamw" or self.decay_table is None or not triton_ok(self.master_parts[0]):
            return None
        joined = [_joined(ts, self.master_off) for ts in
                  (self.master_parts, params, grads, self.state["exp_avg"], self.state["exp_avg_sq"])]
        needed = joined[:1] + joined[2:] + ([] if self.alias else joined[1:2])  # alias: no 16-bit copy to write
        return None if any(t is None for t in needed) else joined

    def _apply(self, lr: float, grads: list, params: list, scale: torch.Tensor, skip: torch.Tensor,
               segments: list | None = None, steps: int | None = None) -> None:
        """The update of every segment (or of `segments`): grads[b] times `scale` is the step's gradient of
        bucket b's shard; the updated 16-bit weights go to params[b] (None: nothing to write back). `steps`:
        the step count for the bias correction (default: the steps taken so far)."""
        cfg = self.cfg
        steps = self.steps_taken if steps is None else steps
        for seg in self.segments if segments is None else segments:
            b, sl = seg.bucket, slice(seg.lo, seg.hi)
            out = None if params[b] is None else params[b][sl]
            args = (self.master_parts[b][sl], out, grads[b][sl])
            if cfg.optimizer == "adamw":
                adamw_master_step(*args, self.state["exp_avg"][b][sl], self.state["exp_avg_sq"][b][sl], scale, skip,
                                  step=steps, lr=lr, beta1=cfg.beta1, beta2=cfg.beta2, eps=cfg.eps,
                                  weight_decay=seg.weight_decay, consume_grad=self.consume_grads,
                                  host_kernel=self.offloaded)
            else:
                sgd_master_step(*args, self.state["momentum_buffer"][b][sl], scale, skip, step=steps,
                                lr=lr, momentum=cfg.momentum, weight_decay=seg.weight_decay)

    def sync(self, step: int) -> tuple[float, int]:
        """Host view of the last step: (its grad norm, steps skipped so far). In bf16/fp32 a step whose
        gradient was not finite (skipped, so the weights stay finite) raises NonFiniteGradient."""
        if int(self._nonfinite):
            raise NonFiniteGradient(int(self._first_nonfinite), float(self._first_norm))
        return float(self.last_norm), self.scaler.skipped_steps

    def first_nonfinite(self) -> torch.Tensor:
        """[the first step whose gradient was not finite (0: none), its norm] on the device, no sync."""
        return torch.stack([self._first_nonfinite.to(torch.float64), self._first_norm.to(torch.float64)])

    # ---- layout-free state: full tensors keyed by parameter name (collective when sharded) ---------
    def _full(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each bucket's full buffer from the shards (an all-gather per bucket when sharded), moved to the
        CPU bucket by bucket so saving never holds more than one full bucket in device memory."""
        out = []
        for b, part in zip(self.flat.buckets, parts):
            if not self.sharded:
                out.append(part)
                continue
            full = torch.empty(b.numel, dtype=part.dtype, device=self.device)
            all_gather_into_tensor(full, part.to(self.device).contiguous(), group=self.group)
            out.append(full.cpu())
        return out

    def master_state(self) -> dict[str, torch.Tensor]:
        full = self._full(self.master_parts)
        return {n: self.flat.view(full[self.flat.where[i][0]], i) for i, n in enumerate(self.names)}

    def state_by_name(self) -> dict[str, torch.Tensor]:
        out = {}
        for k, parts in self.state.items():
            full = self._full(parts)
            for i, name in enumerate(self.names):
                out[f"{name}::{k}"] = self.flat.view(full[self.flat.where[i][0]], i)
        for name in self.names:
            out[f"{name}::step"] = torch.tensor(float(self.steps_taken))
        return out

    @torch.no_grad()
    def load(self, masters: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> Iterator[torch.Tensor]:
        """Take this rank's shard of every bucket from full per-name tensors; returns the 16-bit weights of its
        bucket shards, each made on the device as the caller takes it (all at once, an offloaded rank's whole
        shard was on the GPU). Values are read in fp32 and stored in the state's dtype: a checkpoint of either
        train.optimizer_dtype resumes under the other (fp32 rounded to nearest bf16; bf16 widened exactly)."""
        missing = [n for n in self.names if n not in masters]
        if missing:
            raise KeyError(f"checkpoint lacks parameters {missing[:4]}")
        unknown = {k.split("::")[0] for k in state} - set(self.names)
        if unknown:
            raise KeyError(f"checkpoint optimizer state names unknown parameters {sorted(unknown)[:4]}")
        for k in self.state:
            absent = [n for n in self.names if f"{n}::{k}" not in state]
            if absent:
                raise KeyError(f"checkpoint lacks optimizer state {absent[0]}::{k} (saved with another optimizer?)")

        def scatter(parts, mapping, key):
            # Only the elements of this rank's shard are read (a sharded checkpoint's pieces that overlap it).
            def read(bucket_part):
                b, part = bucket_part
                lo = self.rank * self.shard_len[b.index] if self.sharded else 0
                hi = lo + part.numel()
                buf = torch.zeros(hi - lo, dtype=torch.float32)  # bucket padding stays 0
                for i in b.params:
                    at, size = self.flat.where[i][1], self.params[i].numel()
                    a, z = max(lo, at), min(hi, at + size)
                    if a < z:
                        buf[a - lo:z - lo] = read_flat(mapping, key(self.names[i]), a - at, z - at)
                return buf
            for part, buf in zip(parts, read_ahead(read, zip(self.flat.buckets, parts))):
                part.copy_(buf)

        scatter(self.master_parts, masters, lambda n: n)
        for k, parts in self.state.items():
            scatter(parts, state, lambda n, k=k: f"{n}::{k}")
        self.steps_taken = int(state[f"{self.names[0]}::step"])
        return (m.to(self.device, self.flat.dtype) for m in self.master_parts)
