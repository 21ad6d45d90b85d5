"""Single-GPU training speed: shardlm beside Hugging Face transformers' LlamaForCausalLM of the same shape.

    python bench/single_gpu.py [--preset tinyllama-1.1b] [--seq 2048] [--micro-batch 4] [--systems ...]

Each system runs in its own subprocess (clean allocator, honest peak memory): shardlm's trainer step
(bf16 parameters, fp32 masters, fused AdamW), and HF's model three ways as ../shared/bench/peer_baseline.py
measures it: eager under autocast (fp32 weights), pure bf16, and torch.compile under autocast. Every
system is charged the same FLOPs per token, 6 x (parameters - input embedding) + 12 x layers x hidden x
seq (the torchtitan convention), against the 989 TFLOP/s dense bf16 peak of an H100/H200. Prints a table
with ratios to hf-compile and appends one row per system to bench/results.jsonl (bench "single_gpu").
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from common import PEAK, timed

ROOT = Path(__file__).resolve().parents[1]


def run_shardlm(args, extra: list[str]):
    from shardlm.config import load_config, parse_overrides
    from shardlm.trainer import Trainer
    over = {"train.seq_len": args.seq, "model.max_seq_len": max(args.seq, load_config(args.preset).model.max_seq_len), "train.micro_batch_size": args.micro_batch,
            "train.global_batch_size": args.micro_batch, "train.precision": "bf16", "train.steps": 10**6,
            "train.eval_every": 0, "train.tensorboard": "false", "train.device": "cuda"}
    over.update(parse_overrides(extra))
    cfg = load_config(args.preset, over)
    trainer = Trainer(cfg, out_dir=None, log=lambda *a: None)

    def step():
        trainer.train_step()
        trainer.step += 1
    return timed(step, args.warm, args.steps), cfg.model


def run_hf(args, mode: str):
    from transformers import LlamaConfig, LlamaForCausalLM
    from shardlm.config import load_config
    m = load_config(args.preset).model
    hf_cfg = LlamaConfig(hidden_size=m.hidden_size, intermediate_size=m.ffn_size, num_hidden_layers=m.num_layers,
                         num_attention_heads=m.num_heads, num_key_value_heads=m.kv_heads, vocab_size=m.vocab_size,
                         max_position_embeddings=max(m.max_seq_len, args.seq), rope_theta=m.rope_theta,
                         rms_norm_eps=m.norm_eps, tie_word_embeddings=m.tie_embeddings, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(hf_cfg)
    amp = mode != "hf-bf16"
    if not amp:
        model = model.bfloat16()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    fwd = torch.compile(model) if mode == "hf-compile" else model
    x = torch.randint(0, m.vocab_size, (args.micro_batch, args.seq), device="cuda")

    def step():
        with torch.autocast("cuda", torch.bfloat16, enabled=amp):
            loss = fwd(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return timed(step, args.warm, args.steps), m


def child(args, system: str, extra: list[str]) -> None:
    (dt, mem), m = run_shardlm(args, extra) if system.startswith("shardlm") else run_hf(args, system)
    tokens = args.micro_batch * args.seq
    flops = m.flops_per_token(args.seq)
    print("RESULT " + json.dumps({"system": system, "step_s": dt, "tok_s_gpu": tokens / dt,
                                  "mfu": tokens / dt * flops / PEAK, "peak_mem_gib": mem}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tinyllama-1.1b")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--warm", type=int, default=5)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--systems", nargs="+", default=["shardlm", "hf-eager", "hf-bf16", "hf-compile"],
                   help="shardlm[:label:--key value ...] variants, hf-eager, hf-bf16, hf-compile")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--record", default=str(ROOT / "bench" / "results.jsonl"), help="JSONL file to append to ('' for none)")
    args, extra = p.parse_known_args()
    if args.child:
        return child(args, args.child, extra)
    card = torch.cuda.get_device_name()
    rows = []
    for spec in args.systems:
        system, *over = spec.split(":")
        label = over[0] if over else system
        # Extra tokens are config overrides (--train.compile true) or environment settings (NAME=value).
        tokens = over[1].split() if len(over) > 1 else []
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), **dict(t.split("=", 1) for t in tokens if "=" in t and not t.startswith("--"))}
        cmd = [sys.executable, __file__, "--child", system, "--preset", args.preset, "--seq", str(args.seq),
               "--micro-batch", str(args.micro_batch), "--warm", str(args.warm), "--steps", str(args.steps),
               *(t for t in tokens if t.startswith("--") or "=" not in t)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not lines:
            print(f"{label}: failed\n{proc.stderr[-3000:]}", file=sys.stderr)
            continue
        r = json.loads(lines[-1][7:])
        r["system"] = label
        r["spec"] = spec
        rows.append(r)
        print(json.dumps(r), flush=True)
    base = next((r for r in rows if r["system"] == "hf-compile"), None)
    print(f"\n{card}, {args.preset}, seq {args.seq}, micro-batch {args.micro_batch}")
    print(f"{'system':<28}{'tok/s':>10}{'MFU':>8}{'peak GiB':>10}{'x hf-compile':>14}")
    for r in rows:
        ratio = f"{r['tok_s_gpu'] / base['tok_s_gpu']:.2f}" if base else "-"
        print(f"{r['system']:<28}{r['tok_s_gpu']:>10.0f}{100 * r['mfu']:>7.1f}%{r['peak_mem_gib']:>10.1f}{ratio:>14}")
    if not args.record:
        return
    with open(args.record, "a") as f:
        for r in rows:
            f.write(json.dumps({"bench": "single_gpu", "date": datetime.date.today().isoformat(), "card": card,
                                "gpus": 1, "system": r["system"], "model": args.preset, "seq": args.seq,
                                "micro_batch": args.micro_batch, "tok_s_gpu": round(r["tok_s_gpu"]),
                                "mfu": round(r["mfu"], 4), "peak_mem_gib": round(r["peak_mem_gib"], 2),
                                "command": f"python bench/single_gpu.py --seq {args.seq} --micro-batch {args.micro_batch} "
                                           f"--systems '{r['spec']}'"}) + "\n")


if __name__ == "__main__":
    main()
