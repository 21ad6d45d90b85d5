"""What every benchmark here shares: the timing loop, the runner of one torchrun job per system, and the dense
bf16 peak of an H100/H200 that every system is charged against, with the one FLOPs-per-token definition
(shardlm.config.ModelConfig.flops_per_token: 6 x matmul parameters + 12 x layers x heads x head_dim x seq,
the torchtitan convention that ../shared/bench/peer_baseline.py uses)."""
import contextlib
import os
import signal
import subprocess
import tempfile
import time

PEAK = 989e12


def timed(step, warm: int, steps: int, device: str = "cuda") -> tuple[float, float]:
    """Seconds per step (mean over `steps` after `warm` warm-up steps) and peak GiB allocated while timing; on
    the CPU (a benchmark's smoke run) wall time only, peak 0."""
    import torch
    cuda = device == "cuda"
    for _ in range(warm):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps, torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0


def shardlm_trainer(preset: str, overrides: dict, extra: list[str] = ()):
    """A quiet Trainer of `preset` with `overrides` (then the command line's `--section.key value` extras), and
    its step: one train_step, the step counter advanced, Python's garbage collector on Trainer.run's schedule
    (train.gc_every) from here to the process's end."""
    from shardlm.config import load_config, parse_overrides
    from shardlm.runtime.gc_schedule import ScheduledGC
    from shardlm.trainer import Trainer
    trainer = Trainer(load_config(preset, {**overrides, **parse_overrides(list(extra))}), out_dir=None,
                      log=lambda *a: None)
    collector = ScheduledGC(trainer.cfg.train.gc_every).__enter__()

    def step():
        trainer.train_step()
        trainer.step += 1
        collector.step(trainer.step)
    return trainer, step


