"""Serving speed: `shardlm serve`'s HTTP API over its engine on one GPU, with requests of mixed prompt and
output lengths arriving as a Poisson process at several rates, and a closed loop of N concurrent clients,
beside transformers' `generate` processing the same requests in static batches.

    python bench/serve.py [--gpus 1] [--preset llama2-7b] [--requests 64] [--rates 2,8,inf] [--concurrency 16]

Random bf16 weights and a word-level tokenizer over the model's vocabulary (so any id decodes); prompts are
sent as token ids, streamed back as server-sent events, greedy, no stop token. The clients run in a process
of their own (as real clients do), so that they do not share the server's GIL. Per run: output tokens a
second (all of them over the span from the first arrival to the last token), time to first token and time
per output token (p50, p99). `batch-1` sends the first --concurrency requests one at a time (the engine's
decode at batch 1); `closed-N` keeps N requests in flight. transformers' static batches: the requests in
arrival order, --concurrency at a time, left-padded to the longest prompt of all and decoded to the longest
output of all (one compiled shape, its static cache), each request's own tokens counted. Rows with bench
"serve" go to bench/results.jsonl. `--systems shardlm-split0,shardlm,...`: also the engine with
`prefill_split=0` (a few prompts prefilled in one pass, not one-row passes), beside the default.

`--systems cli,cli-int8,cli-int4,cli-tp2 --gpus 2`: the same random weights written as an HF checkpoint and
served by `shardlm serve` started as a command, as a user starts it (`--quantize int8|int4`; `--tp 2` under
torchrun, rank 0 serving HTTP), each sent the first --concurrency requests one at a time: batch-1 decoding
through the API, int8, int4 and tp 2 each against `cli` (bf16, one GPU) in the same call.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))


def word_tokenizer(vocab: int, directory: Path):
    """A tokenizer.json whose token i is the word `t{i}`: every id decodes, prompts can be ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from shardlm.tokenizer import load_tokenizer
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    return load_tokenizer(directory)


def workload(args, vocab: int):
    rng = random.Random(0)
    reqs = []
    for _ in range(args.requests):
        n = rng.randint(args.min_prompt, args.max_prompt)
        reqs.append(([rng.randrange(vocab) for _ in range(n)], rng.randint(args.min_new, args.max_new)))
    return reqs


async def one(client, url, prompt, new, start, out):
    t0 = time.perf_counter()
    times = []
    body = {"model": "base", "prompt": prompt, "max_tokens": new, "temperature": 0, "stream": True}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:])["choices"][0]["text"]:
                    times.append(time.perf_counter())
    out.append({"arrive": t0 - start, "ttft": times[0] - t0, "end": times[-1] - start, "tokens": new,
                "tpot": (times[-1] - times[0]) / max(1, new - 1)})


async def drive(url, reqs, rate: float | None = None, concurrency: int | None = None):
    """Poisson arrivals at `rate` a second (inf: all at once), or a closed loop of `concurrency` clients."""
    import httpx
    out: list[dict] = []
    rng = random.Random(1)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=len(reqs))) as client:
        start = time.perf_counter()
        if concurrency:
            queue = list(reqs)

            async def client_loop():
                while queue:
                    prompt, new = queue.pop(0)
                    await one(client, url, prompt, new, start, out)
            await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        else:
            tasks = []
            for prompt, new in reqs:
                tasks.append(asyncio.create_task(one(client, url, prompt, new, start, out)))
                if rate and rate != float("inf"):
                    await asyncio.sleep(rng.expovariate(rate))
            await asyncio.gather(*tasks)
    span = max(r["end"] for r in out) - min(r["arrive"] for r in out)
    pct = lambda xs, q: statistics.quantiles(xs, n=100)[q - 1] if len(xs) > 1 else xs[0]  # noqa: E731
    ttft, tpot = [r["ttft"] for r in out], [r["tpot"] for r in out]
    return {"requests": len(out), "output_tokens": sum(r["tokens"] for r in out), "seconds": span,
            "tok_s": sum(r["tokens"] for r in out) / span, "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
            "tpot_p50": pct(tpot, 50), "tpot_p99": pct(tpot, 99)}


