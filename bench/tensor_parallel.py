"""Tensor-parallel speed and memory: shardlm's tensor parallelism beside PyTorch's DTensor tensor parallelism
with the torchtitan plan, and Megatron-core's GPTModel, on the same shapes and the same global batch.

    python bench/tensor_parallel.py --gpus 4 [--systems ...] [--preset llama2-7b --seq 4096 --global-batch 16 --micro-batch 1]
    python bench/tensor_parallel.py --gpus 2 --systems shardlm-tp2-sp dtensor-tp4   # tp 2: the peers take --gpus ranks
    python bench/tensor_parallel.py --gpus 2 --systems shardlm-tp2-sp --local-collectives 1   # the control run

Each system runs as its own `torchrun --nproc-per-node GPUS` job (clean memory, honest peaks); a step is the
global batch as micro-batches with gradient accumulation, then AdamW, in bf16 with fp32 master weights.
- shardlm-tp4-sp / shardlm-tp4 / shardlm-tp2-dp2 / shardlm-tp2-sp: `parallel.tp` 4 with and without sequence
  parallelism, tp 2 x dp 2 (ZeRO-1, sequence parallel), and tp 2 with sequence parallelism (on 2 GPUs, beside
  the peers at --gpus 2); blocks compiled. (`parallel.tp_async` is refused on GPUs until its
  fused kernels are validated: parallel/async_tp.py.)
- dtensor-tp4: torchtitan's plan on torchtitan's Llama (separate q, k, v, gate and up projections):
  ColwiseParallel / RowwiseParallel linears, SequenceParallel norms, a row-parallel embedding sharding the
  sequence, a column-parallel head under `loss_parallel`, each block compiled (fullgraph); fp32 weights
  under bf16 autocast with fused AdamW.
- megatron-tp4: Megatron-core's GPTModel with its local layer spec (no Transformer Engine or apex, so no
  sequence parallelism: its torch norms refuse it), as ../shared/bench/peer_megatron_tp.py builds it, with
  gradient accumulation, and as that script does, bf16 weights updated by torch's AdamW directly (no fp32
  masters: less memory and a cheaper step than the others); needs the megatron-core and einops wheels.
The peers run on --gpus ranks (4 for their names); shardlm's systems on the ranks their layout names.
Every system is charged the same FLOPs per token (ModelConfig.flops_per_token) against 989 TFLOP/s per GPU;
peak memory is the largest over the ranks. Prints a table and appends rows to bench/results.jsonl.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
from pathlib import Path

from common import PEAK, driver_args, forwarded, job_env, profile_steps, run_systems, shardlm_trainer, timed

ROOT = Path(__file__).resolve().parents[1]
SHARDLM = {"shardlm-tp4-sp": {"parallel.tp": "4", "parallel.sp": "true"},
           "shardlm-tp4": {"parallel.tp": "4"},
           "shardlm-tp2-dp2": {"parallel.tp": "2", "parallel.dp": "2", "parallel.zero_stage": "1", "parallel.sp": "true"},
           "shardlm-tp2-sp": {"parallel.tp": "2", "parallel.sp": "true"}}
PEERS = ("dtensor-tp4", "megatron-tp4")


def local_collectives() -> None:
    """The control run (--local-collectives 1): shardlm's tensor-parallel collectives (parallel/tensor.py's, and
    the vocabulary-parallel loss's) replaced by a local pass over the same tensors: an all-reduce one elementwise
    pass in place, an all-gather this rank's slice copied into every place, a reduce-scatter its own slice copied
    out. What is left is the step's compute and launches alone; its numbers are wrong, its time is the point."""
    import torch.distributed as dist

    from shardlm.parallel import cross_entropy, tensor
    from shardlm.parallel.placement import rank_in

    class Local:  # torch.distributed as the two modules see it, but for its all-reduce
        def __getattr__(self, name):
            return getattr(dist, name)

        @staticmethod
        def all_reduce(x, op=None, group=None, async_op=False):
            x.mul_(1)

    def all_gather(out, x, group=None, async_op=False):
        out.view(-1, *x.shape).copy_(x.expand(out.numel() // x.numel(), *x.shape))

    def reduce_scatter(out, src, group=None, async_op=False):
        out.copy_(src.view(-1, *out.shape)[rank_in(group)])

    tensor.dist = cross_entropy.dist = Local()
    tensor.all_gather_into_tensor, tensor.reduce_scatter_tensor = all_gather, reduce_scatter


def model_config(args):
    from shardlm.config import load_config
    return load_config(args.preset, {"model.max_seq_len": str(max(args.seq, load_config(args.preset).model.max_seq_len))})


def shardlm_step(args, system: str, world: int, extra: list[str]):
    over = {"train.seq_len": str(args.seq), "train.micro_batch_size": str(args.micro_batch),
            "train.global_batch_size": str(args.global_batch), "train.steps": "1000000", "train.precision": "bf16",
            "train.tensorboard": "false", "train.device": args.device, "train.compile": str(args.compile),
            "model.max_seq_len": str(model_config(args).model.max_seq_len), "parallel.dp": "1", **SHARDLM[system]}
    trainer, step = shardlm_trainer(args.preset, over, extra)
    # Symmetric memory (ZeRO's buffers over the copy engines) is mapped outside PyTorch's caching allocator,
    # whose peak the timing reads: it is added to that peak.
    return step, trainer.engine.symmetric_bytes() / 2**30


def dtensor_step(args, world: int):
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, loss_parallel, parallelize_module)
    m = model_config(args).model
    hd = m.head_size

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.wq = nn.Linear(m.hidden_size, m.num_heads * hd, bias=False)
            self.wk = nn.Linear(m.hidden_size, m.kv_heads * hd, bias=False)
            self.wv = nn.Linear(m.hidden_size, m.kv_heads * hd, bias=False)
            self.wo = nn.Linear(m.num_heads * hd, m.hidden_size, bias=False)

        def forward(self, x, rope):
            b, t = x.shape[:2]
            q, k, v = (w(x).view(b, t, -1, hd).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
            cos, sin = rope
            rot = lambda z: torch.cat((-z[..., hd // 2:], z[..., :hd // 2]), -1)  # noqa: E731
            q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
            return self.wo(y.transpose(1, 2).reshape(b, t, -1))

    class FeedForward(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = nn.Linear(m.hidden_size, m.ffn_size, bias=False)
            self.w2 = nn.Linear(m.ffn_size, m.hidden_size, bias=False)
            self.w3 = nn.Linear(m.hidden_size, m.ffn_size, bias=False)

        def forward(self, x):
            return self.w2(F.silu(self.w1(x)) * self.w3(x))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention_norm, self.ffn_norm = nn.RMSNorm(m.hidden_size, m.norm_eps), nn.RMSNorm(m.hidden_size, m.norm_eps)
            self.attention, self.feed_forward = Attention(), FeedForward()

        def forward(self, x, rope):
            x = x + self.attention(self.attention_norm(x), rope)
            return x + self.feed_forward(self.ffn_norm(x))

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_embeddings = nn.Embedding(m.vocab_size, m.hidden_size)
            self.layers = nn.ModuleList(Block() for _ in range(m.num_layers))
            self.norm = nn.RMSNorm(m.hidden_size, m.norm_eps)
            self.output = nn.Linear(m.hidden_size, m.vocab_size, bias=False)

        def forward(self, tokens, rope):
            h = self.tok_embeddings(tokens)
            for layer in self.layers:
                h = layer(h, rope)
            return self.output(self.norm(h))

    device = torch.device(args.device)
    mesh = init_device_mesh(device.type, (world,))
    torch.manual_seed(0)
    with device:
        model = Llama()
    parallelize_module(model, mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)})
    for i, block in enumerate(model.layers):
        parallelize_module(block, mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel()})
        if args.compile:
            model.layers[i] = torch.compile(block, fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    inv = 1.0 / (m.rope_theta ** (torch.arange(0, hd, 2, device=device).float() / hd))
    freqs = torch.outer(torch.arange(args.seq, device=device).float(), inv)
    emb = torch.cat((freqs, freqs), -1)
    rope = (emb.cos(), emb.sin())
    accum = args.global_batch // args.micro_batch
    torch.manual_seed(1)
    x = torch.randint(0, m.vocab_size, (args.micro_batch, args.seq + 1), device=device)

    def step():
        for _ in range(accum):
            with torch.autocast(device.type, torch.bfloat16):
                logits = model(x[:, :-1], rope)
            with loss_parallel():
                loss = F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten()) / accum
                loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def megatron_step(args, world: int):
    import torch
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig
    m = model_config(args).model
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    model_parallel_cuda_manual_seed(0)
    cfg = TransformerConfig(num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_heads,
                            num_query_groups=m.kv_heads, ffn_hidden_size=m.ffn_size, normalization="RMSNorm",
                            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, bf16=True,
                            params_dtype=torch.bfloat16, sequence_parallel=False, tensor_model_parallel_size=world,
                            attention_dropout=0.0, hidden_dropout=0.0, bias_activation_fusion=False,
                            masked_softmax_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False,
                            apply_rope_fusion=False, gradient_accumulation_fusion=False)
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                     vocab_size=m.vocab_size, max_sequence_length=args.seq, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    accum = args.global_batch // args.micro_batch
    x = torch.randint(0, m.vocab_size, (args.micro_batch, args.seq), device="cuda")
    pos = torch.arange(args.seq, device="cuda").unsqueeze(0)

    def step():
        for _ in range(accum):
            (model(x, pos, None, labels=x).float().mean() / accum).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def worker(args, extra):
    import torch
    import torch.distributed as dist
    world = int(os.environ.get("WORLD_SIZE", 1))
    outside = 0.0  # GiB held outside the allocator's statistics
    if args.inductor_overlap:  # the profile's collectives ran between the GEMMs, none beside them
        import torch._inductor.config as inductor
        inductor.reorder_for_compute_comm_overlap = True
    if args.system in SHARDLM:
        if args.local_collectives:
            local_collectives()
        step, outside = shardlm_step(args, args.system, world, extra)
    else:
        if not dist.is_initialized():
            if args.device == "cuda":
                torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        step = dtensor_step(args, world) if args.system == "dtensor-tp4" else megatron_step(args, world)
    dt, mem = timed(step, args.warm, args.steps, args.device)
    peak = torch.tensor([mem + outside], device=args.device)
    if dist.is_initialized():
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    tok = args.global_batch * args.seq / dt / world
    flops = model_config(args).model.flops_per_token(args.seq)
    row = {"system": args.system, "gpus": world, "step_s": dt, "tok_s_gpu": tok, "mfu": tok * flops / PEAK,
           "peak_mem_gib": float(peak), **({"inductor_overlap": True} if args.inductor_overlap else {}),
           **({"local_collectives": True} if args.local_collectives and args.system in SHARDLM else {})}
    if args.profile:  # every rank's trace: where a step's time goes on each, and how the collectives spread
        rank = int(os.environ.get("RANK", 0))
        name = args.system + ("-local" if args.local_collectives and args.system in SHARDLM else "")
        got = profile_steps(step, args.profile, args.device, Path(args.profile_dir) / f"{name}-rank{rank}.trace.json")
        mine = {k: got[k] for k in ("busy_ms", "kinds_ms", "kernels_per_step", "wall_ms")}
        ranks = [None] * world
        if dist.is_initialized():
            dist.all_gather_object(ranks, mine)
        else:
            ranks = [mine]
        row["profile"] = ranks
        if rank == 0:
            (Path(args.profile_dir) / f"{name}.kernels.txt").write_text(got["table"])
    if int(os.environ.get("RANK", 0)) == 0:
        print("RESULT " + json.dumps(row), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--preset", default="llama2-7b")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--warm", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--compile", type=int, default=1)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the systems' code on gloo (tiny presets)")
    p.add_argument("--systems", nargs="+", default=[*SHARDLM, *PEERS])
    p.add_argument("--profile", type=int, default=0, help="steps profiled after timing, on every rank")
    p.add_argument("--profile-dir", default="profiles", help="each rank's trace, rank 0's kernel table")
    p.add_argument("--inductor-overlap", type=int, default=0,
                   help="1: Inductor reorders each compiled graph's collectives against its compute "
                        "(torch._inductor.config.reorder_for_compute_comm_overlap), for every system")
    p.add_argument("--local-collectives", type=int, default=0,
                   help="1: a control run of shardlm's systems with their tensor-parallel collectives replaced by "
                        "local passes over the same tensors (compute and launches alone; wrong numbers)")
    driver_args(p, timeout=600)
    args, extra = p.parse_known_args()
    if args.system:
        return worker(args, extra)

    def gpus(system):
        layout = SHARDLM.get(system)
        return math.prod(int(v) for k, v in layout.items() if k in ("parallel.tp", "parallel.dp")) if layout else args.gpus
    own = forwarded(args, ("preset", "seq", "global_batch", "micro_batch", "warm", "steps", "compile", "device",
                           "profile", "profile_dir", "inductor_overlap", "local_collectives"))
    rows = run_systems(__file__, args.systems, gpus, lambda s: [*own, *extra], job_env(ROOT), args.timeout, args.budget)
    card = "cpu"
    if args.device == "cuda":
        import torch
        card = torch.cuda.get_device_name()
    by = {r["system"]: r for r in rows}
    print(f"\n{card} x{args.gpus}, {args.preset}, seq {args.seq}, global batch {args.global_batch}, "
          f"micro-batch {args.micro_batch}")
    print(f"{'system':<26}{'tok/s/GPU':>11}{'MFU':>8}{'peak GiB':>10}{'vs dtensor':>12}{'vs megatron':>13}")
    for r in rows:
        rel = lambda k: f"{r['tok_s_gpu'] / by[k]['tok_s_gpu']:.2f}" if k in by else "-"  # noqa: E731
        name = r["system"] + (" (local)" if r.get("local_collectives") else "")
        print(f"{name:<26}{r['tok_s_gpu']:>11.0f}{100 * r['mfu']:>7.1f}%{r['peak_mem_gib']:>10.1f}"
              f"{rel('dtensor-tp4'):>12}{rel('megatron-tp4'):>13}")
    for r in rows:
        for rank, got in enumerate(r.get("profile") or []):
            kinds = ", ".join(f"{k} {v:.1f}" for k, v in sorted(got["kinds_ms"].items()))
            print(f"{r['system']} rank {rank}: step {1e3 * r['step_s']:.1f} ms, GPU busy {got['busy_ms']:.1f} ms "
                  f"({kinds}), {got['kernels_per_step']:.0f} kernels a step")
    if args.record and args.device == "cuda":
        with open(args.record, "a") as f:
            for r in rows:
                f.write(json.dumps({"bench": "tensor_parallel", "date": datetime.date.today().isoformat(), "card": card,
                                    "gpus": r["gpus"], "system": r["system"], "model": args.preset, "seq": args.seq,
                                    "micro_batch": args.micro_batch, "global_batch": args.global_batch,
                                    "tok_s_gpu": round(r["tok_s_gpu"]), "mfu": round(r["mfu"], 4),
                                    "peak_mem_gib": round(r["peak_mem_gib"], 2),
                                    **({"local_collectives": True} if r.get("local_collectives") else {}),
                                    **({"profile": r["profile"]} if r.get("profile") else {}),
                                    "command": f"python bench/tensor_parallel.py --gpus {args.gpus} --systems "
                                               f"{r['system']} --warm {args.warm} --steps {args.steps}"
                                               + (f" --profile {args.profile}" if args.profile else "")
                                               + (" --inductor-overlap 1" if args.inductor_overlap else "")
                                               + (" --local-collectives 1" if r.get("local_collectives") else "")})
                        + "\n")


if __name__ == "__main__":
    main()
