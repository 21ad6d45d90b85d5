"""Where a data-parallel step's time goes: many DDP/ZeRO variants in one torchrun job (one compile),
each timed per phase with CUDA events on the compute stream: forward + backward, the reduction tail
(backward's end until the engine's collectives are done), and the optimizer step.

    torchrun --standalone --nproc-per-node 4 bench/dp_phases.py local ddp ddp-ring zero2 ... [NAME+prof]

`local` runs one process per GPU without communication (every GPU busy, as in the 4-GPU run); a
`+prof` suffix also profiles two steps on rank 0 ($OUT/prof-NAME.txt, trace-NAME.json.gz, and the
compute vs NCCL busy time). Variants set config overrides, NCCL group options (high-priority streams,
max_ctas), a cuBLAS SM carveout during backward (with cuBLASLt preferred), ZeRO-2's reductions in
flight, DDP's norm taken by the optimizer's own pass, block 0 compiled whole, or (timing only) no
embedding gradient; see VARIANTS. Rows go to stdout and
$OUT/variants.jsonl. Workload: tinyllama-1.1b, seq 2048, micro-batch 4 per GPU, bf16 (the tiny preset
on CPU, a dry run of the script itself).
"""
import gc
import json
import os
import sys
import time
import weakref

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "src"), os.path.join(ROOT, "bench")]
from common import PEAK  # noqa: E402
from shardlm.config import load_config  # noqa: E402
from shardlm.mesh import DeviceMesh  # noqa: E402
from shardlm.parallel import zero as Z  # noqa: E402
import shardlm.trainer as T  # noqa: E402
from shardlm.trainer import Trainer  # noqa: E402

os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
GPU = torch.cuda.is_available()
if GPU:
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
else:  # a dry run of this script on CPU: gloo, the tiny preset, wall-clock marks
    dist.init_process_group("gloo")

    class _Event:
        def __init__(self, **k):
            pass

        def record(self):
            self.t = time.perf_counter()

        def elapsed_time(self, other):
            return (other.t - self.t) * 1e3
    torch.cuda.Event = _Event
    torch.cuda.synchronize = torch.cuda.reset_peak_memory_stats = torch.cuda.empty_cache = lambda *a: None
    torch.cuda.max_memory_allocated = lambda *a: 0
OUT = os.environ.get("OUT", "/tmp")
CPU = {"launch": 0.0}

VARIANTS = {
    # name: (overrides, dp, pg options, patches). One variant per idea that bench/README.md reports.
    "local": ({}, 1, {}, {}),
    "ddp": ({}, world, {}, {}),  # reduce_algo auto: the copy engines on one node's GPUs
    "ddp-ce": ({"parallel.reduce_algo": "copy_engine"}, world, {}, {}),
    "ddp-a2a": ({"parallel.reduce_algo": "all_to_all"}, world, {}, {}),
    "ddp-ring": ({"parallel.reduce_algo": "ring"}, world, {}, {}),
    "ddp-bf16": ({"parallel.reduce_dtype": "compute", "parallel.reduce_algo": "all_to_all"}, world, {}, {}),
    "ddp-b100": ({"parallel.bucket_mb": "100", "parallel.reduce_algo": "all_to_all"}, world, {}, {}),
    "ddp-hipri": ({"parallel.reduce_algo": "all_to_all"}, world, {"hipri": True}, {}),  # NCCL high-priority streams
    "ddp-ctas8": ({"parallel.reduce_algo": "all_to_all"}, world, {"max_ctas": 8}, {}),  # fewer NCCL CTAs
    "ddp-carve8": ({"parallel.reduce_algo": "all_to_all"}, world, {}, {"carve": 8}),  # cuBLAS SM carveout
    "ddp-lt-carve24": ({"parallel.reduce_algo": "all_to_all"}, world, {}, {"lt": True, "carve": 24}),
    "ddp-b10": ({"parallel.bucket_mb": "10"}, world, {}, {}),  # copy engines, smaller / larger buckets
    "ddp-b50": ({"parallel.bucket_mb": "50"}, world, {}, {}),
    "ddp-fullnorm": ({}, world, {}, {"fullnorm": True}),  # the optimizer's own norm pass, not the slices'
    "ddp-whole0": ({}, world, {}, {"whole0": True}),  # block 0 compiled as one graph, not two (trainer.py)
    "ddp-noemb": ({}, world, {}, {"noemb": True}),  # timing only: no embedding gradient at all
    "local-noemb": ({}, 1, {}, {"noemb": True}),
    "zero1": ({"parallel.zero_stage": "1"}, world, {}, {}),  # the copy engines on one node's GPUs
    "zero1-a2a": ({"parallel.zero_stage": "1", "parallel.reduce_algo": "all_to_all"}, world, {}, {}),
    "zero2": ({"parallel.zero_stage": "2"}, world, {}, {}),  # the copy engines on one node's GPUs
    "zero2-a2a": ({"parallel.zero_stage": "2", "parallel.reduce_algo": "all_to_all"}, world, {}, {}),
    "zero2-old": ({"parallel.zero_stage": "2"}, world, {}, {"inflight": 1}),  # one reduction in flight
    "zero3": ({"parallel.zero_stage": "3"}, world, {}, {}),  # the copy engines on one node's GPUs
    "zero3-a2a": ({"parallel.zero_stage": "3", "parallel.reduce_algo": "all_to_all"}, world, {}, {}),
    "zero1-ring": ({"parallel.zero_stage": "1", "parallel.reduce_algo": "ring"}, world, {}, {}),
    "zero2-ring": ({"parallel.zero_stage": "2", "parallel.reduce_algo": "ring"}, world, {}, {}),
    "zero3-ring": ({"parallel.zero_stage": "3", "parallel.reduce_algo": "ring"}, world, {}, {}),
}
BLAS0 = torch._C._get_blas_preferred_backend()