class EngineTimes:
    """Where the engine's thread spends a run: seconds in step() and in its prefill passes and decode bursts,
    bursts, decode steps (one token per row) and prefill passes, counted by wrapping the engine's methods.
    prefill_launch_s: the part of prefill_s spent launching the model's forward (host time: the kernels run
    on after it returns), the rest sampling the first tokens and waiting for them. On a GPU, CUDA events
    around each decode step split the steps' time: gpu_ms_per_step, from a step's start on the GPU to its end
    (its kernels, and any wait for the host's launches inside it), and gap_ms_per_step, the GPU's time between
    one step's end and the next's start (the host between bursts, and prefill passes), over the steps."""

    def __init__(self, engine):
        self.t = dict.fromkeys(("step_s", "prefill_s", "prefill_launch_s", "burst_s", "steps", "bursts",
                                "prefills"), 0)
        for name, key, count in (("step", "step_s", None), ("_prefill", "prefill_s", "prefills"),
                                 ("_prefill_forward", "prefill_launch_s", None),
                                 ("_decode_burst", "burst_s", "bursts")):
            setattr(engine, name, self._timed(getattr(engine, name), key, count))
        engine._steps = tuple(self._counted(f) for f in engine._steps)
        self.events = [] if engine.device.type == "cuda" else None

    def _timed(self, f, key, count):
        def timed(*a):
            t = time.perf_counter()
            try:
                return f(*a)
            finally:
                self.t[key] += time.perf_counter() - t
                if count:
                    self.t[count] += 1
        return timed

    def _counted(self, f):
        def counted(*a):
            self.t["steps"] += 1
            if self.events is None:
                return f(*a)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = f(*a)
            end.record()
            self.events.append((start, end))
            return out
        return counted

    def take(self) -> dict:
        out = {k: round(v, 4) for k, v in self.t.items()}
        out["ms_per_decode_step"] = round(1e3 * out["burst_s"] / max(1, out["steps"]), 3)
        out["steps_per_burst"] = round(out["steps"] / max(1, out["bursts"]), 2)
        if self.events:
            torch.cuda.synchronize()
            ev = self.events
            out["gpu_ms_per_step"] = round(sum(a.elapsed_time(b) for a, b in ev) / len(ev), 3)
            out["gap_ms_per_step"] = round(sum(b.elapsed_time(a) for (_, b), (a, _) in zip(ev, ev[1:])) / len(ev), 3)
            self.events = []
        self.t = dict.fromkeys(self.t, 0)
        return out


def drive_sync(url, reqs, rate=None, concurrency=None):
    return asyncio.run(drive(url, reqs, rate, concurrency))


def run_shardlm(args, model, tok, reqs, device, name="shardlm", **engine_args):
    from shardlm.inference import Engine
    from shardlm.serve.command import build_server
    from shardlm.serve.worker import warm_up_batches
    max_len = args.max_prompt + args.max_new
    engine = Engine(model, args.concurrency, max_len, compile=device == "cuda" or None, decode=tok.decode,
                    **engine_args)
    times = EngineTimes(engine)
    server, worker = build_server(engine, tok, "base", {}, "127.0.0.1", 0, "warning", warm_up_batches)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as clients:
        def drive_there(*a):
            times.take()
            got = clients.submit(drive_sync, url, *a).result()
            return {**got, "engine": {**times.take(), "span_s": round(got["seconds"], 4)}}
        drive_there(reqs[:2], None, 2)  # the client process starts and connects
        rows = [{"system": f"{name}-batch-1", **drive_there(reqs[:args.concurrency], None, 1)},
                {"system": f"{name}-closed-{args.concurrency}", **drive_there(reqs, None, args.concurrency)}]
        for rate in args.rates:
            rows.append({"system": f"{name}-poisson-{rate:g}", "rate": rate, **drive_there(reqs, rate)})
    server.should_exit = True
    thread.join(30)
    worker.close(timeout=30)
    return rows


