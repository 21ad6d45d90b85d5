"""Mixture-of-experts training speed (issue 44's check): shardlm's MoE beside Hugging Face transformers'
MixtralForCausalLM of exactly the same shape, on one GPU and with expert parallelism on two or more.

    python bench/moe.py --gpus 1|2|4 [--preset moe-1b] [--seq 2048] [--micro-batch 4] [--routing natural|balanced|both]
                        [--systems ...] [--budget S] [--record FILE] [--profile N [--profile-dir DIR]]
                        [--memory-snapshot DIR]
                        [--shardlm.extra overrides]

Each system runs as its own `torchrun` job (clean allocator, honest peaks); with --routing both, one job warms up
(compiles) both routings, then times each in --rounds rounds, alternating which goes first (a machine just started
runs its first minutes slower), and reports each one's median round (the routing read at each step: a compiled
graph recompiles on the first switch).
Every system trains on the same batches, shardlm's default corpus (text routes less evenly than random ids).
- 1 GPU: `shardlm` (Trainer: bf16 parameters, fp32 masters, fused AdamW, blocks compiled), its
  `shardlm-bf16-optimizer` variant (train.optimizer_dtype bf16: masters and moments in bf16, as HF's run keeps
  its AdamW states; `shardlm-bf16-optimizer-kept-grads` keeps one gradient buffer for the run, train.free_grads
  false), and HF's Mixtral in
  bf16 weights with torch's fused AdamW as ../shared/bench/peer_baseline.py measures it, with
  `experts_implementation="grouped_mm"` compiled (`hf-grouped-compiled`) and eager (`hf-grouped`), and
  `"eager"` (`hf-eager`, a Python loop over experts).
- 2+ GPUs: `shardlm-ep` (parallel.ep = dp = GPUs, ZeRO-1: faster than DDP for the dense part on 2 H200s in
  data_parallel's rows; `shardlm-ep-ddp` is the DDP variant, `shardlm-ep-exact` sends rows by exact counts
  (parallel.ep_dispatch exact) where shardlm-ep takes the default (padded at ep 2), `shardlm-ep-bf16-optimizer` keeps its AdamW
  state in bf16 as HF's run does), `shardlm-zero3` (ep 1, ZeRO-3), and `hf-fsdp2`
  (HF's model, grouped_mm experts, FSDP2 `fully_shard` per decoder layer, bf16 compute / fp32 reduce, as
  the peer's fsdp()).
Forced-balanced routing: the router's logits and softmax are computed as usual, then token t's k experts
are (t k + j) mod E, j < k (round-robin: every expert gets exactly T k / E copies), weighted by their softmax
scores renormalised over the k. A bench-only monkeypatch of shardlm's `MoE.route` and of transformers'
`MixtralTopKRouter.forward`, no config key. Rows (bench "moe"): tok/s/GPU, MFU on ACTIVE parameters
(ModelConfig.flops_per_token: 6 x active matmul parameters + attention, against common.PEAK), peak GiB
allocated, the worst layer's expert load max/mean and dropped token copies over the timed steps (shardlm's
per-layer statistics; HF's from a forward hook on each MixtralSparseMoeBlock's router counting its top-k
choices per expert, summed over ranks; HF is dropless: 0). `--device cpu` is a smoke run on gloo
(mixtral-tiny), never recorded.
--profile N: after each routing's timing, N more steps under torch.profiler (common.profile_steps), rank 0's
chrome trace written to --profile-dir as SYSTEM-ROUTING.trace.json(.gz), its top 25 kernels by total time to
SYSTEM.kernels.txt; the end of the output then gives each one's GPU busy ms per step by kernel class (gemm:
names with gemm/nvjet/cutlass/sm90/grouped; elem: elementwise/reduce/triton; attn, nccl, copy, other), the
idle fraction (1 - busy / the unprofiled timed step) and its top 5 kernels. On the CPU: CPU operators only.
--memory-snapshot DIR: the allocator's history on while the model is built and warmed up (its Python stacks
cost time, so not while timing), then one more step after the first routing's timing: what was live at that
step's peak of allocated bytes, by allocation site (the innermost frame in shardlm's, transformers' or this
bench's sources: common.memory_at_peak), printed at the end; the snapshot (rank 0's) written to DIR as
SYSTEM-ROUTING.memory.pickle for pytorch.org/memory_viz. GPU only.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from common import (PEAK, busy_line, driver_args, forwarded, job_env, memory_at_peak, profile_steps, record,
                    record_memory_history, run_systems, shardlm_trainer, timed)

ROOT = Path(__file__).resolve().parents[1]
ONE = ("shardlm", "hf-grouped-compiled", "hf-grouped", "hf-eager")
MANY = ("shardlm-ep", "shardlm-zero3", "hf-fsdp2")
SHARDLM = {"shardlm": {}, "shardlm-bf16-optimizer": {"train.optimizer_dtype": "bf16", "train.precision": "bf16"},
           "shardlm-bf16-optimizer-kept-grads": {"train.optimizer_dtype": "bf16", "train.precision": "bf16",
                                                 "train.free_grads": "false"},
           "shardlm-ep": {"parallel.ep": "W", "parallel.zero_stage": "1"},
           "shardlm-ep-exact": {"parallel.ep": "W", "parallel.zero_stage": "1", "parallel.ep_dispatch": "exact"},
           "shardlm-ep-ddp": {"parallel.ep": "W"}, "shardlm-zero3": {"parallel.zero_stage": "3"},
           "shardlm-ep-bf16-optimizer": {"parallel.ep": "W", "parallel.zero_stage": "1",
                                         "train.optimizer_dtype": "bf16", "train.precision": "bf16"}}
HF = {"hf-grouped-compiled": "grouped_mm", "hf-grouped": "grouped_mm", "hf-eager": "eager", "hf-fsdp2": "grouped_mm"}
BALANCED = {"on": False}  # read inside the patched routers at every call (dynamo guards on it)


def _round_robin(tokens: int, k: int, e: int, device):
    import torch
    return (torch.arange(tokens * k, device=device) % e).view(tokens, k)


def patch_shardlm_router() -> None:
    """shardlm's MoE.route (ExpertParallelMoE inherits it): the same logits, the round-robin experts."""
    from shardlm.model.moe import MoE
    natural = MoE.route

    def route(self, x):
        logits, experts, weights = natural(self, x)
        if not BALANCED["on"]:
            return logits, experts, weights
        experts = _round_robin(x.shape[0], self.top_k, self.num_experts, x.device)
        scores = logits.softmax(-1) if self.scoring == "softmax" else logits.sigmoid()
        weights = scores.gather(-1, experts)
        return logits, experts, weights / weights.sum(-1, keepdim=True) if self.renormalize else weights
    MoE.route = route


