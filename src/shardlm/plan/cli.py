"""`shardlm plan`: predict a layout's per-GPU memory, time and communication, or search for the best one."""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

from ..config import ModelConfig, ParallelConfig
from . import CUDA_CONTEXT, HEADROOM, Layout, PlanError, Workload, estimate, gpu, paper_model_states
from .flags import RUN_FLAGS, check_flags, check_inference_flags, unplanned_settings
from .hardware import GPUS, parse_bytes
from .layout import expert_loads
from .memory import activation_per_layer
from .model_args import SEQ, lora_from_args, model_from_args

GiB = 2**30


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardlm plan", description="Predict per-GPU memory, FLOPs, step time, MFU "
                                "and communication for a layout, or --search the best layout for a cluster.")
    m = p.add_argument_group("model (one of)")
    m.add_argument("--model", help="a preset (tinyllama-1.1b, ...), a TOML config, an HF config.json or checkpoint dir")
    m.add_argument("--arch", choices=("gpt", "llama"))
    for name in ("layers", "hidden", "heads", "kv-heads", "ffn", "vocab"):
        m.add_argument(f"--{name}", type=int)
    m.add_argument("--experts", type=int, help="mixture-of-experts MLP with this many experts; 0: a dense MLP "
                   "(default: --model's)")
    m.add_argument("--top-k", type=int, help="experts per token (default: --model's, else 2)")
    m.add_argument("--params", type=float,
                   help="a bare parameter count: model states (with --tokens, train FLOPs) only")
    w = p.add_argument_group("work")
    w.add_argument("--seq", type=int, default=None,
                   help=f"tokens per sequence (default: {SEQ}, or the model's max_seq_len where that is shorter)")
    w.add_argument("--micro-batch", type=int, default=None,
                   help="sequences a micro-batch (default: 1; with --search, every one that divides the batch)")
    w.add_argument("--global-batch", type=int, default=None, help="default: micro-batch x dp")
    w.add_argument("--tokens", type=float, default=0.0,
                   help="total training tokens (for train_flops, train_days, gpu_hours)")
    w.add_argument("--price-per-gpu-hour", type=float, default=0.0, help="with --tokens: the training's cost")
    c = p.add_argument_group("cluster")
    c.add_argument("--gpus", type=int, default=None, help="default: the layout's dp x tp x pp x cp; without "
                   "--dp, data parallel over the GPUs that --tp, --pp and --cp leave")
    c.add_argument("--gpus-per-node", type=int, default=8)
    c.add_argument("--gpu", default="h100", help=f"one of {', '.join(GPUS)}")
    c.add_argument("--gpu-memory", help="e.g. 80GiB")
    c.add_argument("--gpu-tflops", type=float, help="dense 16-bit peak, TFLOP/s")
    c.add_argument("--hbm-bw", help="e.g. 3.35TB/s")
    c.add_argument("--nvlink-bw", help="per GPU, one direction, e.g. 450GB/s")
    c.add_argument("--network-bw", help="per GPU, e.g. 50GB/s")
    c.add_argument("--pcie-bw", help="offload: per GPU, one direction, e.g. 50GB/s")
    c.add_argument("--host-bw", help="offload: the node's host memory bandwidth, e.g. 300GB/s")
    c.add_argument("--disk-bw", help="offload to --offload-dir: the node's disk bandwidth, e.g. 6GB/s")
    lay = p.add_argument_group("layout")
    lay.add_argument("--dp", type=int, default=None, help="default: 1, or what fills --gpus")
    for name in ("tp", "pp", "cp", "ep"):
        lay.add_argument(f"--{name}", type=int, default=1)
    lay.add_argument("--zero", type=int, default=0)
    lay.add_argument("--offload", default="none")
    lay.add_argument("--offload-dir", default="", help="with --offload: the optimizer state in files there (NVMe)")
    lay.add_argument("--offload-activations", action="store_true",
                     help="with --recompute full: each block's input kept in host memory until its backward")
    lay.add_argument("--delayed-update", action="store_true",
                     help="with --zero 2 --offload optimizer: ZeRO-Offload's one-step delayed update")
    lay.add_argument("--overlap-update", action="store_true",
                     help="with --offload optimizer at dp 1: the CPU update beside the next forward (exact)")
    lay.add_argument("--cp-comm", default="a2a", choices=("a2a", "p2p"),
                     help="with --cp: Ulysses' all-to-all of heads (a2a) or ring attention (p2p)")
    lay.add_argument("--ep-dispatch", default=ParallelConfig.ep_dispatch, choices=("auto", "padded", "exact"),
                     help="with --ep: rows sent in fixed-size blocks (padded: ep times a balanced load's memory and "
                          "bytes, no host sync) or by exact counts; auto: padded at ep 2")
    lay.add_argument("--ep-load-budget", type=float, default=ParallelConfig.ep_load_budget,
                     help="with --ep and exact counts: the most rows a rank's experts take in one pass, in balanced "
                          "loads; past it they run in recomputed chunks (planned at it); 0: no chunks")
    lay.add_argument("--sp", action="store_true")
    lay.add_argument("--recompute", default="none")
    lay.add_argument("--pp-schedule", default="1f1b")
    lay.add_argument("--virtual-stages", type=int, default=1)
    lay.add_argument("--pp-layers", default="", help="layers per pipeline stage, e.g. 10,11,11 (default: balanced "
                     "by compute)")
    lay.add_argument("--precision", default="bf16")
    lay.add_argument("--optimizer-dtype", default="fp32", choices=("fp32", "bf16"),
                     help="bf16: the optimizer's masters and moments in bf16 (train.optimizer_dtype)")
    lay.add_argument("--attention", default="flash")
    lay.add_argument("--reduce-dtype", default="fp32", choices=("fp32", "compute"))
    lay.add_argument("--reduce-algo", default="auto", choices=("auto", "all_to_all", "ring", "copy_engine"))
    ft = p.add_argument_group("fine-tuning (default: a TOML --model's [lora] section)")
    ft.add_argument("--lora-rank", type=int, default=None, help="LoRA adapters of this rank, the base frozen")
    ft.add_argument("--lora-targets", default="all-linear", help="HF module names (q_proj,v_proj,...) or all-linear")
    ft.add_argument("--freeze", default="", help="train.freeze's module patterns held fixed (\"experts,router\"): "
                    "no gradients, optimizer state or weight-gradient FLOPs for them")
    ft.add_argument("--quantize", default="none", help="nf4: QLoRA's 4-bit base; with --inference, int8 or int4: "
                    "the served weights (generate/serve --quantize)")
    inf = p.add_argument_group("inference (with --inference)")
    inf.add_argument("--inference", action="store_true", help="memory and decode speed of serving the model on "
                     "one GPU: weights, KV cache, the requests that fit, tokens/s")
    inf.add_argument("--batch", type=int, default=1, help="requests decoded at once")
    inf.add_argument("--context", type=int, default=None, help="positions per request, prompt and new tokens "
                     "(default: the model's max_seq_len)")
    p.add_argument("--search", action="store_true", help="rank every valid layout for --gpus")
    p.add_argument("--largest", action="store_true",
                   help="the largest model of --model's shape (scaled in width and depth) that this layout fits")
    p.add_argument("--host-memory", help="with --largest: host memory per node, e.g. 512GiB (default: unbounded)")
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--json", action="store_true")
    return p


