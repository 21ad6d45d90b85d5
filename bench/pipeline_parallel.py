"""Pipeline-parallel speed, memory and bubble: shardlm's schedules beside torch.distributed.pipelining's on the
same shapes, micro-batches and global batch.

    python bench/pipeline_parallel.py --gpus 4 [--preset tinyllama-1.1b --seq 2048 --micro-batch 4 --microbatches 8]
    python bench/pipeline_parallel.py --preset llama2-7b --seq 4096 --micro-batch 1 --microbatches 16 \\
        --systems shardlm-pp4-1f1b shardlm-pp2-tp2-1f1b torch-1f1b
    python bench/pipeline_parallel.py --synthetic 1 --compile 0 ...   # equal stages: bubble vs formula

Each system runs as its own `torchrun --nproc-per-node GPUS` job; a step is `--microbatches` micro-batches of
`--micro-batch` sequences through pp 4 (or pp 2 x tp 2), then AdamW, bf16.
- shardlm-pp4-{naive,gpipe,1f1b,interleaved,zb-h1}, shardlm-pp2-tp2-1f1b: the trainer's step; interleaved
  with 2 virtual stages; blocks compiled; stages pass activations by the copy engines (comm/p2p.py), or
  through NCCL with a "-pg" suffix (shardlm-pp4-1f1b-pg). Each rank's busy time is the sum of its
  computations' CUDA-event times (PipelineSchedule.timer), its bubble 1 - busy / the schedule's time (the
  step without the optimizer, which every schedule shares); the row gives the mean over the ranks beside
  the schedule's formula: (p-1)/(m+p-1) for gpipe and 1f1b, (p-1)/(vm+p-1) interleaved,
  (p-1)(F+I-W)/(m(F+I+W)+(p-1)(F+I-W)) for zb-h1 with the measured mean times (Qi et al. 2024), and for
  every schedule the simulator's figure (schedules.simulate) with the measured mean F, B, I and W times.
- torch-{gpipe,1f1b,interleaved}: ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B over stages cut from
  Hugging Face's LlamaForCausalLM as ../shared/bench/peer_mp.py builds them (layers split evenly, the head
  on the last stage), with torch's AdamW; no compile.
MFU charges every system ModelConfig.flops_per_token against 989 TFLOP/s per GPU; peak memory (the
copy engines' symmetric buffers included) is the largest over the ranks (per rank under "stages" in the
JSON). Appends rows with bench "pipeline_parallel".
`--synthetic 1` makes the stages equal, so that the bubble measures the engine against the formula alone:
every stage (virtual stage) gets as many layers, the first stage's embedding is looked up outside autograd
(its input's gradient is computed and dropped, as every other stage's is sent), and the last stage's loss is
the mean of its blocks' output instead of the head's cross-entropy (at pp 2 the head and loss made the last
chunk's forward 0.5 ms and its backward 1.5 ms slower than another's of 13 and 27 ms).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import time
from pathlib import Path

from common import PEAK, driver_args, forwarded, job_env, run_systems, shardlm_trainer, timed

ROOT = Path(__file__).resolve().parents[1]
SCHEDULE_NAMES = ("naive", "gpipe", "1f1b", "interleaved", "zb-h1")
SHARDLM = {f"shardlm-pp{pp}-{s}": {"parallel.pp": str(pp), "parallel.pp_schedule": s,
                                   "parallel.virtual_stages": "2" if s == "interleaved" else "1"}
           for pp in (2, 4) for s in SCHEDULE_NAMES}
SHARDLM["shardlm-pp2-tp2-1f1b"] = {"parallel.pp": "2", "parallel.tp": "2", "parallel.sp": "true"}
# "-pg": the stages' transfers through NCCL process groups instead of the copy engines (auto on one node)
SHARDLM.update({f"{name}-pg": {**layout, "parallel.pp_transfer": "process_group"}
                for name, layout in list(SHARDLM.items())})
PEERS = ("torch-gpipe", "torch-1f1b", "torch-interleaved")
DEFAULT = ["shardlm-pp4-gpipe", "shardlm-pp4-1f1b", "shardlm-pp4-interleaved", "shardlm-pp4-zb-h1", *PEERS]


def model_config(args):
    from shardlm.config import load_config
    over = {"model.max_seq_len": str(max(args.seq, load_config(args.preset).model.max_seq_len))}
    if args.synthetic:  # equal stages: layers a multiple of the stages (of interleaving's too), a head of nothing
        step = 2 * args.gpus
        over["model.num_layers"] = str(-(-load_config(args.preset).model.num_layers // step) * step)
        over["model.vocab_size"] = "512"  # room for the default data's 257 ids
    return load_config(args.preset, over)


def equal_stages(schedule):
    """A forward for the pipeline's seam (`PipelineSchedule.forward`) in which every stage costs the same: its
    blocks alone (see `--synthetic`)."""
    import torch
    model, last = schedule.model, schedule.S - 1

    def forward(stage, x, targets, length, documents=None):
        if stage == 0:
            with torch.no_grad():
                x = model.embed(x)
            x.requires_grad_()
        h = model.hidden_states(x, layers=schedule.layers_of[stage], embed=False, length=length,
                                documents=documents)
        return h.mean() if stage == last else h
    return forward


def equal_split(layers: int, layout: dict) -> str:
    """`parallel.pp_layers` giving every stage (every virtual stage) as many layers: the balanced split would
    still weigh the head."""
    stages = int(layout.get("parallel.pp", 1)) * int(layout.get("parallel.virtual_stages", 1))
    return ",".join([str(layers // stages)] * stages)


class BusyTimer:
    """CUDA events (on the CPU: the clock) around each computation of the step and around the whole schedule
    (`span`, which leaves the optimizer step out); `busy()` sums them, and averages them per action kind."""

    def __init__(self, cuda: bool):
        self.cuda, self.events, self.spans, self.timeline = cuda, [], [], []

    def _mark(self):
        import time

        import torch
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def span(self, forward_backward):
        def timed_schedule(*args, **kwargs):
            start = self._mark()
            out = forward_backward(*args, **kwargs)
            self.spans.append((start, self._mark()))
            return out
        return timed_schedule

    @contextlib.contextmanager
    def __call__(self, action):
        import time

        import torch
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
        else:
            start = time.perf_counter()
            yield
            end = time.perf_counter()
        self.events.append((action, len(self.spans), start, end))

    def busy(self) -> tuple[float, float, dict]:
        """(busy seconds, schedule seconds, mean seconds per action kind and per (kind, stage)) since the
        last call."""
        import torch
        if self.cuda:
            torch.cuda.synchronize()
        seconds = (lambda a, b: a.elapsed_time(b) / 1e3) if self.cuda else (lambda a, b: b - a)
        total, kinds = 0.0, {}
        for action, _, start, end in self.events:
            s = seconds(start, end)
            total += s
            kinds.setdefault(action.kind, []).append(s)
            kinds.setdefault((action.kind, action.stage), []).append(s)
        span = sum(seconds(a, b) for a, b in self.spans)
        if self.spans:  # the last step's computations, in ms from its start: where the idle time falls
            last, (begin, _) = len(self.spans) - 1, self.spans[-1]
            self.timeline = [(a.kind, a.stage, a.mb, round(1e3 * seconds(begin, s), 3), round(1e3 * seconds(begin, e), 3))
                             for a, i, s, e in self.events if i == last]
        self.events, self.spans = [], []
        return total, span, {k: sum(v) / len(v) for k, v in kinds.items()}


def shardlm_step(args, system: str, extra: list[str]):
    cfg = model_config(args)
    over = {"train.seq_len": str(args.seq), "train.micro_batch_size": str(args.micro_batch),
            "train.global_batch_size": str(args.micro_batch * args.microbatches), "train.steps": "1000000",
            "train.precision": "bf16", "train.tensorboard": "false", "train.compile": str(args.compile),
            "model.max_seq_len": str(cfg.model.max_seq_len), "model.vocab_size": str(cfg.model.vocab_size),
            "model.num_layers": str(cfg.model.num_layers),
            **({"parallel.pp_layers": equal_split(cfg.model.num_layers, SHARDLM[system])} if args.synthetic else {}),
            "train.device": args.device, "parallel.dp": "1", **SHARDLM[system]}
    trainer, step = shardlm_trainer(args.preset, over, extra)
    timer = BusyTimer(args.device == "cuda")
    if args.synthetic:
        trainer.forward_backward.forward = equal_stages(trainer.forward_backward)
    trainer.forward_backward.timer = timer
    trainer.forward_backward = timer.span(trainer.forward_backward)
    return step, timer, trainer


def torch_step(args, kind: str):
    """torch.distributed.pipelining over HF Llama stages (the method of ../shared/bench/peer_mp.py)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
    from transformers import LlamaConfig, LlamaForCausalLM
    m = model_config(args).model
    world, rank = dist.get_world_size(), dist.get_rank()
    hf = LlamaConfig(hidden_size=m.hidden_size, intermediate_size=m.ffn_size, num_hidden_layers=m.num_layers,
                     num_attention_heads=m.num_heads, num_key_value_heads=m.kv_heads, vocab_size=m.vocab_size,
                     max_position_embeddings=m.max_seq_len, rms_norm_eps=m.norm_eps, rope_theta=m.rope_theta,
                     attn_implementation="sdpa", tie_word_embeddings=False)
    torch.manual_seed(0)
    device = torch.device("cuda")
    with device:
        full = LlamaForCausalLM(hf).bfloat16()

    class Stage(nn.Module):
        def __init__(self, lo, hi, first, last):
            super().__init__()
            self.embed = full.model.embed_tokens if first else None
            self.layers = nn.ModuleList(full.model.layers[lo:hi])
            self.rotary = full.model.rotary_emb
            self.norm, self.head = (full.model.norm, full.lm_head) if last else (None, None)

        def forward(self, h):
            if self.embed is not None:
                h = self.embed(h)
            pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
            pe = self.rotary(h, pos)
            for layer in self.layers:
                out = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe)
                h = out[0] if isinstance(out, tuple) else out
            return self.head(self.norm(h)).float() if self.head is not None else h

    v = 2 if kind == "interleaved" else 1
    S, L = world * v, m.num_layers
    sizes = [L // S + (1 if i < L % S else 0) for i in range(S)]
    bounds = [sum(sizes[:i]) for i in range(S + 1)]
    mine = [rank + k * world for k in range(v)]
    mods = [Stage(bounds[s], bounds[s + 1], s == 0, s == S - 1) for s in mine]
    keep = {id(p) for mod in mods for p in mod.parameters()}
    for p in full.parameters():  # other stages' weights: freed
        if id(p) not in keep:
            p.data = torch.empty(0, device=device, dtype=p.dtype)
    torch.cuda.empty_cache()
    stages = [PipelineStage(mod, s, S, device) for mod, s in zip(mods, mine)]
    params = [p for mod in mods for p in mod.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)

    def loss_fn(logits, y):
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), y[:, 1:].reshape(-1))
    M = args.microbatches
    if kind == "gpipe":
        sched = ScheduleGPipe(stages[0], M, loss_fn=loss_fn)
    elif kind == "1f1b":
        sched = Schedule1F1B(stages[0], M, loss_fn=loss_fn)
    else:
        sched = ScheduleInterleaved1F1B(stages, M, loss_fn=loss_fn)
    torch.manual_seed(1)
    x = torch.randint(0, m.vocab_size, (args.micro_batch * M, args.seq), device=device)
    first, last = 0 in mine, S - 1 in mine

    def step():
        if first and last:
            sched.step(x, target=x)
        elif first:
            sched.step(x)
        elif last:
            sched.step(target=x)
        else:
            sched.step()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def bubble_figures(cfg, kinds: dict) -> dict:
    """The schedule's formula and the simulator's bubble with the measured mean time of each action kind
    (the formula's equal stages), and with each stage's own (`bubble_simulated_stages`)."""
    from shardlm.schedules import schedule, simulate
    p, v = cfg.parallel.pp, cfg.parallel.virtual_stages
    m = cfg.grad_accum_steps
    name = cfg.parallel.pp_schedule
    formula = {"gpipe": (p - 1) / (m + p - 1), "1f1b": (p - 1) / (m + p - 1),
               "interleaved": (p - 1) / (v * m + p - 1)}.get(name)
    if name == "zb-h1" and {"F", "I", "W"} <= kinds.keys():  # Qi et al. 2024: (p-1)(F+I-W) idle per rank
        f, i, w = kinds["F"], kinds["I"], kinds["W"]
        formula = (p - 1) * (f + i - w) / (m * (f + i + w) + (p - 1) * (f + i - w))
    table = schedule(name, p, v, m)
    uniform = simulate(table, p, {k: c for k, c in kinds.items() if isinstance(k, str)}) if kinds else None
    staged = simulate(table, p, kinds) if kinds else None  # each stage's own times: its imbalance counted
    return {"bubble_formula": formula, "bubble_simulated": uniform.bubble if uniform else None,
            "bubble_simulated_stages": staged.bubble if staged else None}