def patch_hf_router() -> None:
    """transformers' MixtralTopKRouter.forward (what MixtralSparseMoeBlock calls for its top-k)."""
    from transformers.models.mixtral import modeling_mixtral
    router = modeling_mixtral.MixtralTopKRouter
    natural = router.forward

    def forward(self, hidden_states):
        logits, weights, experts = natural(self, hidden_states)
        if not BALANCED["on"]:
            return logits, weights, experts
        experts = _round_robin(logits.shape[0], self.top_k, self.num_experts, logits.device)
        weights = logits.float().softmax(-1).gather(-1, experts)
        return logits, weights / weights.sum(-1, keepdim=True), experts
    router.forward = forward


def hf_model(m, impl: str, seq: int, device: str):
    """Transformers' Mixtral of shardlm's shape, through the config shardlm's export writes."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    from shardlm.hf_config import hf_config_from_model
    keys = {k: v for k, v in hf_config_from_model(m).items() if k not in ("architectures", "model_type", "torch_dtype")}
    keys["max_position_embeddings"] = max(keys["max_position_embeddings"], seq)
    cfg = MixtralConfig(**keys, attn_implementation="sdpa", experts_implementation=impl)
    torch.manual_seed(0)
    with torch.device(device):
        model = MixtralForCausalLM(cfg)
    assert model.config._experts_implementation == impl, model.config._experts_implementation
    return model


def count_hf_loads(model) -> list:
    """A forward hook on each MixtralSparseMoeBlock's router adding its top-k choices per expert to an int64
    buffer of the router's, `bench_load` (in-graph under torch.compile: registered before it); the routers."""
    import torch
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    def hook(router, inputs, out):
        experts = out[2].reshape(-1, 1)
        router.bench_load.add_((experts == torch.arange(router.num_experts, device=experts.device)).sum(0))
    routers = [r for r in model.modules() if isinstance(r, MixtralTopKRouter)]  # each sparse block's gate
    for r in routers:
        r.register_buffer("bench_load", torch.zeros(r.num_experts, dtype=torch.int64,
                                                    device=r.weight.device), persistent=False)
        r.register_forward_hook(hook)
    return routers