def trace_summary(path, steps):
    """Busy time of compute kernels vs NCCL kernels on the GPU, per step (ms)."""
    ev = [e for e in json.load(open(path))["traceEvents"] if e.get("cat") == "kernel"]
    comp = sorted((e["ts"], e["ts"] + e["dur"]) for e in ev if "nccl" not in e["name"].lower())
    nccl = sorted((e["ts"], e["ts"] + e["dur"]) for e in ev if "nccl" in e["name"].lower())

    def union(iv):
        tot, cur = 0.0, None
        for a, b in iv:
            if cur is None or a > cur[1]:
                if cur:
                    tot += cur[1] - cur[0]
                cur = [a, b]
            else:
                cur[1] = max(cur[1], b)
        return tot + (cur[1] - cur[0] if cur else 0)
    span = max(b for _, b in comp + nccl) - min(a for a, _ in comp + nccl)
    return {"span_ms": span / 1e3 / steps, "compute_busy_ms": union(comp) / 1e3 / steps,
            "nccl_busy_ms": union(nccl) / 1e3 / steps, "nccl_kernels": len(nccl) // steps}


def measure(name, warm=3, steps=10, profile=False):
    over_v, dp, pgo, patches = VARIANTS[name]
    over = {"train.seq_len": "2048", "train.micro_batch_size": "4", "train.global_batch_size": str(4 * dp),
            "train.steps": "1000000", "train.tensorboard": "false", "train.device": "cuda", "parallel.dp": str(dp),
            **over_v}
    if not GPU:
        over.update({"train.device": "cpu", "train.seq_len": "64", "train.compile": "false"})
    cfg = load_config("tinyllama-1.1b" if GPU else "tiny", over)
    group = None
    if dp > 1:
        opts = None
        if GPU:
            opts = dist.ProcessGroupNCCL.Options(is_high_priority_stream=pgo.get("hipri", False))
            if "max_ctas" in pgo:
                opts.config.max_ctas = pgo["max_ctas"]
        group = dist.new_group(list(range(world)), pg_options=opts)
        mesh = DeviceMesh({"pp": 1, "dp": dp, "cp": 1, "tp": 1}, {"pp": 0, "dp": rank, "cp": 0, "tp": 0},
                          {"dp": group}, rank, local)
    else:
        mesh = DeviceMesh()
    Z.REDUCTIONS_IN_FLIGHT = patches.get("inflight", 4)
    torch.manual_seed(0)
    build = T.build_engine

    def build_engine(model, *a):
        if patches.get("noemb"):
            model.embed.weight.requires_grad_(False)
        if patches.get("whole0") and GPU:
            b0 = model.blocks()[0]
            del b0.attn_half, b0.mlp_half
            b0.compile()
        return build(model, *a)
    T.build_engine = build_engine
    try:
        tr = Trainer(cfg, out_dir=None, mesh=mesh, log=lambda *a: None)
    finally:  # a variant that fails must not leave its patches to the next
        T.build_engine = build
    eng = tr.engine
    if patches.get("fullnorm") and getattr(getattr(eng, "transport", None), "impl", None) is not None:
        eng.transport.impl.squares = None
    ev = []
    marks = {}

    def mark(k):
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        marks[k] = e
    ab, st, bb = eng.finish_backward, eng.optimizer_step, eng.prepare_backward
    carve = patches.get("carve")
    if GPU:
        torch.backends.cuda.preferred_blas_library("cublaslt" if patches.get("lt") else BLAS0)

    def before_backward(last):
        if carve and GPU:  # cuBLAS leaves SMs to NCCL while backward overlaps the reductions
            torch._C._set_sm_carveout_experimental(carve)
        bb(last)

    def after_backward(last):
        mark("bwd_end")
        ab(last)
        if carve and GPU:
            torch._C._set_sm_carveout_experimental(None)
        mark("comm_end")

    def step_(lr, s):
        st(lr, s)
        mark("step_end")
    eng.finish_backward, eng.optimizer_step, eng.prepare_backward = after_backward, step_, before_backward
    if hasattr(eng, "ready"):
        launch = eng.ready.launch

        def timed_launch(b):
            t = time.perf_counter()
            launch(b)
            CPU["launch"] += time.perf_counter() - t
        eng.ready.launch = timed_launch

    def one():
        mark("start")
        tr.train_step()
        tr.step += 1
        ev.append(dict(marks))
    for _ in range(warm):
        one()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ev.clear()
    CPU["launch"] = 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        one()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / steps
    ph = {k: sum(e[a].elapsed_time(e[b]) for e in ev) / len(ev)
          for k, a, b in (("fwd_bwd", "start", "bwd_end"), ("comm_tail", "bwd_end", "comm_end"),
                          ("opt", "comm_end", "step_end"))}
    tok = 4 * cfg.train.seq_len / dt
    res = {"name": name, "step_ms": dt * 1e3, "tok_s_gpu": tok,
           "mfu": tok * cfg.model.flops_per_token(cfg.train.seq_len) / PEAK,
           "peak_gib": (torch.cuda.max_memory_allocated() + tr.engine.symmetric_bytes()) / 2**30, "launch_cpu_ms": CPU["launch"] * 1e3 / steps,
           **{k: round(v, 2) for k, v in ph.items()}}
    if profile and rank == 0:
        from torch.profiler import ProfilerActivity, profile as prof
        with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            for _ in range(2):
                one()
            torch.cuda.synchronize()
        path = f"/tmp/trace-{name}.json"
        p.export_chrome_trace(path)
        try:
            res.update(trace_summary(path, 2))
        except Exception as e:  # noqa: BLE001
            res["trace_error"] = repr(e)
        os.system(f"gzip -c {path} > {OUT}/trace-{name}.json.gz")
        with open(f"{OUT}/prof-{name}.txt", "w") as f:
            f.write(p.key_averages().table(sort_by="cuda_time_total", row_limit=30))
    elif profile:
        for _ in range(2):
            one()
        torch.cuda.synchronize()
    allr = [None] * world
    dist.all_gather_object(allr, res["step_ms"])
    res["step_ms_ranks"] = [round(x, 1) for x in allr]
    eng.finish()
    return res, weakref.ref(tr.model), group


def run(name, profile=False):
    res, model, group = measure(name, profile=profile)
    # The next variant needs this one's memory back: compiled code holds the blocks until dynamo resets.
    torch._dynamo.reset()
    gc.collect()
    res["model_freed"] = model() is None
    torch.cuda.empty_cache()
    if group is not None:
        dist.destroy_process_group(group)
    if rank == 0:
        line = json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in res.items()})
        print(line, "mem_after_gib", torch.cuda.memory_allocated() / 2**30 if GPU else 0, flush=True)
        with open(f"{OUT}/variants.jsonl", "a") as f:
            f.write(line + "\n")


for arg in sys.argv[1:]:
    name, _, flag = arg.partition("+")
    try:
        run(name, profile=flag == "prof")
    except Exception as e:  # keep going: one broken variant must not cost the rest
        if rank == 0:
            print(f"{name}: FAILED {type(e).__name__}: {e}", flush=True)
dist.destroy_process_group()