def dumps(obj) -> str:
    """obj as JSON, refused where a figure is not finite: json.dumps writes inf and nan as bare Infinity and NaN,
    which no JSON parser takes (out-of-range inputs, e.g. --hbm-bw 1e-300 --tokens 1e10, overflowed train_days)."""
    def bad(x, path):
        if isinstance(x, float) and not math.isfinite(x):
            return path, x
        items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list) else ()
        return next((found for k, v in items if (found := bad(v, f"{path}.{k}" if path else str(k)))), None)
    if found := bad(obj, ""):
        raise PlanError(f"{found[0]} = {found[1]} is not a finite number: the inputs' figures are out of range "
                        "(a bandwidth, peak, --tokens or price many orders of magnitude off)")
    return json.dumps(obj)


def fmt(x: float) -> str:
    return f"{x / GiB:.2f} GiB"


def duration(seconds: float) -> str:
    """A time to three significant figures in s, ms, us or ns, whichever keeps it at 1 or more: a tiny model's
    decode step is nanoseconds, which fixed decimals of a millisecond show as 0.00 ms."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9)):
        value = float(f"{seconds / scale:.3g}")  # rounded first: 0.9996 ms is 1.00 ms, never 1e+03 us
        if value >= 1 and math.isfinite(value):
            return f"{value:.{2 - math.floor(math.log10(min(value, 100)))}f} {unit}"
    return f"{seconds:.3g} s"  # under a nanosecond, zero, negative, inf or nan: as it is


def data_parallel(a) -> tuple[int, str]:
    """--dp, or when it is left out beside --gpus N, the data-parallel degree that fills N (with a line saying
    so): a cluster size alone is a question about data parallelism, not a layout of one GPU."""
    if a.dp is not None or a.gpus is None or a.search:
        return a.dp or 1, ""
    rest = a.tp * a.pp * a.cp
    if rest < 1:
        return 1, ""  # the layout check names the bad degree
    if a.gpus % rest:
        raise PlanError(f"--gpus {a.gpus} is not a multiple of --tp {a.tp} x --pp {a.pp} x --cp {a.cp} = {rest}, "
                        "so no data-parallel degree fills it")
    dp = a.gpus // rest
    if dp == 1:
        return dp, ""
    axes = " x ".join([f"dp {dp}"] + [f"{n} {v}" for n, v in (("tp", a.tp), ("pp", a.pp), ("cp", a.cp)) if v > 1])
    return dp, f"layout: {axes} (data parallel over --gpus {a.gpus}; give --dp/--tp/--pp to choose)"


def run(argv: list[str]) -> int:
    a = parser().parse_args(argv)
    check_flags(a)
    overrides = {"memory": parse_bytes(a.gpu_memory, "--gpu-memory") if a.gpu_memory else None,
                 "peak_flops": a.gpu_tflops * 1e12 if a.gpu_tflops else None,
                 "hbm_bw": parse_bytes(a.hbm_bw, "--hbm-bw") if a.hbm_bw else None,
                 "nvlink_bw": parse_bytes(a.nvlink_bw, "--nvlink-bw") if a.nvlink_bw else None,
                 "network_bw": parse_bytes(a.network_bw, "--network-bw") if a.network_bw else None,
                 **{k: parse_bytes(v, f"--{k.replace('_', '-')}") for k, v in
                    (("pcie_bw", a.pcie_bw), ("host_bw", a.host_bw), ("disk_bw", a.disk_bw)) if v}}
    g = gpu(a.gpu, **overrides)
    dp, note = data_parallel(a)
    if a.params:
        return model_states(a, g, dp, note)
    model = model_from_args(a)
    if a.inference:
        return inference(a, model, g)
    # A run refuses train.seq_len beyond model.max_seq_len: a default past it planned a run that cannot start
    # (tiny, gpt2-124m); one asked for is planned, as the run it would be with a longer context.
    if a.seq is None:
        a.seq = min(SEQ, model.max_seq_len)
    elif a.seq > model.max_seq_len:
        print(f"note: --seq {a.seq} exceeds the model's max_seq_len {model.max_seq_len}: a run at it needs "
              f"--model.max_seq_len {a.seq}", file=sys.stderr)
    layout = Layout(dp=dp, tp=a.tp, pp=a.pp, cp=a.cp, cp_comm=a.cp_comm, ep=a.ep, ep_dispatch=a.ep_dispatch,
                    ep_load_budget=a.ep_load_budget,
                    zero_stage=a.zero, offload=a.offload,
                    offload_dir=a.offload_dir, delayed_update=a.delayed_update, overlap_update=a.overlap_update,
                    offload_activations=a.offload_activations, sp=a.sp, recompute=a.recompute, pp_schedule=a.pp_schedule,
                    virtual_stages=a.virtual_stages, pp_layers=a.pp_layers,
                    precision=a.precision, optimizer_dtype=a.optimizer_dtype, attention=a.attention,
                    reduce_dtype=a.reduce_dtype,
                    reduce_algo=a.reduce_algo, lora=lora_from_args(a), freeze=a.freeze)
    if a.search:
        return search_layouts(a, model, layout, g)
    if a.largest:
        return largest_model(a, model, layout, g)
    micro = a.micro_batch or 1
    work = Workload(a.seq, micro, a.global_batch or default_global_batch(micro, layout), a.tokens)
    if a.model and Path(a.model).suffix == ".toml" and Path(a.model).is_file():
        planned = {**{f: getattr(layout, f) for f in RUN_FLAGS.values() if hasattr(layout, f)},
                   "seq": work.seq, "micro_batch": work.micro_batch, "global_batch": work.global_batch,
                   "zero": layout.zero_stage}
        if unplanned := unplanned_settings(a.model, planned):
            print(unplanned, file=sys.stderr)
    e = estimate(model, work, layout, g, a.gpus_per_node, a.gpus, price_per_gpu_hour=a.price_per_gpu_hour)
    if a.json:
        print(dumps({**e.to_dict(), "layout": asdict(layout)}))
        return 0
    if note:
        print(note)
    print(f"{g.name}, per GPU (worst pipeline stage):")
    for k, v in rows(a, e, g, layout, model, work):
        print(f"  {k:<18}{v}")
    return 0


def inference(a, model: ModelConfig, g) -> int:
    from .inference import plan_inference
    context = check_inference_flags(a, model, parser().parse_args([]))
    e = plan_inference(model, g, a.batch, context, 4 if a.precision == "fp32" else 2, HEADROOM, CUDA_CONTEXT,
                       a.quantize)
    if a.json:
        print(dumps({**asdict(e), "total": e.total, "batch": a.batch, "context": context,
                          "quantize": a.quantize}))
        return 0
    stored = f", {a.quantize} weights" if a.quantize != "none" else ""
    share = f"{a.quantize}'s measured share of its bound at batch 1" if a.quantize != "none" else \
        "the measured share of the bound"
    speed = f"{e.tokens_per_s:,.0f}" if a.batch == 1 else \
        f"{e.tokens_per_s:,.0f} at this batch, {e.batch1_tokens_per_s:,.0f} at batch 1"
    print(f"{g.name}, serving in {a.precision}{stored}, {a.batch} request(s) of up to {context} positions:")
    # The cache holds a position past `context` per request, where idle slots write (inference/engine.py).
    for k, v in (("weights", fmt(e.weights)),
                 ("KV cache", f"{fmt(e.kv_cache)} ({a.batch} x ({context} + 1 scratch) positions)"),
                 ("workspace", fmt(e.workspace)),
                 ("total", f"{fmt(e.total)} + {fmt(CUDA_CONTEXT)} CUDA context, of {fmt(g.memory)} "
                           f"({'fits' if e.fits else 'DOES NOT FIT'} with {100 * HEADROOM:.0f}% headroom)"),
                 ("requests that fit", f"{e.slots:,} of {context} positions (by memory)"),
                 ("decode step", f"{duration(e.step_bound_s)} at the bandwidth bound"),
                 ("tokens/s", f"{speed} ({share})")):
        print(f"  {k:<18}{v}")
    return 0


def model_states(a, g, dp: int, note: str) -> int:
    """--params: the ZeRO paper's model states per GPU at each stage, and with --tokens 6 x params x tokens."""
    replicas = dp * a.cp  # context parallelism's ranks hold the same parameters: ZeRO shards over dp x cp
    out = {f"zero{s}": paper_model_states(a.params, s, replicas) for s in range(4)}
    train_flops = 6 * a.params * a.tokens
    if a.json:
        print(dumps({"model_states_bytes": out, "dp": dp, "train_flops": train_flops}))
        return 0
    if note:
        print(note)
    over = f"dp {dp}" + (f" x cp {a.cp}" if a.cp > 1 else "")
    print(f"model states of {a.params:.3g} parameters, mixed-precision Adam (ZeRO paper), {over}:")
    for k, v in out.items():
        fits = v + CUDA_CONTEXT <= g.memory * (1 - HEADROOM)
        print(f"  {k}: {v / 1e9:.1f} GB per GPU ({'fits' if fits else 'does not fit'} {g.name})")
    if a.tokens:
        print(f"train FLOPs {train_flops:.3e} (6 x parameters x {a.tokens:.3g} tokens)")
    return 0