def hf_loads(routers) -> dict:
    """Each router's counts since the last call (summed over ranks: each routes its own tokens) as shardlm's
    statistics name them, the counts zeroed."""
    import torch
    import torch.distributed as dist
    if not routers:
        return {}
    table = torch.stack([r.bench_load for r in routers]).double()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(table)
    for r in routers:
        r.bench_load.zero_()
    return {f"moe/layer{i}/max_over_mean": (row.max() / row.mean()).item() for i, row in enumerate(table.cpu())
            if row.sum() > 0}


def hf_step(system: str, m, args, world: int):
    import torch
    import torch.distributed as dist

    from shardlm.data.default import default_corpus
    from shardlm.data.loader import open_train_data
    model = hf_model(m, HF[system], args.seq, args.device)
    routers = count_hf_loads(model)
    # shardlm's own batches (the default corpus, each rank its share): natural routing then routes the same
    # tokens in both systems, where random ids would spread them more evenly than text does.
    rank = dist.get_rank() if dist.is_initialized() else 0
    data = open_train_data(default_corpus(), None, 0, args.seq, m.vocab_size, 0, args.micro_batch * world,
                           args.micro_batch, world, rank)
    taken = [0]
    if system == "hf-fsdp2":  # the peer's FSDP2: fp32 parameters, bf16 compute, fp32 gradient reduction
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        kw = {"mp_policy": mp}
        if args.device == "cpu":
            from torch.distributed.device_mesh import init_device_mesh
            kw["mesh"] = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        fwd = model
    else:  # the peer's single(amp_fp32_master=False): bf16 weights, no autocast
        model = model.bfloat16()
        fwd = torch.compile(model) if system == "hf-grouped-compiled" else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step():
        x, _ = data.micro_batch_at(taken[0], 0)
        taken[0] += 1
        x = x.to(args.device, non_blocking=True)
        fwd(input_ids=x, labels=x).loss.backward()  # the model shifts the labels, as shardlm's targets are
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step, routers