def _descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc: torchrun starts each rank in a session of its own, so signalling
    torchrun's process group reaches none of them."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(d))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def run_job(cmd: list[str], env: dict, timeout: float) -> tuple[int | None, str, str]:
    """(exit code, stdout, stderr) of a torchrun job; exit code None when it ran past `timeout` seconds. A job
    that hangs has every process of its tree sent SIGABRT, whose handler (faulthandler) prints each rank's
    Python stack, then SIGKILL, so that it neither holds the GPUs nor eats the call. Its output goes to files,
    not pipes, which a surviving grandchild would hold open."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, start_new_session=True,
                                env={**env, "PYTHONFAULTHANDLER": "1"})
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
            tree = [proc.pid, *_descendants(proc.pid)]
            for sig, grace in ((signal.SIGABRT, 15), (signal.SIGKILL, 15)):
                for pid in reversed(tree):  # ranks first, before torchrun can react
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, sig)
                time.sleep(grace if sig == signal.SIGABRT else 0)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=15)
        out.seek(0)
        err.seek(0)
        return code, out.read(), err.read()


def job_env(root) -> dict:
    """The environment of a benchmark's torchrun jobs: this checkout's shardlm first, NVLink multicast off."""
    return {**os.environ, "PYTHONPATH": str(root / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def rank_error(err: str, lines: int = 40) -> str:
    """The end of the first failing rank's traceback in a torchrun job's stderr (torchrun prefixes each line
    with "[rankN]:" and ends with a summary that names no error), else the end of stderr."""
    tagged = [x for x in err.splitlines() if x.startswith("[rank")]
    return "\n".join(tagged[-lines:]) if tagged else err[-3000:]


def run_system(system: str, cmd: list[str], env: dict, timeout: float) -> dict | None:
    """Run one system's torchrun job and return the JSON its rank 0 printed after "RESULT " (with "ended" where
    the job then ran past `timeout` or failed), or None (said on stderr, with the job's own stderr) when it
    failed or ran past `timeout` before printing it."""
    import json
    import sys
    code, out, err = run_job(cmd, env, timeout)
    lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
    if lines and code != 0:  # measured, then stopped or failed while tearing down (unpinning 100+ GB of host
        # memory can outlast a call's budget): the result stands, and the row says how the job ended
        ended = f"timed out after {timeout:.0f} s" if code is None else f"exit code {code}"
        print(f"{system}: {ended} after printing its result, which is kept\n{rank_error(err, 10)}", file=sys.stderr,
              flush=True)
        return {**json.loads(lines[-1][7:]), "ended": f"{ended} after its result"}
    if code is None:
        print(f"{system}: timed out after {timeout} s; the ranks' Python stacks:\n{err[-6000:]}", file=sys.stderr,
              flush=True)
    elif code or not lines:
        print(f"{system}: failed\n{rank_error(err)}", file=sys.stderr, flush=True)
    else:
        return json.loads(lines[-1][7:])
    return None



def workload_args(p, preset: str = "llama2-7b", seq: int = 2048, micro_batch: int = 1, microbatches: int = 8) -> None:
    """The model and batch arguments of a benchmark whose step is --microbatches micro-batches of --micro-batch."""
    p.add_argument("--preset", default=preset)
    p.add_argument("--seq", type=int, default=seq)
    p.add_argument("--micro-batch", type=int, default=micro_batch)
    p.add_argument("--microbatches", type=int, default=microbatches, help="micro-batches per step (accumulation)")


def driver_args(p, timeout: float) -> None:
    """The arguments every benchmark's driver takes besides its workload's."""
    import argparse
    from pathlib import Path
    p.add_argument("--record", default=str(Path(__file__).resolve().parent / "results.jsonl"))
    p.add_argument("--timeout", type=float, default=timeout, help=f"seconds one system may take (default {timeout:g})")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds all systems may take: none is started past it, each ends by it (a device call's limit)")
    p.add_argument("--system", default=None, help=argparse.SUPPRESS)


def run_systems(script: str, systems: list[str], gpus_of, args_of, env: dict, timeout: float,
                budget: float | None = None) -> list[dict]:
    """Each system as its own `torchrun --nproc-per-node gpus_of(system) script --system S args_of(S)` job,
    one after another; the rows of those that finished, each printed as it comes. With a `budget` (seconds
    for all of them) a system that would start with under a minute of it left is skipped, so that a driver
    cut short still reports and records what it measured. The first job may take twice `timeout`: it also
    pays the machine's cold start (the libraries' first import, empty compile caches)."""
    import json
    import sys
    rows, start = [], time.monotonic()
    for i, system in enumerate(systems):
        left = float("inf") if budget is None else budget - (time.monotonic() - start)
        if left < 60:
            print(f"{system}: skipped ({left:.0f} s of --budget left)", file=sys.stderr, flush=True)
            continue
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(gpus_of(system)),
               script, "--system", system, *args_of(system)]
        row = run_system(system, cmd, env, min(timeout * (2 if i == 0 else 1), left))
        if row is not None:
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def record(path: str, bench: str, card: str, gpus: int, rows: list[dict]) -> None:
    """Append one results.jsonl row per measured system: the fields every row has, then the row's own."""
    import datetime
    import json
    with open(path, "a") as f:
        for r in rows:
            f.write(json.dumps({"bench": bench, "date": datetime.date.today().isoformat(), "card": card, "gpus": gpus,
                                **r}) + "\n")


def forwarded(args, names: tuple[str, ...]) -> list[str]:
    """The driver's own arguments `names` as a worker's command-line flags (those not None)."""
    return [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k in names and v is not None]


def host_rate(n: int = 1 << 27) -> float | None:
    """Bytes a second the compiled CPU AdamW streams through host memory on this process's cores (best of three
    passes over n parameters, far larger than the caches): the planner's `host_bw`, measured on the host the
    rows ran on (bench/planner_validation.py uses it). None where the compiled pass does not build."""
    import torch

    from shardlm import cpu_adam
    from shardlm.parallel.offload import offload_threads
    from shardlm.plan.offload import ADAM_HOST_BYTES
    lib = cpu_adam.load()
    if lib is None:
        return None
    torch.set_num_threads(offload_threads(0))
    master, grad, m, v = (torch.rand(n) for _ in range(4))
    out = torch.empty(n, dtype=torch.bfloat16)
    seconds = []
    for _ in range(4):
        t = time.perf_counter()
        cpu_adam.adamw_step(lib, master, grad, m, v, out, scale=1.0, lr=1e-5, beta1=0.9, beta2=0.95, eps=1e-8,
                            weight_decay=0.1, bc1=0.5, bc2=0.5)
        seconds.append(time.perf_counter() - t)
    return ADAM_HOST_BYTES * n / min(seconds[1:])  # the first pass warms the pages and the threads up