def search_layouts(a, model: ModelConfig, layout: Layout, g) -> int:
    from .search import search, why
    gpus = a.gpus or layout.gpus
    batch = a.global_batch or (a.micro_batch or 1) * gpus
    best, scored, rejected, headroom = search(model, Workload(a.seq, a.micro_batch or 1, batch, a.tokens), g, gpus,
                                              a.gpus_per_node, layout, a.top, a.price_per_gpu_hour, a.micro_batch)
    if a.json:
        print(dumps([{"layout": asdict(L), "micro_batch": w.micro_batch, **e.to_dict()} for e, w, L in best]))
        if not best:  # a bare [] said nothing of why
            print(nothing_fits(a, scored, gpus), file=sys.stderr)
        return 0
    if a.gpus is None:
        print(f"searched layouts for {gpus} GPU{'s' if gpus > 1 else ''} (give --gpus N to search a cluster)")
    print(f"{scored} layouts scored for {gpus} x {g.name}; {rejected} do not fit in {100 * (1 - headroom):.0f}% "
          f"of {fmt(g.memory)}")
    for rank, (e, w, L) in enumerate(best, 1):
        ep = f" ep {L.ep}" if model.num_experts else ""
        stages = f" v{L.virtual_stages}" if L.virtual_stages > 1 else ""
        desc = (f"dp {L.dp}{f' cp {L.cp}' if L.cp > 1 else ''}{ep} tp {L.tp}{' sp' if L.sp else ''} pp {L.pp}"
                f"{' ' + L.pp_schedule if L.pp > 1 else ''}{stages} zero {L.zero_stage} mb {w.micro_batch} "
                f"recompute {L.recompute}")
        print(f"{rank}. {desc}: {e.tokens_per_s:,.0f} tok/s{training(a, e)} ({why(e, L, best[0][0])})")
    if not best:
        print(nothing_fits(a, scored, gpus))
    return 0