def run_cli(args, model_dir: Path, reqs, system: str) -> list[dict]:
    """`shardlm serve --model model_dir` started as a user starts it, a process of its own (under torchrun for
    `cli-tpN`, with --quantize for `cli-int8`/`cli-int4`), its first --concurrency requests sent one at a time:
    batch-1 decoding through the HTTP API, compared with `cli` (bf16, one GPU) in the same call."""
    import os
    import signal
    import socket
    import subprocess

    import httpx
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kind = system.removeprefix("cli").removeprefix("-")
    tp = int(kind[2:]) if kind.startswith("tp") else 1
    flags = ["--quantize", kind] if kind in ("int8", "int4") else ["--tp", str(tp)] if tp > 1 else []
    serve = ["-m", "shardlm", "serve", "--model", str(model_dir), "--port", str(port), "--served-model-name", "base",
             "--max-batch", str(args.concurrency), *flags]
    if args.serve_len != 0:  # 0: the model's whole context, as `shardlm serve` starts without --max-len
        serve += ["--max-len", str(args.serve_len or args.max_prompt + args.max_new)]
    launch = ["-m", "torch.distributed.run", "--nproc-per-node", str(tp)] if tp > 1 else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    log = open(Path(model_dir).parent / f"serve-{system}.log", "w")
    proc = subprocess.Popen([sys.executable, *launch, *serve], stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    try:
        deadline = started + 900  # loading, quantising, compiling and warming up a 7B model
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{system}: shardlm serve exited {proc.returncode} before it served "
                                   f"(its log: {log.name})")
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{system}: shardlm serve did not answer /health in 900 s (its log: {log.name})")
            time.sleep(1)
        start_s = time.monotonic() - started  # what a user waits for: from the command to a served /health
        drive_sync(url, reqs[:2], None, 1)  # the first requests' prefill shapes, warmed
        got = drive_sync(url, reqs[:args.concurrency], None, 1)
        try:  # the server's peak (rank 0's); a failed /metrics costs the row its memory, not its timings
            peak = httpx.get(url + "/metrics", timeout=5).json().get("memory_peak_bytes")
        except (httpx.HTTPError, ValueError):
            peak = None
        return [{"system": f"shardlm-{system}-batch-1", **got, "start_s": start_s,
                 "peak_mem_gib": peak / 2**30 if peak is not None else None}]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server drains and exits; torchrun's ranks with it
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def checkpoint(model, cfg, tok, directory: Path) -> Path:
    """The model's random weights and the word tokenizer as an HF checkpoint directory, for `shardlm serve`."""
    from shardlm.model.hf import write_hf_dir
    out = directory / "model"
    write_hf_dir({k: v.detach() for k, v in model.state_dict().items()}, cfg, out, tokenizer=tok)
    return out


