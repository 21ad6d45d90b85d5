"""Data-parallel speed and memory: shardlm's DDP and ZeRO beside PyTorch's DDP and FSDP2 on the same shardlm
model, HF transformers' LlamaForCausalLM under FSDP2, and DeepSpeed ZeRO-2/3 on the HF model.

    python bench/data_parallel.py --gpus 4 [--systems ...] [--record FILE]

Each system runs as its own `torchrun --nproc-per-node GPUS` job (clean memory, honest peaks). Workload:
the tinyllama-1.1b preset, seq 2048, micro-batch 4 per GPU, bf16, AdamW. shardlm and the torch peers on
the shardlm model compile each block; the HF and DeepSpeed systems run HF's model eagerly under
autocast (what ../shared/bench/peer_baseline.py measures). Every system is charged the same FLOPs per
token (6 x non-embedding parameters + 12 x layers x hidden x seq) against 989 TFLOP/s per GPU.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

from common import PEAK, driver_args, forwarded, host_rate, job_env, run_systems, timed

ROOT = Path(__file__).resolve().parents[1]
SHARDLM = {"shardlm-ddp": [], "shardlm-ddp-bf16reduce": ["--parallel.reduce_dtype", "compute"],
           "shardlm-ddp-a2a": ["--parallel.reduce_algo", "all_to_all"], "shardlm-zero1": ["--parallel.zero_stage", "1"],
           "shardlm-zero1-a2a": ["--parallel.zero_stage", "1", "--parallel.reduce_algo", "all_to_all"],
           "shardlm-zero2": ["--parallel.zero_stage", "2"],
           "shardlm-zero2-a2a": ["--parallel.zero_stage", "2", "--parallel.reduce_algo", "all_to_all"], "shardlm-zero3": ["--parallel.zero_stage", "3"],
           "shardlm-zero3-a2a": ["--parallel.zero_stage", "3", "--parallel.reduce_algo", "all_to_all"],
           "shardlm-zero3-offload": ["--parallel.zero_stage", "3", "--parallel.offload", "optimizer"]}
PEERS = ("torch-ddp", "torch-fsdp2", "hf-fsdp2", "ds-zero2", "ds-zero3")


def worker(args, extra):
    import torch
    import torch.distributed as dist
    from shardlm.config import load_config, parse_overrides
    world = int(os.environ.get("WORLD_SIZE", 1))
    over = {"train.seq_len": str(args.seq), "train.micro_batch_size": str(args.micro_batch),
            "train.global_batch_size": str(args.micro_batch * world), "train.steps": "1000000",
            "train.tensorboard": "false", "train.device": "cuda", "parallel.dp": str(world)}
    over.update(parse_overrides(extra))
    cfg = load_config(args.preset, over)
    m = cfg.model
    torch.manual_seed(0)
    if args.system.startswith("shardlm"):
        from shardlm.trainer import Trainer
        trainer = Trainer(cfg, out_dir=None, log=lambda *a: None)

        def step():
            trainer.train_step()
            trainer.step += 1
    else:
        if world > 1 and not dist.is_initialized():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            dist.init_process_group("nccl")
        x = torch.randint(0, m.vocab_size, (args.micro_batch, args.seq), device="cuda")
        step = peer_step(args.system, cfg, x, world)
    dt, mem = timed(step, args.warm, args.steps)
    if args.system.startswith("shardlm"):
        # Symmetric memory is mapped outside PyTorch's caching allocator, which the peak above counts.
        mem += trainer.engine.symmetric_bytes() / 2**30
    tokens = args.micro_batch * args.seq
    flops = m.flops_per_token(args.seq)
    if int(os.environ.get("RANK", 0)) == 0:
        print("RESULT " + json.dumps({"system": args.system, "gpus": world, "step_s": dt, "tok_s_gpu": tokens / dt,
                                      "mfu": tokens / dt * flops / PEAK, "peak_mem_gib": mem}), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


def peer_step(system, cfg, x, world):
    import torch
    m = cfg.model
    if system in ("torch-ddp", "torch-fsdp2"):
        from shardlm.model import build_model
        model = build_model(m, "cuda", torch.float32, seed=0)
        for block in model.blocks():
            block.compile()
        if system == "torch-ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP
            wrapped = DDP(model, device_ids=[torch.cuda.current_device()], bucket_cap_mb=25) if world > 1 else model
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

            def step():
                with torch.autocast("cuda", torch.bfloat16):
                    loss = wrapped(x[:, :-1], x[:, 1:])
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            return step
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks():
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

        def step():
            model(x[:, :-1], x[:, 1:]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step
    from transformers import LlamaConfig, LlamaForCausalLM
    hf_cfg = LlamaConfig(hidden_size=m.hidden_size, intermediate_size=m.ffn_size, num_hidden_layers=m.num_layers,
                         num_attention_heads=m.num_heads, num_key_value_heads=m.kv_heads, vocab_size=m.vocab_size,
                         max_position_embeddings=m.max_seq_len, attn_implementation="sdpa", tie_word_embeddings=False)
    with torch.device("cuda"):
        model = LlamaForCausalLM(hf_cfg)
    if system == "hf-fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

        def step():
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step
    import deepspeed
    ds_cfg = {"train_micro_batch_size_per_gpu": x.shape[0], "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
              "zero_optimization": {"stage": int(system[-1]), "overlap_comm": True, "contiguous_gradients": True},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                                           config=ds_cfg)

    def step():
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
    return step


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--preset", default="tinyllama-1.1b")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--warm", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)  # 10 left DDP's 4-GPU figure 3% noisy
    p.add_argument("--systems", nargs="+", default=[*SHARDLM, *PEERS])
    driver_args(p, timeout=300)
    args, extra = p.parse_known_args()
    if args.system:
        return worker(args, extra)
    own = forwarded(args, ("preset", "seq", "micro_batch", "warm", "steps"))
    # The command line's `--section.key value` extras go to shardlm's systems (after their own flags)
    rows = run_systems(__file__, args.systems, lambda s: args.gpus,
                       lambda s: [*own, *SHARDLM[s], *extra] if s in SHARDLM else own,
                       job_env(ROOT), args.timeout, args.budget)
    import torch
    card = torch.cuda.get_device_name()
    by = {r["system"]: r for r in rows}
    print(f"\n{card} x{args.gpus}, {args.preset}, seq {args.seq}, micro-batch {args.micro_batch}/GPU")
    print(f"{'system':<24}{'tok/s/GPU':>11}{'MFU':>8}{'peak GiB':>10}{'vs torch-ddp':>14}{'vs torch-fsdp2':>16}")
    for r in rows:
        rel = lambda k: f"{r['tok_s_gpu'] / by[k]['tok_s_gpu']:.2f}" if k in by else "-"  # noqa: E731
        print(f"{r['system']:<24}{r['tok_s_gpu']:>11.0f}{100 * r['mfu']:>7.1f}%{r['peak_mem_gib']:>10.1f}"
              f"{rel('torch-ddp'):>14}{rel('torch-fsdp2'):>16}")
    # The offloaded systems' host side: the rate the host's AdamW pass streams at (the planner's host_bw)
    host_bw = host_rate() if any("offload" in r["system"] for r in rows) else None
    if host_bw:
        print(f"the host's AdamW pass streams {host_bw / 1e9:.0f} GB/s")
    if args.record:
        with open(args.record, "a") as f:
            for r in rows:
                f.write(json.dumps({"bench": "data_parallel", "date": datetime.date.today().isoformat(), "card": card,
                                    **({"host_bw_gb_s": round(host_bw / 1e9, 1)} if host_bw and "offload" in r["system"]
                                       else {}),
                                    "gpus": args.gpus, "system": r["system"], "model": args.preset, "seq": args.seq,
                                    "micro_batch": args.micro_batch, "tok_s_gpu": round(r["tok_s_gpu"]),
                                    "mfu": round(r["mfu"], 4), "peak_mem_gib": round(r["peak_mem_gib"], 2),
                                    "command": f"python bench/data_parallel.py --gpus {args.gpus} --systems {r['system']}"})
                        + "\n")


if __name__ == "__main__":
    main()
