"""A tensor-parallel step's collectives alone: the all-gather and reduce-scatter of sequence parallelism over a
[4096, 4096] bf16 activation (llama2-7b at seq 4096: 16 MB a rank at tp 2) and a norm's 8 KB all-reduce, by
NCCL as the environment sets it (run once per NCCL_* setting), by NCCL with per-communicator CTA bounds, by
torch's copy-engine ("low-contention") symmetric-memory forms, and the copy engine pulling a peer's 16 MB alone.
us a call, the slower rank's mean over 50 after 10.

    torchrun --nproc-per-node 2 bench/tp_collectives.py [LABEL]
    NCCL_MIN_NCHANNELS=32 torchrun --nproc-per-node 2 bench/tp_collectives.py channels-32
"""
import os
import sys

import torch
import torch.distributed as dist


def timed(fn, n=50, warm=10):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    t = torch.tensor([a.elapsed_time(b) * 1e3 / n], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def main():
    label = sys.argv[1] if len(sys.argv) > 1 else "nccl"
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", device_id=torch.device("cuda", int(os.environ["LOCAL_RANK"])))
    world = dist.get_world_size()
    rows = 4096
    shard = torch.randn(rows // world, 4096, device="cuda", dtype=torch.bfloat16)
    full = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    small = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    out = {}

    def bench(name, group):
        out[f"{name} all_gather"] = timed(lambda: dist.all_gather_into_tensor(full, shard, group=group))
        out[f"{name} reduce_scatter"] = timed(lambda: dist.reduce_scatter_tensor(shard, full, group=group))
        out[f"{name} all_reduce 8KB"] = timed(lambda: dist.all_reduce(small, group=group))

    bench("nccl", None)
    for ctas in (16, 32):
        try:
            opts = dist.ProcessGroupNCCL.Options()
            opts.config.min_ctas = ctas
            opts.config.max_ctas = ctas
            g = dist.new_group(list(range(world)), backend="nccl", pg_options=opts)
            bench(f"nccl {ctas} CTAs", g)
        except Exception as e:  # noqa: BLE001
            out[f"nccl {ctas} CTAs"] = repr(e)[:120]
    try:
        import torch.distributed._symmetric_memory as symm
        gname = dist.group.WORLD.group_name
        symm.enable_symm_mem_for_group(gname)
        out["symm low-contention all_gather"] = timed(lambda: torch.ops.symm_mem._low_contention_all_gather(shard, gname))
        out["symm low-contention reduce_scatter"] = timed(
            lambda: torch.ops.symm_mem._low_contention_reduce_scatter(full, "sum", gname))
        # a plain peer pull: each rank copies the peer's half out of symmetric memory (copy engine), no sum
        buf = symm.empty(rows, 4096, device="cuda", dtype=torch.bfloat16)
        hdl = symm.rendezvous(buf, gname)
        peer = hdl.get_buffer(1 - rank, (rows, 4096), torch.bfloat16) if world == 2 else None
        if peer is not None:
            out["symm peer copy 16MB (CE, no barrier)"] = timed(lambda: shard.copy_(peer[: rows // 2]))
    except Exception as e:  # noqa: BLE001
        out["symm"] = repr(e)[:200]
    if rank == 0:
        for k, v in out.items():
            print(f"{label:<28} {k:<42} {v if isinstance(v, str) else f'{v:8.1f} us'}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