def run_hf_static(args, model, cfg, reqs, device):
    from generate import hf_from
    from shardlm.inference.compiled import cuda_graphs_in_this_thread
    hf = hf_from(model, cfg, device)
    longest, most = max(len(p) for p, _ in reqs), max(n for _, n in reqs)
    kw = dict(max_new_tokens=most, min_new_tokens=most, do_sample=False, pad_token_id=0, eos_token_id=None,
              cache_implementation="static")
    hf.generation_config.pad_token_id = 0

    def batch(rows):
        ids = torch.zeros(len(rows), longest, dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for i, (p, _) in enumerate(rows):
            ids[i, longest - len(p):] = torch.tensor(p)
            mask[i, longest - len(p):] = 1
        return ids, mask

    cuda_graphs_in_this_thread()  # the engine's thread took CUDA graphs first
    with torch.no_grad():
        ids, mask = batch(reqs[:args.concurrency])
        hf.generate(ids, attention_mask=mask, **kw)  # compiles
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for s in range(0, len(reqs), args.concurrency):
            ids, mask = batch(reqs[s:s + args.concurrency])
            if len(ids) < args.concurrency:  # the same compiled shape: pad the last batch with copies
                ids = torch.cat([ids, ids[:1].expand(args.concurrency - len(ids), -1)])
                mask = torch.cat([mask, mask[:1].expand(args.concurrency - len(mask), -1)])
            hf.generate(ids, attention_mask=mask, **kw)
        if device == "cuda":
            torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    tokens = sum(n for _, n in reqs)
    return [{"system": f"hf-static-batches-{args.concurrency}", "requests": len(reqs), "output_tokens": tokens,
             "seconds": seconds, "tok_s": tokens / seconds}]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=1, help="GPUs the cli-tpN systems may take (the others take one)")
    p.add_argument("--preset", default="llama2-7b")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--min-new", type=int, default=16)
    p.add_argument("--max-new", type=int, default=256)
    p.add_argument("--rates", default="2,8,inf", help="Poisson arrival rates, requests a second")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--systems", default="shardlm,hf-static",
                   help="also shardlm-splitN (Engine prefill_split=N), and `shardlm serve` started as a command "
                        "(batch 1): cli, cli-int8, cli-int4, cli-tpN")
    p.add_argument("--serve-len", type=int, default=None,
                   help="the cli systems' --max-len (default: the longest request; 0: none given, the model's "
                        "context, which sets how many decode graphs the server compiles before it serves)")
    p.add_argument("--record", default=str(ROOT / "bench" / "results.jsonl"))
    args = p.parse_args()
    for system in args.systems.split(","):
        if system.startswith("cli-tp") and int(system[6:]) > args.gpus:
            sys.exit(f"--systems {system} takes {system[6:]} GPUs: give --gpus {system[6:]}")
    args.rates = [float(r) for r in args.rates.split(",") if r]
    import tempfile

    from generate import build
    from common import record
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch._dynamo.config.recompile_limit = 64
    model, cfg = build(argparse.Namespace(preset=args.preset), device)
    scratch = Path(tempfile.mkdtemp())
    tok = word_tokenizer(cfg.vocab_size, scratch / "tokenizer")
    reqs = workload(args, cfg.vocab_size)
    rows = []
    card = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    runs = {"shardlm": lambda: run_shardlm(args, model, tok, reqs, device),
            "hf-static": lambda: run_hf_static(args, model, cfg, reqs, device)}
    for system in args.systems.split(","):
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        if system.startswith("shardlm-split"):  # the engine with prefill_split=N (one-row prefill passes)
            got = run_shardlm(args, model, tok, reqs, device, system, prefill_split=int(system[len("shardlm-split"):]))
        elif system.startswith("cli"):
            if not (scratch / "model").is_dir():
                checkpoint(model, cfg, tok, scratch)
            got = run_cli(args, scratch / "model", reqs, system)
        else:
            got = runs[system]()
        for r in got:  # recorded as each system ends: a call cut short keeps what it measured
            if "peak_mem_gib" not in r:  # in this process: the model's weights and the system's own memory
                r["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
            r.update(model=args.preset, seq=args.max_prompt + args.max_new, micro_batch=args.concurrency,
                     tok_s_gpu=r["tok_s"], mfu=None, command="python bench/serve.py " + " ".join(sys.argv[1:]))
            print(json.dumps(r), flush=True)
        record(args.record, "serve", card, int(system[6:]) if system.startswith("cli-tp") else 1, got)
        rows += got
    print(f"\n{'system':<26} {'tok/s':>8} {'ttft p50':>9} {'ttft p99':>9} {'tpot p50':>9} {'tpot p99':>9}")
    for r in rows:
        lat = (f"{r['ttft_p50']:>9.3f} {r['ttft_p99']:>9.3f} {r['tpot_p50'] * 1e3:>7.1f}ms {r['tpot_p99'] * 1e3:>7.1f}ms"
               if "ttft_p50" in r else "")
        print(f"{r['system']:<26} {r['tok_s']:>8.1f} {lat}" + (f"  (served {r['start_s']:.0f} s after its command)"
                                                             if "start_s" in r else ""))
    by = {r["system"]: r["tok_s"] for r in rows}
    closed, single = by.get(f"shardlm-closed-{args.concurrency}"), by.get("shardlm-batch-1")
    hf = by.get(f"hf-static-batches-{args.concurrency}")
    if closed and single:
        print(f"{args.concurrency} concurrent / batch 1: {closed / single:.1f}x" +
              (f"; / transformers' static batches: {closed / hf:.2f}x" if hf else ""))
    base = by.get("shardlm-cli-batch-1")
    for name, tok_s in by.items():
        if base and name.startswith("shardlm-cli-") and name != "shardlm-cli-batch-1":
            print(f"{name.removesuffix('-batch-1')} / cli (bf16, one GPU) at batch 1: {tok_s / base:.2f}x")


if __name__ == "__main__":
    main()
