"""What offload adds to a step (Ren et al. 2021, "ZeRO-Offload"; Rajbhandari et al. 2021, "ZeRO-Infinity"),
from the traffic parallel/offload.py makes over PCIe, through host memory and to disk.

Per rank and micro-batch, ZeRO-2/3 copy each reduced gradient shard to pinned memory (16-bit at one rank,
fp32 after an fp32 reduction) and a host thread adds it into the fp32 buffer (the first micro-batch
converts: 2 + 4 bytes an element; the others add: 2 + 8), on the last micro-batch also squaring it for the
norm; with parameter offload every pass (forward, backward, and recomputation's forward) uploads each
unit's 16-bit shard (read from disk with `parallel.offload_dir`, at worst). These run beside the GPU's work, so a micro-batch takes the longest of the three.
ZeRO-1 copies its reduced shard down once, at the step. The update is a CPU AdamW pass, memory-bound:
ADAM_HOST_BYTES an element through host memory (with `parallel.offload_dir` the masters and moments
stream to and from disk beside it, double-buffered: the slower of the two), the 16-bit weights going back
up bucket by bucket beside it (parameter offload's stay in host memory). With the delayed update (`parallel.delayed_update`)
step N's update runs beside step N + 1's GPU work: the step takes the longer of the two, and no less than
the host's adds and update one after the other (they share its memory bandwidth). Host memory and disk bandwidth are the node's, shared by
its ranks; PCIe is each GPU's own (hardware.py's figures, all overridable).
"""
from __future__ import annotations

import math

from ..config import BLOCK_RECOMPUTE, ModelConfig
from .hardware import GPU
from .layout import Layout, Workload
from .memory import checkpoint_bytes, layer_params, trained_and_frozen, zero_shard

ADAM_HOST_BYTES = 30  # per element: the gradient, master and two moments read (16), the three written (12), the 16-bit weight (2)
SQUARES_BYTES = 4     # the norm's pass over the fp32 sum
# The gradient adds stream at this fraction of the update's rate, with the copies from the GPU writing into
# the same memory meanwhile and the 16-bit values converted on the way: measured in 7B runs (bench/README.md),
# 72 GB/s against the update's 117 on one host, 82 against 162 on another.
FOLD_SHARE = 0.5


def offload_seconds(m: ModelConfig, w: Workload, L: Layout, g: GPU, gpus_per_node: int, compute: float) -> float:
    """The seconds offload adds to a step whose GPU work takes `compute` seconds (0 without offload)."""
    if L.offload == "none":
        return 0.0
    ranks = min(L.gpus, gpus_per_node)
    host_bw, disk_bw = g.host_bw / ranks, g.disk_bw / ranks
    phi, _ = trained_and_frozen(m, L, 0, 2)
    shard = zero_shard(m, L, 0, phi) if L.zero_stage >= 1 else phi  # each parameter over its own reduce group
    micro = w.global_batch // (w.micro_batch * L.dp)
    reduced = reduced_bytes(L)
    per_micro = compute / micro
    if L.zero_stage >= 2:
        down = shard * reduced / g.pcie_bw
        passes = 3 if L.recompute in BLOCK_RECOMPUTE else 2
        # With offload_dir the shards are read from the disk (at worst: the page cache may hold them).
        read_bw = min(g.pcie_bw, disk_bw) if L.offload_dir else g.pcie_bw
        up = passes * shard * 2 / read_bw if L.offload == "params" else 0.0
        fold_bw = FOLD_SHARE * host_bw
        first = shard * (reduced + 4) / fold_bw
        later = shard * (reduced + 8) / fold_bw
        last = SQUARES_BYTES * shard / fold_bw  # the norm's squares, as the last micro-batch's buckets arrive
        gpu = (max(per_micro, down, up, first + (last if micro == 1 else 0))
               + max(micro - 2, 0) * max(per_micro, down, up, later)
               + (max(per_micro, down, up, later + last) if micro > 1 else 0))
        adds = first + max(micro - 1, 0) * later + last
    else:
        gpu = compute + shard * reduced / g.pcie_bw  # the shards copied down at the step
        adds = 0.0
    update = shard * ADAM_HOST_BYTES / host_bw
    if L.offload_dir:
        update = max(update, shard * 2 * 12 / disk_bw)  # masters and moments read and written back
    # The 16-bit weights go back up bucket by bucket as they are updated, unless they live in host memory
    # (parameter offload): the slower of the two.
    host = update if L.offload == "params" else max(update, shard * 2 / g.pcie_bw)
    # Overlapped, the update and the next step's adds still share the host's memory bandwidth. The exact
    # overlap (`parallel.overlap_update`) hides it behind the next step's first forward only, which waits
    # for each bucket in turn.
    if L.delayed_update:
        step = max(gpu, host, adds + update)
    elif L.overlap_update:
        step = gpu + host - min(host, per_micro * (0.25 if L.recompute in BLOCK_RECOMPUTE else 1 / 3))
    else:
        step = gpu + host
    return step - compute