def nothing_fits(a, scored: int, gpus: int) -> str:
    """What is left to try when no searched layout fits: the search has tried every ZeRO stage, recomputation and
    micro-batch itself (and refuses --zero), so naming those sent users round in a circle. None scored: no layout
    was valid at all, which more GPUs (the advice for memory) only makes worse."""
    if not scored:
        return (f"no layout of {gpus} GPU{'s' if gpus > 1 else ''} is valid for this model and batch: dp x tp x "
                f"pp{' x cp' if a.cp > 1 else ''} must be {gpus}, tp divide the attention heads within a node, pp "
                "be at most the layers, --global-batch must be a multiple of dp, and a pipeline needs at least pp "
                "micro-batches a step (and a rank at most 65,536)"
                f"{f', and --micro-batch {a.micro_batch} divide its share of the batch' if a.micro_batch else ''}: "
                "try a larger --global-batch or fewer --gpus")
    fixes = ["more --gpus"] + (["--offload optimizer"] if a.offload == "none" else []) + \
        (["LoRA (--lora-rank 16)"] if not a.lora_rank else []) + (["a shorter --seq"] if a.seq > 1024 else []) + \
        ([f"a --micro-batch under {a.micro_batch} (or none: the search tries each)"]
         if (a.micro_batch or 1) > 1 else [])
    tries = f"{', '.join(fixes[:-1])} or {fixes[-1]}" if len(fixes) > 1 else fixes[0]
    micro = f"at --micro-batch {a.micro_batch}" if a.micro_batch else "and micro-batch"
    return (f"nothing fits: none of the {scored} layouts searched (every ZeRO stage, recomputation {micro}) "
            f"fits; try {tries}")


