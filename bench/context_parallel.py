"""Context parallelism (issue 48, part 1): shardlm's ring attention (`parallel.cp_comm p2p`) beside its Ulysses
all-to-all (`a2a`) and PyTorch's own context parallel (torch.distributed.tensor.experimental.context_parallel)
on HF transformers' LlamaForCausalLM of the same shape, with the planner's predicted memory and step time.

    python bench/context_parallel.py --gpus 2 --cp 2 --preset llama2-7b --seq 16384 --global-batch 2 [--budget S]
    python bench/context_parallel.py --gpus 2 --cp 2 --preset tinyllama-1.1b --seq 65536 --global-batch 2
    python bench/context_parallel.py --device cpu --gpus 2 --cp 2 --preset tiny --seq 256 --steps 2 --warm 1

Each system runs as its own torchrun job (clean allocator, honest peaks), dp = GPUs / cp:
- `shardlm-ring`, `shardlm-ulysses`: shardlm's Trainer as bench/planner_pick.py runs a layout (bf16 parameters,
  fp32 masters, blocks compiled, fused AdamW), ZeRO-3 over the dp x cp ranks, recompute `--recompute` (none),
  micro-batch `--micro-batch` (default global batch / dp, what the planner picked for the issue's rows).
- `torch-cp`: HF's Llama (shardlm's export config), FSDP2 `fully_shard` per decoder layer and at the root over
  the dp x cp ranks (bf16 compute, fp32 reduce, fp32 parameters: the hf-fsdp2 peer of data_parallel.py), eager;
  each micro-batch's forward and backward inside `context_parallel(cp mesh, buffers=[inputs, labels, position
  ids], buffer_seq_dims=[1, 1, 1])` under SDPA's flash backend. Its rotation: `--rotate alltoall` (default:
  torch's ring, one peer's K/V shard passed per step; "allgather" gathers all of them after the first block).
  Two bench-only patches: HF's packed-sequence detection from position ids is off (the load-balanced shard's
  positions jump, which HF would read as packed documents and mask), and GQA keys/values are repeated before
  SDPA (HF's older path: context parallel's ring handler is not known to take enable_gqa). Loss: the pre-shifted
  labels' cross entropy on the fp32 logits, each rank's mean (equal token counts: FSDP's mean is the global one).
A system that raises prints its error as its row ("failed" in the table); one that dies or runs past --timeout
gets a row saying so. Peak memory: the largest over ranks of max_memory_allocated (+ shardlm's symmetric
memory). The planner's figures: shardlm.plan.estimate of the config each shardlm job runs (Layout.from_config).
`--profile N`: after timing, N more steps under torch.profiler (common.profile_steps), rank 0's trace and kernel
table written to `--profile-dir`, a line per system after the table (GPU busy, ms per kernel class, top kernel).
`--device cpu`: gloo smoke run of the two shardlm systems (torch-cp skipped: its ring needs CUDA's flash or
efficient kernels), never recorded. Extra `--section.key value` arguments go to the shardlm systems.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from common import (PEAK, driver_args, forwarded, job_env, profile_steps, record, run_systems, shardlm_trainer,
                    timed)

ROOT = Path(__file__).resolve().parents[1]
SHARDLM = {"shardlm-ring": "p2p", "shardlm-ulysses": "a2a"}
SYSTEMS = ("shardlm-ring", "shardlm-ulysses", "torch-cp")


def micro_batch(args) -> int:
    return args.micro_batch or max(1, args.global_batch // (args.gpus // args.cp))


def overrides(args, system: str) -> dict:
    """The shardlm config of `system`: what the worker trains and what the planner is asked about."""
    from shardlm.config import load_config
    cuda = args.device == "cuda"
    return {"train.seq_len": str(args.seq), "model.max_seq_len": str(max(args.seq, load_config(args.preset).model.max_seq_len)),
            "train.global_batch_size": str(args.global_batch), "train.micro_batch_size": str(micro_batch(args)),
            "train.steps": "1000000", "train.eval_every": "0", "train.tensorboard": "false", "train.device": args.device,
            "train.precision": "bf16" if cuda else "fp32", "train.compile": str(cuda and bool(args.compile)).lower(),
            "train.recompute": args.recompute, "parallel.dp": str(args.gpus // args.cp), "parallel.cp": str(args.cp),
            "parallel.cp_comm": SHARDLM[system], "parallel.zero_stage": "3"}


def predicted(args, system: str, extra) -> dict:
    """The planner's peak memory, step time and tok/s/GPU for the layout `system` runs (empty if it refuses)."""
    from shardlm.config import load_config, parse_overrides
    from shardlm.plan import Layout, Workload, estimate, gpu
    try:
        cfg = load_config(args.preset, {**overrides(args, system), **parse_overrides(list(extra))})
        e = estimate(cfg.model, Workload(args.seq, micro_batch(args), args.global_batch), Layout.from_config(cfg),
                     gpu(args.card))
    except Exception as err:  # noqa: BLE001 (a refused layout: the row still runs and says so)
        print(f"{system}: the planner refuses the layout: {err}", file=sys.stderr)
        return {}
    return {"predicted_mem_gib": e.memory.total / 2**30, "predicted_step_s": e.step_time_s,
            "predicted_tok_s_gpu": e.tokens_per_s / args.gpus}