def reduced_bytes(L: Layout) -> int:
    """Bytes an element of a reduced gradient shard takes as it leaves the GPU under offload: 16-bit at one
    rank or with a 16-bit reduction, else fp32."""
    return 2 if L.precision != "fp32" and (L.replicas == 1 or L.reduce_dtype != "fp32") else 4


def host_bytes(m: ModelConfig, L: Layout, w: Workload | None = None) -> float:
    """Host memory one rank's offload needs (parallel/offload.py, pinned where there is a GPU): its shard's
    fp32 masters and optimizer moments (unless they are on disk), its gradient buffer, the 16-bit staging of
    the updated weights (a bucket or two at a time), and with parameter offload the 16-bit shards themselves (unless they are on disk:
    read through the page cache, which the kernel may evict); with `offload_activations` (and a workload `w`)
    the blocks' inputs. 0 without offload."""
    acts = checkpoint_bytes(m, w, L, pinned=True) if L.offload_activations and w is not None else 0.0
    if L.offload == "none":
        return acts
    trained = max(zero_shard(m, L, s, trained_and_frozen(m, L, s, 2)[0]) for s in {0, L.pp - 1})
    # fp32 masters and AdamW's two moments and parameter offload's 16-bit shards (on disk with
    # parallel.offload_dir), gradients
    per_param = (0 if L.offload_dir else 4 + 8 + (2 if L.offload == "params" else 0)) + 4
    # The delayed update: the gradients of the step being updated beside the next's, and its updated 16-bit
    # weights staged until they land.
    per_param += 4 + 2 if L.delayed_update else 0
    # The pinned staging that reduced gradient shards cross through (HostGradients' 8 slots of a bucket's
    # shard, locked at their exact size; a ZeRO-3 bucket is a whole block), and the updated 16-bit weights' on their way up: a bucket's
    # shard or two at a time, each block rounded up to a power of two by the pinned allocator (parameter
    # offload updates its shards where they lie).
    # A parameter larger than a bucket is a bucket of its own: the embedding's and the head's (vocab-parallel
    # over tp) size the slots and the staging on the stages that hold them.
    unit = max(L.bucket_mb * 2**20 / 2, layer_params(m, L) if L.zero_stage == 3 else 0,
               0 if L.lora.rank else m.vocab_size * m.hidden_size / L.tp)
    staging = 8 * unit / L.replicas * reduced_bytes(L) if L.zero_stage >= 2 else 0.0
    if L.offload != "params" and not L.delayed_update:
        staging += 2 * 2.0 ** math.ceil(math.log2(unit / L.replicas * 2))
    if L.offload_dir:  # the disk tier's two fp32 work buffers per file (a master and two moments) of a bucket
        staging += 2 * 3 * 4 * unit / L.replicas
    return trained * per_param + staging + acts
