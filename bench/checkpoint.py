"""Checkpoint speed and host memory: shardlm's sharded save and load beside torch.distributed.checkpoint (DCP)
saving the same tensors, and what an asynchronous save costs the steps it overlaps.

    python bench/checkpoint.py --gpus 2 [--preset llama2-7b] [--layout zero3] [--dir /local/nvme] [--record FILE]

Each system runs as its own `torchrun --nproc-per-node GPUS` job, after two training steps (so the AdamW state
exists), bf16 with fp32 masters:
- shardlm: `Trainer.save` (each rank writes its pieces; rank 0 commits) then a resume's load of the same
  checkpoint into the same layout (its CRCs checked by rank 0 as a resume does, `verify_s` of `load_s`, then
  `load_checkpoint` and `load_full_state`);
- dcp: `torch.distributed.checkpoint.save` / `load` of exactly the tensors shardlm writes (each rank's pieces
  of the fp32 masters and moments, keyed by rank, so each is written once by its owner);
- shardlm-async: the mean step time from an asynchronous save's start (its copy to host memory included)
  until it has committed, against `--steps` steps without one.
A rank's peak host memory is its resident set's high-water mark over the save (reset just before it, Linux's
/proc/self/clear_refs), minus its resident set then. `--device cpu` is a smoke run on gloo (tiny presets).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import time
from pathlib import Path

from common import driver_args, forwarded, job_env, record, run_systems

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ("shardlm", "dcp", "shardlm-async")
LAYOUTS = {"zero3": {"parallel.zero_stage": "3"}, "zero1": {"parallel.zero_stage": "1"},
           "tp2": {"parallel.tp": "2"}, "pp2": {"parallel.pp": "2"}, "tp2pp2": {"parallel.tp": "2", "parallel.pp": "2"}}


def _kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def _reset_peak() -> int:
    Path("/proc/self/clear_refs").write_text("5")
    return _kib("VmRSS")


def worker(args):
    import torch
    import torch.distributed as dist
    from shardlm.checkpoint import load_checkpoint, resolve_checkpoint
    from shardlm.config import load_config
    from shardlm.parallel.sharded_state import pieces
    from shardlm.trainer import Trainer
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    layout = dict(LAYOUTS[args.layout])
    rest = world // (int(layout.get("parallel.tp", 1)) * int(layout.get("parallel.pp", 1)))
    steps = max(args.steps, 2)
    cfg = load_config(args.preset, {**layout, "parallel.dp": str(rest), "train.seq_len": str(args.seq),
                                    "train.micro_batch_size": "1", "train.global_batch_size": str(rest * 2),
                                    "train.steps": "1000000", "train.tensorboard": "false", "train.device": args.device,
                                    "train.precision": "bf16" if args.device == "cuda" else "fp32",
                                    "train.checkpoint_async": str(args.system == "shardlm-async").lower()})
    out = Path(args.dir) / f"bench-checkpoint-{args.system}"
    if rank == 0:  # a run killed before its own cleanup must not fill the disk under the next system
        for old in Path(args.dir).glob("bench-checkpoint-*"):
            shutil.rmtree(old, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
    trainer = Trainer(cfg, out_dir=out if args.system != "dcp" else None, log=lambda *a: None, overwrite=True)

    def step():
        trainer.train_step()
        trainer.step += 1
    for _ in range(2):
        step()
    trainer.engine.wait_for_weights()
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    row = {"system": args.system, "gpus": world, "layout": args.layout}
    if args.system == "shardlm-async":
        sync()
        t = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        row["step_s"] = (time.perf_counter() - t) / steps
        # Steps until the save has committed (its copy to host memory included): what it costs them.
        t, n = time.perf_counter(), 0
        trainer.save(wait=False)
        row["copy_s"] = time.perf_counter() - t
        while trainer.saver.pending is not None and n < 1000:
            step()
            n += 1
            trainer.saver.poll()
        trainer.saver.finish()
        sync()
        row.update({"save_s": time.perf_counter() - t, "steps_saving": n})
        row["step_s_saving"] = row["save_s"] / max(n, 1)
        row["overhead"] = row["step_s_saving"] / row["step_s"] - 1
    else:
        buffer = cfg.train.checkpoint_buffer_mb * 2**20
        mine = {f"{rank}/{e['key']}": v for e, v in pieces(trainer.engine, trainer.model, trainer.parallel.mesh, buffer)}
        written = sum(v.numel() * v.element_size() for v in mine.values())
        before = _reset_peak()
        if dist.is_initialized():
            dist.barrier()
        t = time.perf_counter()
        if args.system == "shardlm":
            trainer.save()
        else:
            import torch.distributed.checkpoint as dcp
            dcp.save(mine, checkpoint_id=str(out))
        if dist.is_initialized():
            dist.barrier()
        row["save_s"] = time.perf_counter() - t
        grown = _kib("VmHWM") - before
        t = time.perf_counter()
        if args.system == "shardlm":
            if rank == 0:  # as a resume: the main rank checks every file's CRC, the others wait
                resolve_checkpoint(out)
            if dist.is_initialized():
                dist.barrier()
            row["verify_s"] = time.perf_counter() - t
            ckpt = load_checkpoint(out, log=lambda *a: None, verify=False)
            trainer.parallel.load_full_state(ckpt["model"], ckpt["optimizer"])
        else:
            dcp.load(mine, checkpoint_id=str(out))
        sync()
        if dist.is_initialized():
            dist.barrier()
        row["load_s"] = time.perf_counter() - t
        print(f"rank {rank}: save {row['save_s']:.2f} s, load {row['load_s']:.2f} s, {written / 1e9:.2f} GB, "
              f"host +{grown / 2**30:.2f} GiB", flush=True)
        # on the training device: NCCL has no CPU tensors
        stats = torch.tensor([float(written), float(grown), float(written)], dtype=torch.float64,
                             device=trainer.device)
        if dist.is_initialized():
            total = stats[:1].clone()
            dist.all_reduce(total)
            dist.all_reduce(stats, op=dist.ReduceOp.MAX)
            stats[0] = total[0]
        row.update({"gb": stats[0].item() / 1e9, "save_gb_s": stats[0].item() / 1e9 / row["save_s"],
                    "load_gb_s": stats[0].item() / 1e9 / row["load_s"], "peak_host_gib": stats[1].item() / 2**30,
                    "shard_gib": stats[2].item() / 2**30})
    if rank == 0:
        print("RESULT " + json.dumps(row), flush=True)
        shutil.rmtree(out, ignore_errors=True)
    trainer.close()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--preset", default="llama2-7b")
    p.add_argument("--layout", default="zero3", choices=sorted(LAYOUTS))
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=4, help="shardlm-async: steps timed without a save")
    p.add_argument("--dir", default="/tmp", help="where the checkpoints are written (a local disk)")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run on gloo (tiny presets)")
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS))
    driver_args(p, timeout=600)
    args = p.parse_args()
    if args.system:
        return worker(args)
    own = forwarded(args, ("preset", "layout", "seq", "steps", "dir", "device"))
    env = job_env(ROOT)
    if args.device == "cpu":
        env = {**env, "CUDA_VISIBLE_DEVICES": ""}
    rows = run_systems(__file__, args.systems, lambda s: args.gpus, lambda s: own, env, args.timeout, args.budget)
    print(f"\n{args.preset}, {args.layout} over {args.gpus} ranks ({args.device})")
    print(f"{'system':<16}{'GB':>8}{'save s':>9}{'GB/s':>8}{'load s':>9}{'verify':>8}{'host GiB':>10}{'shard GiB':>11}{'overhead':>10}")
    for r in rows:
        if "gb" in r:
            print(f"{r['system']:<16}{r['gb']:>8.1f}{r['save_s']:>9.2f}{r['save_gb_s']:>8.2f}{r['load_s']:>9.2f}"
                  f"{r.get('verify_s', 0):>8.2f}{r['peak_host_gib']:>10.2f}{r['shard_gib']:>11.2f}{'-':>10}")
        else:
            print(f"{r['system']:<16}{'-':>8}{r['save_s']:>9.2f}{'-':>8}{'-':>9}{'-':>8}{'-':>10}{'-':>11}"
                  f"{100 * r['overhead']:>9.1f}%  ({r['steps_saving']} steps, {r['copy_s']:.1f} s to copy)")
    if args.record and args.device == "cuda":
        import torch
        record(args.record, "checkpoint", torch.cuda.get_device_name(), args.gpus,
               [{"model": args.preset, "seq": args.seq, "micro_batch": 1, "tok_s_gpu": None, "mfu": None,
                 "peak_mem_gib": None, **r, "command": f"python bench/checkpoint.py --gpus {args.gpus} --preset "
                                                        f"{args.preset} --layout {args.layout}"} for r in rows])


if __name__ == "__main__":
    main()