# Kernel classes of profile_steps, first match wins: attention before GEMM (flash kernels' names hold "cutlass").
KERNEL_KINDS = (("attn", ("flash", "fmha", "attention")), ("gemm", ("gemm", "nvjet", "cutlass", "sm90", "grouped",
                                                                     "triton_tem")),
                ("nccl", ("nccl", "c10d")), ("elem", ("elementwise", "reduce", "triton", "vectorized", "unrolled")))


def kernel_kind(name: str, cat: str) -> str:
    """A kernel's class: attn, gemm, nccl, elem (elementwise / reduce / Triton), copy (memcpy, memset), other."""
    low = name.lower()
    if cat.startswith("gpu_mem"):
        return "copy"
    return next((kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "other")


def covered(intervals) -> float:
    """The length of the union of (start, end) intervals: a GPU's busy time over all its streams."""
    busy, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    return busy


def trace_profile(trace: dict, steps: int, cats: tuple[str, ...] = ("kernel", "gpu_memcpy", "gpu_memset"),
                  top: int = 25) -> tuple[dict, str]:
    """Per step, from a chrome trace's complete events of `cats` (the GPU's kernels, copies and sets; "cpu_op" on
    a CPU smoke run, whose nested operators then count more than once in the classes): busy ms (the union of
    their intervals over every stream), ms per class, and the `top` names by total time; with the table of them."""
    ev = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") in cats and "dur" in e]
    busy = covered((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in ev)  # microseconds
    kinds, names = {}, {}
    for e in ev:
        kind = kernel_kind(e["name"], e["cat"])
        kinds[kind] = kinds.get(kind, 0.0) + e["dur"] / 1e3 / steps
        n = names.setdefault(e["name"], [0.0, 0, kind])
        n[0] += e["dur"] / 1e3 / steps
        n[1] += 1
    ranked = sorted(names.items(), key=lambda x: -x[1][0])[:top]
    busy /= 1e3 * steps
    lines = [f"{'ms/step':>9}{'% busy':>8}{'calls/step':>11}{'us/call':>9}  {'class':<6}name"]
    lines += [f"{ms:>9.3f}{100 * ms / busy if busy else 0:>7.1f}%{n / steps:>11.1f}{1e3 * ms * steps / n:>9.1f}  "
              f"{kind:<6}{name[:240]}" for name, (ms, n, kind) in ranked]
    summary = {"busy_ms": busy, "kinds_ms": kinds, "kernels_per_step": len(ev) / steps,
               "top": [[name[:90], ms, kind] for name, (ms, _, kind) in ranked[:5]]}
    return summary, "\n".join(lines) + "\n"


def profile_steps(step, steps: int, device: str, trace_path=None) -> dict | None:
    """Run `steps` more steps under torch.profiler (CUDA's activity as well as the CPU's on a GPU; no shapes, no
    stacks). With `trace_path` (rank 0's; others pass None and only run the steps): the chrome trace written
    there (gzipped past 1 MiB: Perfetto opens either) and trace_profile's summary returned, its kernel table in
    "table" and the profiled steps' wall ms in "wall_ms" (the profiler slows the host: compare busy time with
    an unprofiled step's time)."""
    import gzip
    import json
    import shutil
    from pathlib import Path

    import torch
    cuda = device == "cuda"
    if trace_path is None:
        for _ in range(steps):
            step()
        return None
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=acts, record_shapes=False, with_stack=False) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / steps
    path = Path(trace_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    with open(path) as f:
        trace = json.load(f)
    summary, table = trace_profile(trace, steps, ("kernel", "gpu_memcpy", "gpu_memset") if cuda else ("cpu_op",))
    if path.stat().st_size > 2**20:
        with open(path, "rb") as src, gzip.open(f"{path}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        path.unlink()
        path = Path(f"{path}.gz")
    return {**summary, "wall_ms": wall * 1e3, "trace": str(path), "table": table}


def busy_line(label: str, step_ms: float, prof: dict) -> str:
    """One line of where a profiled step's GPU time went (profile_steps' summary) against the unprofiled step."""
    kinds = ", ".join(f"{k} {v:.1f}" for k, v in sorted(prof["kinds_ms"].items(), key=lambda x: -x[1]))
    return (f"{label}: step {step_ms:.1f} ms (profiled {prof['wall_ms']:.1f}) | busy {prof['busy_ms']:.1f}: {kinds} | "
            f"idle {100 * (1 - prof['busy_ms'] / step_ms):.1f}% | {prof['kernels_per_step']:.0f} kernels/step")


def record_memory_history(device: str, on: bool = True) -> None:
    """Every CUDA allocation from here on kept with its Python stack (for memory_at_peak), or (`on` False) no
    more: the stacks cost time, so timed steps run without them. Nothing off a GPU."""
    import torch
    if device == "cuda":
        torch.cuda.memory._record_memory_history(**({"max_entries": 4_000_000, "stacks": "python"} if on else
                                                   {"enabled": None}))


# Allocations are named by the innermost frame in these sources (the model's or the trainer's line, not the
# torch internals under it), else by the innermost frame outside torch's own package.
OWN_SOURCES = ("/shardlm/", "/transformers/", "/peft/", "/bench/")


def allocation_site(frames: list[dict]) -> str:
    def short(f):
        path = f["filename"]
        for src in OWN_SOURCES:
            if src in path:
                path = src.strip("/") + "/" + path.split(src, 1)[1]
                break
        return f"{path}:{f['line']} {f['name']}"
    own = next((f for f in frames if any(s in f["filename"] for s in OWN_SOURCES)), None)
    if own is not None:
        return short(own)
    other = next((f for f in frames if "/torch/" not in f["filename"]), None)
    if other is not None:
        return short(other)
    return "torch: " + short(frames[0]) if frames else "no Python frame (before the history, autograd's backward, C++)"


def peak_composition(live: dict, events: list[dict], top: int = 20) -> dict:
    """The bytes live at the highest point of allocated bytes, by allocation site: `live` the blocks allocated
    at the start (address: {"size", "frames"}), `events` an allocator trace from there (torch.cuda.memory.
    _snapshot()'s device_traces); with the bytes live at the start."""
    live = dict(live)
    before = total = sum(b["size"] for b in live.values())
    peak, at_peak = total, dict(live)
    for e in events:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            total += e["size"]
            if total > peak:
                peak, at_peak = total, None  # copied when the climb ends: a peak is followed by a free
        elif e["action"] == "free_requested" and e["addr"] in live:
            if at_peak is None:
                at_peak = dict(live)
            total -= live.pop(e["addr"])["size"]
    sites = {}
    for b in (live if at_peak is None else at_peak).values():
        key = allocation_site(b.get("frames", []))
        sites[key] = sites.get(key, 0) + b["size"]
    ranked = sorted(sites.items(), key=lambda x: -x[1])
    return {"peak_gib": peak / 2**30, "before_gib": before / 2**30,
            "top": [[k, v / 2**30] for k, v in ranked[:top]],
            "rest_gib": sum(v for _, v in ranked[top:]) / 2**30}


def memory_at_peak(step, path) -> dict:
    """One more `step` with the allocator's history on: what was live at its peak, by allocation site
    (peak_composition; the blocks allocated before it named where record_memory_history was on when they were
    allocated); the snapshot written to `path` (a pickle that pytorch.org/memory_viz opens). History is off
    afterwards."""
    import pickle

    import torch
    torch.cuda.synchronize()
    device = torch.cuda.current_device()
    torch.cuda.memory._record_memory_history(max_entries=4_000_000, stacks="python", clear_history=True)
    start = torch.cuda.memory._snapshot()
    live = {b["address"]: b for seg in start["segments"] if seg["device"] == device for b in seg["blocks"]
            if b["state"] == "active_allocated"}
    first = len(start["device_traces"][device])
    step()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    with open(path, "wb") as f:
        pickle.dump(snap, f)
    return {**peak_composition(live, snap["device_traces"][device][first:]), "snapshot": str(path)}