def worker(args, extra):
    import torch
    import torch.distributed as dist

    from shardlm.config import load_config, parse_overrides
    system, routings = args.system, ["natural", "balanced"] if args.routing == "both" else [args.routing]
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    cuda = args.device == "cuda"
    base = load_config(args.preset)
    over = {"train.seq_len": str(args.seq), "model.max_seq_len": str(max(args.seq, base.model.max_seq_len)),
            "train.micro_batch_size": str(args.micro_batch), "train.global_batch_size": str(args.micro_batch * world),
            "train.steps": "1000000", "train.eval_every": "0", "train.tensorboard": "false",
            "train.device": args.device, "train.precision": "bf16" if cuda else "fp32",
            "train.compile": str(cuda).lower(), "parallel.dp": str(world)}
    for k, v in SHARDLM.get(system, {}).items():
        over[k] = str(world) if v == "W" else v
    if system in SHARDLM:
        over.update(parse_overrides(extra))
    cfg = load_config(args.preset, over)
    m = cfg.model
    trainer = None
    if args.memory_snapshot and rank == 0:
        record_memory_history(args.device)  # before the model and its states exist, so that they are named too
    if system in SHARDLM:
        patch_shardlm_router()
        # Python's collector on Trainer.run's schedule: left to itself it stops one rank at a time, and the
        # other waits at the next all-to-all
        trainer, step = shardlm_trainer(args.preset, over)
    else:
        patch_hf_router()
        if world > 1 and not dist.is_initialized():
            if cuda:
                torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            dist.init_process_group("nccl" if cuda else "gloo")
        step, routers = hf_step(system, m, args, world)
    def loads() -> dict:  # the statistics since the last call (a collective)
        return trainer.moe.stats() if trainer else hf_loads(routers)

    for routing in routings:  # every routing compiled before any is timed (a switch recompiles once)
        BALANCED["on"] = routing == "balanced"
        for _ in range(args.warm):
            step()
    if args.memory_snapshot and rank == 0:
        record_memory_history(args.device, on=False)  # timed without the stacks' cost
    # Rounds alternate which routing goes first, so that neither takes the machine's slower start alone.
    times, peaks, stats = {r: [] for r in routings}, dict.fromkeys(routings, 0.0), {}
    for k in range(args.rounds):
        for routing in routings if k % 2 == 0 else routings[::-1]:
            BALANCED["on"] = routing == "balanced"
            step()  # the switch's step (a graph's guards fail once), then the warm-up's statistics dropped
            loads()
            dt, mem = timed(step, 0, args.steps, args.device)
            times[routing].append(dt)
            peaks[routing] = max(peaks[routing], mem)
            stats[routing] = loads()
    rows = []
    for routing in routings:
        BALANCED["on"] = routing == "balanced"
        dt, mem = statistics.median(times[routing]), peaks[routing]
        if trainer:
            mem += trainer.engine.symmetric_bytes() / 2**30 if cuda else 0.0
        load = [v for key, v in stats[routing].items() if key.endswith("/max_over_mean")]
        ranks = [v for key, v in stats[routing].items() if key.endswith("/ep_max_over_mean")]
        tokens = args.micro_batch * args.seq
        rows.append({"system": system, "routing": routing, "gpus": world, "step_s": dt, "tok_s_gpu": tokens / dt,
                     "mfu": tokens / dt * m.flops_per_token(args.seq) / PEAK, "peak_mem_gib": mem,
                     "rounds_tok_s": [round(tokens / t) for t in times[routing]],
                     "max_over_mean": max(load) if load else None, "ep_max_over_mean": max(ranks) if ranks else None,
                     "dropped_tokens": sum(v for key, v in stats[routing].items() if key.endswith("/dropped"))})
        if rank == 0:  # after each routing: a job cut short keeps what it measured
            print("RESULT " + json.dumps({"rows": rows}), flush=True)
        if args.memory_snapshot and cuda and routing == routings[0]:
            if rank == 0:
                rows[-1]["memory"] = memory_at_peak(step, Path(args.memory_snapshot, f"{system}-{routing}.memory.pickle"))
                print("RESULT " + json.dumps({"rows": rows}), flush=True)
            else:
                step()
        if args.profile:
            trace = Path(args.profile_dir, f"{system}-{routing}.trace.json") if rank == 0 else None
            try:
                prof = profile_steps(step, args.profile, args.device, trace)
            except Exception as e:  # noqa: BLE001 (the timing stands, and the next routing runs)
                prof = {"error": repr(e)[:300]}
            if prof and "table" in prof:
                with open(Path(args.profile_dir, f"{system}.kernels.txt"), "a") as f:
                    f.write(f"{system} {routing}: {args.profile} steps, top kernels by total time (busy "
                            f"{prof['busy_ms']:.2f} ms/step, timed step {dt * 1e3:.2f} ms)\n{prof.pop('table')}\n")
            if prof:
                rows[-1]["profile"] = prof
                print("RESULT " + json.dumps({"rows": rows}), flush=True)
    if trainer is not None:
        trainer.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def print_memory(rows) -> None:
    """Each row's composition at its step's peak of allocated memory (--memory-snapshot)."""
    for r in (r for r in rows if r.get("memory")):
        mem = r["memory"]
        print(f"\n{r['system']} {r['routing']}: peak {mem['peak_gib']:.2f} GiB allocated in a step ({mem['before_gib']:.2f} "
              f"at its start), by where it was allocated (snapshot {mem['snapshot']}):")
        for where, gib in mem["top"]:
            print(f"  {gib:7.3f}  {where}")
        print(f"  {mem['rest_gib']:7.3f}  the rest")