def hf_llama(m, seq: int, device: str):
    """Transformers' Llama of shardlm's shape (fp32 parameters on this rank's GPU, seed 0)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardlm.hf_config import hf_config_from_model
    keys = {k: v for k, v in hf_config_from_model(m).items() if k not in ("architectures", "model_type", "torch_dtype")}
    keys["max_position_embeddings"] = max(keys["max_position_embeddings"], seq)
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(LlamaConfig(**keys, attn_implementation="sdpa", use_cache=False))


def torch_cp_step(args, m, world: int):
    """One optimizer step of HF's Llama under FSDP2 over dp x cp, each micro-batch in `context_parallel`."""
    import torch
    import torch.nn.functional as F
    import transformers.integrations.sdpa_attention as hf_sdpa
    import transformers.masking_utils as hf_masks
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method
    from torch.nn.attention import SDPBackend, sdpa_kernel
    hf_masks.find_packed_sequence_indices = lambda position_ids: None  # see the module's docstring
    hf_sdpa.use_gqa_in_sdpa = lambda *a, **k: False
    dp = world // args.cp
    dev = args.device
    mesh = init_device_mesh(dev, (dp, args.cp), mesh_dim_names=("dp", "cp"))
    shard_mesh = mesh["cp"] if dp == 1 else mesh["dp", "cp"]._flatten("dp_cp")
    model = hf_llama(m, args.seq, dev)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=shard_mesh, mp_policy=mp)
    fully_shard(model, mesh=shard_mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    set_rotate_method(args.rotate)
    mb = args.torch_micro_batch or micro_batch(args)
    n_micro = max(1, args.global_batch // (dp * mb))
    gen = torch.Generator(device=dev).manual_seed(mesh["dp"].get_local_rank())  # each replica its own data
    data = [torch.randint(0, m.vocab_size, (mb, args.seq + 1), device=dev, generator=gen) for _ in range(n_micro)]

    def step():
        for tokens in data:
            inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
            pos = torch.arange(args.seq, device=dev).repeat(mb, 1)
            bufs = [inputs, labels, pos]
            with context_parallel(mesh["cp"], buffers=bufs, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(bufs)), \
                    sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                logits = model(input_ids=inputs, position_ids=pos, use_cache=False).logits
                loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()) / n_micro
                del logits
                loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def worker(args, extra):
    import torch
    import torch.distributed as dist
    from shardlm.config import load_config
    world, rank, cuda = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0)), args.device == "cuda"
    row = {"system": args.system, "gpus": world}
    trainer = None
    try:
        if args.system in SHARDLM:
            trainer, step = shardlm_trainer(args.preset, overrides(args, args.system), extra)
            m = trainer.cfg.model
        else:
            row["rotate"] = args.rotate
            m = load_config(args.preset).model
            if cuda:
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            if not dist.is_initialized():
                dist.init_process_group("nccl" if cuda else "gloo")
            step = torch_cp_step(args, m, world)
        dt, mem = timed(step, args.warm, args.steps, args.device)
        if trainer is not None and cuda:
            mem += trainer.parallel.symmetric_bytes() / 2**30
        peak = torch.tensor([mem], device=args.device)
        if dist.is_initialized():
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        tok = args.global_batch * args.seq / dt / world
        row.update(step_s=dt, tok_s_gpu=tok, mfu=tok * m.flops_per_token(args.seq) / PEAK, peak_mem_gib=float(peak))
        if args.profile:  # after timing: rank 0's trace and kernel table, where the step's time goes
            got = profile_steps(step, args.profile, args.device,
                                Path(args.profile_dir) / f"{args.system}.trace.json" if rank == 0 else None)
            if got is not None:
                Path(args.profile_dir, f"{args.system}.kernels.txt").write_text(got.pop("table"))
                row["profile"] = {**got, "idle": 1 - got["busy_ms"] / (1e3 * dt)}
    except Exception as e:  # noqa: BLE001 (the row says why; the driver goes on to the next system)
        import traceback
        traceback.print_exc()
        row["error"] = f"{type(e).__name__}: {e}"[:500]
        if cuda and torch.cuda.is_available():
            row["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if rank == 0 or "error" in row:  # a failing rank's own error, whichever rank it is
        print("RESULT " + json.dumps(row), flush=True)
    if "error" in row:
        sys.exit(1)  # torchrun ends the other ranks, which may wait in a collective
    if trainer is not None:
        trainer.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def fmt(x, width: int, spec: str = ".1f", suffix: str = "") -> str:
    """`x` right-aligned in `width` characters ("-" when None)."""
    return f"{'-' if x is None else format(x, spec) + suffix:>{width}}"


def table(args, rows: list[dict]) -> None:
    by = {r["system"]: r for r in rows}
    print(f"\n{args.card_name} x{args.gpus}, {args.preset}, seq {args.seq}, cp {args.cp} x dp {args.gpus // args.cp}, "
          f"global batch {args.global_batch}, micro-batch {micro_batch(args)}, ZeRO-3, recompute {args.recompute}")
    print(f"{'system':<17}{'tok/s/GPU':>10}{'MFU':>7}{'peak GiB':>9}{'pred GiB':>9}{'mem err':>8}{'step s':>8}"
          f"{'pred s':>8}{'time err':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['system']:<17}{'failed':>10}  {r['error'][:150]}")
            continue
        pm, ps = r.get("predicted_mem_gib"), r.get("predicted_step_s")
        merr = pm / r["peak_mem_gib"] - 1 if pm and r["peak_mem_gib"] else None
        terr = ps / r["step_s"] - 1 if ps else None
        print(f"{r['system']:<17}{r['tok_s_gpu']:>10.0f}{100 * r['mfu']:>6.1f}%{r['peak_mem_gib']:>9.1f}"
              f"{fmt(pm, 9)}{fmt(None if merr is None else 100 * merr, 8, '+.1f', '%')}"
              f"{r['step_s']:>8.3f}{fmt(ps, 8, '.3f')}{fmt(None if terr is None else 100 * terr, 9, '+.1f', '%')}")
    ok = {s: r for s, r in by.items() if "error" not in r}
    ring, uly, tcp = ok.get("shardlm-ring"), ok.get("shardlm-ulysses"), ok.get("torch-cp")
    if ring and uly:
        mem = f"{ring['peak_mem_gib'] / uly['peak_mem_gib']:.3f}" if uly["peak_mem_gib"] else "-"
        print(f"ring / Ulysses: tok/s {ring['tok_s_gpu'] / uly['tok_s_gpu']:.3f} (floor >= 0.85), "
              f"peak memory {mem} (floor <= 1.05)")
    if ring:
        if tcp:
            print(f"ring / torch-cp ({tcp['rotate']}): tok/s {ring['tok_s_gpu'] / tcp['tok_s_gpu']:.3f} (floor >= 1.2), "
                  f"peak memory {ring['peak_mem_gib'] / tcp['peak_mem_gib'] if tcp['peak_mem_gib'] else 0:.3f}")
        elif "torch-cp" in by:
            print(f"ring / torch-cp: torch-cp failed ({by['torch-cp']['error'][:200]})")
        if ring.get("predicted_mem_gib") and ring["peak_mem_gib"]:
            print(f"planner, ring: memory {100 * (ring['predicted_mem_gib'] / ring['peak_mem_gib'] - 1):+.1f}% "
                  f"(floor 10%), step time {100 * (ring['predicted_step_s'] / ring['step_s'] - 1):+.1f}% (floor 25%)")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--preset", default="llama2-7b")
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--global-batch", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=0, help="per rank; 0: global batch / dp (no accumulation)")
    p.add_argument("--torch-micro-batch", type=int, default=0, help="torch-cp's (accumulating); 0: --micro-batch's")
    p.add_argument("--recompute", default="none", choices=("none", "selective", "full"))
    p.add_argument("--compile", type=int, default=1, help="shardlm's blocks compiled (on GPUs)")
    p.add_argument("--rotate", default="alltoall", choices=("alltoall", "allgather"), help="torch-cp's K/V rotation")
    p.add_argument("--warm", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--card", default=None, help="the planner's GPU (h100, h200, ...); default: the one found")
    p.add_argument("--device", default="cuda", help="cpu: a gloo smoke run of the shardlm systems, not recorded")
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument("--profile", type=int, default=0, help="steps profiled after timing (rank 0's trace)")
    p.add_argument("--profile-dir", default="profiles", help="rank 0's trace and kernel table per system")
    driver_args(p, timeout=150)
    args, extra = p.parse_known_args()
    if args.gpus % args.cp:
        p.error(f"--gpus {args.gpus} must divide by --cp {args.cp}")
    if args.system:
        return worker(args, extra)
    cuda = args.device == "cuda"
    args.card_name = "cpu"
    if cuda:
        import torch
        args.card_name = torch.cuda.get_device_name()
    args.card = args.card or ("h200" if "H200" in args.card_name or not cuda else "h100")
    env = job_env(ROOT)
    if not cuda:
        env = {**env, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    own = forwarded(args, ("gpus", "cp", "preset", "seq", "global_batch", "micro_batch", "torch_micro_batch", "recompute", "compile",
                           "rotate", "warm", "steps", "card", "device", "profile", "profile_dir"))
    rows, start = [], time.monotonic()
    for s in args.systems:
        if s == "torch-cp" and not cuda:
            print("torch-cp: skipped on the CPU (context_parallel's ring runs SDPA's CUDA flash/efficient kernels)",
                  file=sys.stderr)
            continue
        left = None if args.budget is None else args.budget - (time.monotonic() - start)
        if left is not None and left < 60:
            rows.append({"system": s, "gpus": args.gpus, "error": f"skipped: {left:.0f} s of --budget left"})
            continue
        got = run_systems(__file__, [s], lambda _: args.gpus, lambda _: [*own, *extra] if s in SHARDLM else own,
                          env, args.timeout, left)
        row = got[0] if got else {"system": s, "gpus": args.gpus,
                                  "error": "no result: the job died or ran past its time (its stderr is above)"}
        if s in SHARDLM:
            row.update(predicted(args, s, extra))
        rows.append(row)
    table(args, rows)
    for r in rows:
        if r.get("profile"):
            pr = r["profile"]
            print(f"{r['system']}: GPU busy {pr['busy_ms']:.0f} ms a step (idle {100 * pr['idle']:.0f}%), "
                  + ", ".join(f"{k} {v:.0f}" for k, v in sorted(pr["kinds_ms"].items(), key=lambda x: -x[1])) + " ms; "
                  f"{pr['kernels_per_step']:.0f} kernels; top: {pr['top'][0][0][:60]} {pr['top'][0][1]:.0f} ms")
    if not cuda:
        print("(a CPU smoke run: nothing recorded)", file=sys.stderr)
        return
    if args.record and rows:
        shape = (f"--gpus {args.gpus} --cp {args.cp} --preset {args.preset} --seq {args.seq} "
                 f"--global-batch {args.global_batch}")
        keep = ("step_s", "error", "ended", "rotate", "predicted_mem_gib", "predicted_step_s", "predicted_tok_s_gpu")
        record(args.record, "context_parallel", args.card_name, args.gpus,
               [{"system": r["system"], "model": args.preset, "seq": args.seq, "cp": args.cp,
                 "dp": args.gpus // args.cp, "global_batch": args.global_batch,
                 "micro_batch": (args.torch_micro_batch if r["system"] == "torch-cp" else 0) or micro_batch(args),
                 "recompute": args.recompute, "tok_s_gpu": round(r["tok_s_gpu"]) if "tok_s_gpu" in r else None,
                 "mfu": round(r["mfu"], 4) if "mfu" in r else None,
                 "peak_mem_gib": round(r["peak_mem_gib"], 2) if r.get("peak_mem_gib") is not None else None,
                 **{k: (round(r[k], 4) if isinstance(r[k], float) else r[k]) for k in keep if k in r},
                 "command": f"python bench/context_parallel.py {shape} --systems {r['system']} "
                            f"{f'--torch-micro-batch {args.torch_micro_batch} ' if r['system'] == 'torch-cp' and args.torch_micro_batch else ''}"
                            f"{' '.join(extra)}".rstrip()} for r in rows])


if __name__ == "__main__":
    main()