def default_global_batch(micro: int, L: Layout) -> int:
    """A step of one micro-batch per data-parallel rank, and per pipeline stage (every schedule's fewest: 1F1B
    needs at least pp, interleaved a multiple of it)."""
    return micro * L.dp * L.pp


def largest_model(a, base: ModelConfig, layout: Layout, g) -> int:
    from .search import largest
    if layout.pp_layers:  # the widths scaled try other depths, which no one split sums to
        raise PlanError(f"--pp-layers {layout.pp_layers} fixes the layers, and --largest scales the depth too: "
                        "leave --pp-layers out (each depth is split balanced by compute)")
    host = parse_bytes(a.host_memory, "--host-memory") if a.host_memory else None
    micro = a.micro_batch or 1
    work = Workload(a.seq, micro, a.global_batch or default_global_batch(micro, layout))
    found = largest(base, work, layout, g, host, a.gpus_per_node)
    if found is None:
        print(f"no model of this shape fits {g.name} with this layout")
        return 1
    m, e = found
    if a.json:
        print(dumps({"params": m.num_params(), "model": asdict(m), **e.to_dict()}))
        return 0
    where = f", {fmt(e.host_memory)} of host memory per rank" if e.host_memory else ""
    print(f"largest of this shape on {g.name}{' with ' + fmt(host) + ' of host memory' if host else ''}: "
          f"{m.num_params() / 1e9:.1f}B parameters (hidden {m.hidden_size}, {m.num_layers} layers, {m.num_heads} "
          f"heads, ffn {m.ffn_size}): {fmt(e.memory.total)} on the GPU{where}, {e.tokens_per_s:,.0f} tok/s")
    return 0