def print_profiles(rows, where: str) -> None:
    """Each profiled row's top kernels, then one line each: where a step's GPU time goes (ms per step)."""
    for r in rows:
        if "error" in r.get("profile", {}):
            print(f"{r['system']} {r['routing']}: profiling failed: {r.pop('profile')['error']}")
    rows = [r for r in rows if r.get("profile")]
    if not rows:
        return
    print(f"\nprofiles in {where}: top kernels (ms/step, class, name)")
    for r in rows:
        print(f"{r['system']} {r['routing']}:")
        for name, ms, kind in r["profile"]["top"]:
            print(f"  {ms:8.2f}  {kind:<6}{name}")
    print("GPU busy per step (the union of kernels, copies and sets over streams) by kernel class; idle = 1 - "
          "busy / the unprofiled step")
    for r in rows:
        print(busy_line(f"{r['system']} {r['routing']}", r["step_s"] * 1e3, r["profile"]))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--preset", default=None, help="default moe-1b (mixtral-tiny with --device cpu)")
    p.add_argument("--seq", type=int, default=None, help="default 2048 (128 with --device cpu)")
    p.add_argument("--micro-batch", type=int, default=None, help="default 4 (2 with --device cpu)")
    p.add_argument("--warm", type=int, default=3, help="steps before each routing's timing (compilation)")
    p.add_argument("--steps", type=int, default=15, help="timed steps of each routing in each round")
    p.add_argument("--rounds", type=int, default=1,
                   help="timings of each routing, alternating which goes first; the median round is reported")
    p.add_argument("--routing", default="both", choices=("natural", "balanced", "both"))
    p.add_argument("--device", default="cuda", help="cpu: a smoke run on gloo (mixtral-tiny), not recorded")
    p.add_argument("--profile", type=int, default=0, help="steps profiled after each routing's timing")
    p.add_argument("--profile-dir", default="profiles", help="where --profile writes traces and kernel tables")
    p.add_argument("--memory-snapshot", default=None, metavar="DIR",
                   help="after the first routing's timing, one step with the allocator's history: what is live at "
                        "its peak, by allocation site (the snapshot written to DIR)")
    p.add_argument("--systems", nargs="+", default=None,
                   help=f"default {' '.join(ONE)} on 1 GPU, {' '.join(MANY)} on more; also shardlm-ep-ddp, shardlm-ep-exact, "
                        "shardlm-ep-bf16-optimizer, shardlm-bf16-optimizer(-kept-grads) (1 GPU)")
    driver_args(p, timeout=480)
    args, extra = p.parse_known_args()
    cpu = args.device == "cpu"  # a smoke run: a shape two gloo ranks train in seconds, in a few GiB
    args.preset = args.preset or ("mixtral-tiny" if cpu else "moe-1b")
    args.seq = args.seq or (128 if cpu else 2048)
    args.micro_batch = args.micro_batch or (2 if cpu else 4)
    if args.system:
        return worker(args, extra)
    systems = args.systems or list(ONE if args.gpus == 1 else MANY)
    for s in systems:
        if s not in SHARDLM and s not in HF:
            p.error(f"unknown system {s}")
        if args.gpus > 1 and s in ONE[1:] or args.gpus == 1 and (s.startswith("shardlm-ep") or s == "hf-fsdp2"):
            p.error(f"{s} runs on {'1 GPU' if s in ONE else '2 or more'}")
    env = job_env(ROOT)
    if args.device == "cpu":
        env = {**env, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    args.profile_dir = str(Path(args.profile_dir).resolve())
    if args.profile:  # an earlier run's files of these systems go (the tables are appended to, routing by routing)
        for s in systems:
            traces = (f"{s}-{r}.trace.json{z}" for r in ("natural", "balanced") for z in ("", ".gz"))
            for old in (f"{s}.kernels.txt", *traces):
                Path(args.profile_dir, old).unlink(missing_ok=True)
    if args.memory_snapshot:
        args.memory_snapshot = str(Path(args.memory_snapshot).resolve())
        Path(args.memory_snapshot).mkdir(parents=True, exist_ok=True)
    own = forwarded(args, ("preset", "seq", "micro_batch", "warm", "steps", "rounds", "routing", "device", "profile",
                           "profile_dir", "memory_snapshot"))
    jobs = run_systems(__file__, systems, lambda s: args.gpus, lambda s: [*own, *extra] if s in SHARDLM else own,
                       env, args.timeout, args.budget)
    rows = [{**r, **({"ended": j["ended"]} if "ended" in j else {})} for j in jobs for r in j["rows"]]
    card = "cpu"
    if args.device == "cuda":
        import torch
        card = torch.cuda.get_device_name()
    ref = "hf-grouped-compiled" if args.gpus == 1 else "hf-fsdp2"
    by = {(r["system"], r["routing"]): r for r in rows}
    print(f"\n{card} x{args.gpus}, {args.preset}, seq {args.seq}, micro-batch {args.micro_batch}/GPU "
          f"(MFU on active parameters)")
    print(f"{'system':<28}{'routing':<10}{'tok/s/GPU':>10}{'MFU':>7}{'peak GiB':>9}{'max/mean (ep)':>14}{'dropped':>8}"
          f"{'x ' + ref:>23}")
    for r in rows:
        b = by.get((ref, r["routing"]))
        load = f"{r['max_over_mean']:.2f}" if r["max_over_mean"] else "-"
        if r.get("ep_max_over_mean"):  # the busiest expert-parallel rank's load
            load = f"{load}/{r['ep_max_over_mean']:.2f}"
        print(f"{r['system']:<28}{r['routing']:<10}{r['tok_s_gpu']:>10.0f}{100 * r['mfu']:>6.1f}%"
              f"{r['peak_mem_gib']:>9.1f}{load:>14}{r['dropped_tokens']:>8}"
              f"{r['tok_s_gpu'] / b['tok_s_gpu'] if b else float('nan'):>23.2f}")
    for s in dict.fromkeys(r["system"] for r in rows):
        n, b = by.get((s, "natural")), by.get((s, "balanced"))
        if n and b:
            print(f"{s}: balanced / natural routing {b['tok_s_gpu'] / n['tok_s_gpu']:.3f}")
    print_profiles(rows, args.profile_dir)
    print_memory(rows)
    if args.device != "cuda":
        print("(a CPU smoke run: nothing recorded)", file=sys.stderr)
        return
    if args.record:
        shape = f"--preset {args.preset} --seq {args.seq} --micro-batch {args.micro_batch}"
        record(args.record, "moe", card, args.gpus,
               [{"system": r["system"], "routing": r["routing"], "model": args.preset, "seq": args.seq,
                 "micro_batch": args.micro_batch, "tok_s_gpu": round(r["tok_s_gpu"]), "mfu": round(r["mfu"], 4),
                 "peak_mem_gib": round(r["peak_mem_gib"], 2), "step_s": r["step_s"],
                 "max_over_mean": r["max_over_mean"], "ep_max_over_mean": r.get("ep_max_over_mean"),
                 "dropped_tokens": r["dropped_tokens"],
                 **({"ended": r["ended"]} if "ended" in r else {}),
                 "command": f"python bench/moe.py --gpus {args.gpus} {shape} --systems {r['system']} "
                            f"--routing {r['routing']} --steps {args.steps} --rounds {args.rounds} "
                            f"{' '.join(extra)}".rstrip()} for r in rows])


if __name__ == "__main__":
    main()