def worker(args, extra):
    import torch
    import torch.distributed as dist
    t0 = time.perf_counter()
    world = int(os.environ.get("WORLD_SIZE", 1))
    timer = trainer = None
    if args.system in SHARDLM:
        step, timer, trainer = shardlm_step(args, args.system, extra)
    else:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
        step = torch_step(args, args.system.removeprefix("torch-"))
    say = (lambda msg: print(f"[{args.system}] {msg}", file=sys.stderr, flush=True)) \
        if int(os.environ.get("RANK", 0)) == 0 else (lambda msg: None)
    say(f"built in {time.perf_counter() - t0:.0f} s")
    for i in range(args.warm):
        step()
        say(f"warm step {i} done at {time.perf_counter() - t0:.0f} s")
    if timer is not None:
        timer.busy()  # busy time of the timed steps only
    dt, mem = timed(step, 0, args.steps, args.device)
    if trainer is not None:
        mem += trainer.parallel.symmetric_bytes() / 2**30
    row = {"system": args.system, "gpus": world, "step_s": dt}
    tok = args.micro_batch * args.microbatches * args.seq / dt / world
    row.update(tok_s_gpu=tok, mfu=tok * model_config(args).model.flops_per_token(args.seq) / PEAK)
    per_rank = torch.tensor([mem, 0.0], device=args.device)
    if timer is not None:
        busy, span, kinds = timer.busy()
        per_rank[1] = 1 - busy / span
        everyone = [None] * world  # each rank times its own stages: the simulator wants them all
        dist.all_gather_object(everyone, kinds)
        merged = {k: sum(d[k] for d in everyone if k in d) / sum(k in d for d in everyone)
                  for k in {k for d in everyone for k in d}}
        row.update(bubble_figures(trainer.cfg, merged))
    gathered = [torch.zeros_like(per_rank) for _ in range(world)]
    dist.all_gather(gathered, per_rank)
    row["peak_mem_gib"] = max(float(g[0]) for g in gathered)
    row["stages"] = [{"peak_mem_gib": round(float(g[0]), 2), "bubble": round(float(g[1]), 4)} for g in gathered]
    if timer is not None:
        row["bubble_measured"] = sum(float(g[1]) for g in gathered) / world
        if args.timeline:
            timelines = [None] * world
            dist.all_gather_object(timelines, timer.timeline)
            if int(os.environ.get("RANK", 0)) == 0:
                Path(args.timeline).parent.mkdir(parents=True, exist_ok=True)
                with open(f"{args.timeline}.{args.system}.json", "w") as f:
                    json.dump({"system": args.system, "ranks": timelines}, f)
    if int(os.environ.get("RANK", 0)) == 0:
        print("RESULT " + json.dumps(row), flush=True)
    if trainer is not None:
        trainer.close()  # its groups and their threads released before the interpreter exits
    else:
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--preset", default="tinyllama-1.1b")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--synthetic", type=int, default=0,
                   help="1: equal stages (the blocks alone, as many each; a 512-token vocabulary)")
    p.add_argument("--warm", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--compile", type=int, default=1)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of shardlm's systems on gloo (tiny presets)")
    p.add_argument("--systems", nargs="+", default=DEFAULT)
    p.add_argument("--timeline", default="", help="PREFIX: each shardlm system's last step, rank by rank, as "
                   "(kind, stage, micro-batch, start ms, end ms), to PREFIX.SYSTEM.json")
    driver_args(p, timeout=600)
    args, extra = p.parse_known_args()
    if args.system:
        return worker(args, extra)
    if args.synthetic and model_config(args).model.tie_embeddings:
        p.error(f"--synthetic: {args.preset} ties its embedding to its head, which equal stages leave out")
    own = forwarded(args, ("gpus", "preset", "seq", "micro_batch", "microbatches", "synthetic", "warm", "steps", "compile",
                           "device", "timeline"))
    ranks = lambda s: int(SHARDLM[s]["parallel.pp"]) * int(SHARDLM[s].get("parallel.tp", 1)) if s in SHARDLM \
        else args.gpus  # noqa: E731
    rows = run_systems(__file__, args.systems, ranks, lambda s: [*own, *extra], job_env(ROOT),
                       args.timeout, args.budget)
    import torch
    card = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    by = {r["system"]: r for r in rows}
    print(f"\n{card} x{args.gpus}, {args.preset}{f' (synthetic: {model_config(args).model.num_layers} layers, vocab 512)' if args.synthetic else ''}, seq {args.seq}, "
          f"{args.microbatches} micro-batches of {args.micro_batch}")
    print(f"{'system':<24}{'tok/s/GPU':>10}{'MFU':>8}{'peak GiB':>10}{'bubble':>8}{'formula':>9}{'sim':>7}"
          f"{'sim/stage':>10}{'vs torch-1f1b':>15}")
    pct = lambda x: f"{100 * x:.1f}%" if x is not None else "-"  # noqa: E731
    for r in rows:
        rel = f"{r['tok_s_gpu'] / by['torch-1f1b']['tok_s_gpu']:.2f}" if "torch-1f1b" in by else "-"
        print(f"{r['system']:<24}{r['tok_s_gpu']:>10.0f}{100 * r['mfu']:>7.1f}%{r['peak_mem_gib']:>10.1f}"
              f"{pct(r.get('bubble_measured')):>8}{pct(r.get('bubble_formula')):>9}{pct(r.get('bubble_simulated')):>7}"
              f"{pct(r.get('bubble_simulated_stages')):>10}{rel:>15}")
    if args.record and args.device == "cuda":
        with open(args.record, "a") as f:
            for r in rows:
                f.write(json.dumps({"bench": "pipeline_parallel", "date": datetime.date.today().isoformat(), "card": card,
                                    "gpus": r["gpus"], "system": r["system"],
                                    "model": args.preset + ("-synthetic" if args.synthetic else ""), "seq": args.seq,
                                    "micro_batch": args.micro_batch, "microbatches": args.microbatches,
                                    "tok_s_gpu": round(r["tok_s_gpu"]), "mfu": round(r["mfu"], 4),
                                    "peak_mem_gib": round(r["peak_mem_gib"], 2), "stages": r["stages"],
                                    **{k: r[k] for k in ("bubble_measured", "bubble_formula", "bubble_simulated",
                                                          "bubble_simulated_stages") if k in r},
                                    "command": f"python bench/pipeline_parallel.py --preset {args.preset} --seq {args.seq} "
                                               f"--micro-batch {args.micro_batch} --microbatches {args.microbatches} "
                                               f"--synthetic {args.synthetic} --compile {args.compile} "
                                               f"--systems {r['system']}"}) + "\n")


if __name__ == "__main__":
    main()