def training(a, e) -> str:
    """A searched layout's training time and cost, when --tokens asks for them."""
    if not a.tokens:
        return ""
    cost = f", cost {e.cost:,.0f}" if a.price_per_gpu_hour else ""
    return f", {e.train_days:.1f} days, {e.gpu_hours:,.0f} GPU-hours{cost}"


def rows(a, e, g, layout: Layout, model: ModelConfig, work: Workload) -> list[tuple[str, str]]:
    mem = e.memory
    held, _, why = expert_loads(model, layout)  # the worst load activation/layer is at
    experts = [("experts' load", f"activation/layer at {held:g} balanced load{'s' * (held != 1)} a rank, the "
                f"worst ({why}); {fmt(activation_per_layer(model, work, layout, balanced=True))} at a balanced load")]
    out = [("params", fmt(mem.params)), ("grads", fmt(mem.grads)), ("optimizer", fmt(mem.optimizer)),
           ("activations", fmt(mem.activations)), ("buffers", fmt(mem.buffers)),
           ("total", f"{fmt(mem.total)} allocated by torch, + {fmt(CUDA_CONTEXT)} CUDA context, of "
                     f"{fmt(g.memory)} ({'fits' if e.fits else 'DOES NOT FIT'} with {100 * HEADROOM:.0f}% headroom)"),
           *([("host memory", f"{fmt(e.host_memory)} per rank (offload)")] if e.host_memory else []),
           ("activation/layer", fmt(mem.activation_per_layer)), *(experts if model.num_experts else []),
           ("flops/step/GPU", f"{e.flops_per_step:.3e}"),
           ("step time", duration(e.step_time_s)), ("MFU", f"{100 * e.mfu:.1f}%"),
           ("tokens/s", f"{e.tokens_per_s:,.0f} ({e.tokens_per_s / layout.gpus:,.0f} per GPU)"),
           ("bubble", f"{100 * e.bubble:.1f}%"),
           ("checkpoint", f"{fmt(e.checkpoint_bytes)} in all, {fmt(e.checkpoint_rank_bytes)} per rank: "
                          f"{e.checkpoint_save_s:.1f} s to save at the node's {g.disk_bw / 1e9:g} GB/s")]
    out += [(f"comm {k}/step", f"{v / 1e9:.2f} GB") for k, v in e.comm_bytes_per_step.items() if v]
    if a.tokens:
        out += [("train FLOPs", f"{e.train_flops:.3e}"), ("train days", f"{e.train_days:.1f}"),
                ("GPU-hours", f"{e.gpu_hours:,.0f} ({layout.gpus} GPUs)")]
    if a.price_per_gpu_hour:
        out.append(("cost", f"{e.cost:,.0f} at {a.price_per_gpu_hour:g} per GPU-hour"))
    return out
