"""Generation speed: shardlm's engine (static KV cache, compiled decode step as CUDA graphs) beside Hugging Face
transformers' `generate` with its static cache (which compiles its forward on a GPU) and with its dynamic
cache, on one GPU; its int8 and int4 weights (inference/int8.py's and int4.py's products; with the system
shardlm-int4-torchao, not run by default, torchao's tinygemm int4 as --quantize int4 ran it before int4.py)
against its bf16; then many prompts of mixed lengths, eval-style, through the engine and through the
path `eval --tasks` took before it (prompts of equal length batched together, the eager decoder).

    python bench/generate.py [--gpus 1] [--preset llama2-7b] [--prompt 128] [--new 256] [--batches 1,16]
                             [--mixed 1000] [--mixed-new 64] [--old-batches 24] [--systems ...] [--profile 1]
    python bench/generate.py --gpus 2 --systems shardlm,shardlm-tp2 --batches 1    # tp 2 against one GPU

Random bf16 weights, greedy, no stop token (every row decodes --new tokens). Each system runs in its own
subprocess. tok/s counts new tokens over the whole call (prefill included, as a user waits for it); GB/s is
the weights' bytes read per decode step times the steps a second (of a mixture's routed experts, those the
step's rows reach, in the planner's expectation), against the card's HBM bandwidth (the bound: HBM bandwidth /
those bytes). The old path decodes about 90 ms a step at 7B, so it runs
--old-batches of its batches (drawn at random) and its time for all is extrapolated from theirs, stated
in its row. Rows with bench "generate" go to bench/results.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
HBM = {"H200": 4.8e12, "H100": 3.35e12}  # bytes/s, SXM cards
SYSTEMS = ("shardlm", "hf-static", "hf-dynamic", "mixed-new", "mixed-old", "agree-fp32", "shardlm-int8",
           "shardlm-int4")
WORKLOAD = ("preset", "prompt", "new", "mixed", "mixed_max", "mixed_new", "mixed_batch", "old_batches", "agree",
            "profile", "out", "tp_prefill_graphs")


def tp_of(system: str) -> int:
    """shardlm-tpN[VARIANT]: the engine over N tensor-parallel ranks (torchrun, one GPU each); else 1."""
    return int(system.removeprefix("shardlm-tp").split("-")[0]) if system.startswith("shardlm-tp") else 1


# shardlm-tpN's variants: its all-reduces by NCCL; one-shot but each one-row row-parallel product apart from
# its sum (cuBLAS, a copy, torch's one-shot kernel), as before inference/gemv_all_reduce.py; the fused kernel
# meeting its peers at a barrier (gemv_all_reduce.py) rather than by the LL protocol (gemv_all_reduce_ll.py),
# or by the LL protocol with its stores to the peers relaxed at system scope rather than weak.
TP_VARIANTS = ("-nccl", "-unfused", "-barrier", "-ll-strong")


def tp_variant(engine_model, variant: str) -> None:
    """Take the fused one-row row-parallel products (inference/gemv_all_reduce.py) out of a model that an Engine
    set up, for "-unfused", or give them another protocol, before its first run compiles them."""
    from shardlm.inference.gemv_all_reduce import GemvAllReduce
    linears = [m.small_all_reduce for m in engine_model.modules()
               if getattr(getattr(m, "small_all_reduce", None), "fused", None) is not None]
    if not linears or variant not in ("-unfused", "-barrier", "-ll-strong"):
        return
    fused = linears[0].fused  # one object, shared by every row-parallel linear
    if variant == "-ll-strong":
        fused.use_ll(strong=True)
        return
    other = None if variant == "-unfused" else GemvAllReduce(fused.buffers, fused.max_n, fused.group,
                                                              launch=fused.launch, protocol="barrier")
    for linear in linears:
        linear.fused = other


def build(args, device, group=None):
    """The preset's model with random weights; with a tensor-parallel `group`, this rank's slices of the same
    weights (init_parameter draws every tensor whole and keeps its slice)."""
    from shardlm.config import load_config
    from shardlm.model import build_model
    cfg = load_config(args.preset).model
    dtype = getattr(args, "dtype", None) or (torch.bfloat16 if device == "cuda" else torch.float32)
    if group is None:
        return build_model(cfg, device=device, dtype=dtype, seed=0).eval(), cfg
    from shardlm.model import Decoder
    from shardlm.parallel.tensor import tensor_parallel
    with torch.device("meta"):
        model = Decoder(cfg)
    tensor_parallel(model, group)
    model.to(dtype).to_empty(device=device)
    model.init_weights(0)
    return model.eval(), cfg


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def weight_bytes(model) -> int:
    """What one decode step reads of the weights: all but the input embedding, of which it reads a row."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n != "embed.weight")


def random_prompts(n, lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for length in lengths]


def torchao_int4(model) -> None:
    """The blocks' linear layers (those int4.py takes) through torchao's tinygemm int4 product (bf16 on a CUDA
    GPU, its tile_packed_to_4d format, groups as int4.py's), which `--quantize int4` ran before int4.py: the
    comparison for shardlm-int4. Its earlier rows (system shardlm-int4 before int4.py) had the untied output
    head quantised too."""
    import logging
    for name in ("torchao", "torch.utils._pytree"):  # warnings on import about kernels unused here
        logging.getLogger(name).setLevel(logging.ERROR)
    import torchao.quantization as q
    from torchao.quantization.quantize_.workflows.int4.int4_packing_format import Int4PackingFormat

    from shardlm.inference.int4_format import group_size
    from shardlm.inference.int8 import unquantised
    kept = unquantised(model)
    ours = [m for block in model.blocks() for m in block.modules()
            if isinstance(m, torch.nn.Linear) and id(m) not in kept and group_size(m.in_features)]
    for group in sorted({group_size(m.in_features) for m in ours}):
        chosen = {id(m) for m in ours if group_size(m.in_features) == group}
        config = q.Int4WeightOnlyConfig(group_size=group, int4_packing_format=Int4PackingFormat.TILE_PACKED_TO_4D)
        q.quantize_(model, config, filter_fn=lambda m, _, chosen=chosen: id(m) in chosen)


def run_shardlm(args, device, quantized: str = "none", tp: int = 1, variant: str = ""):
    from shardlm.inference import Engine, Request
    from shardlm.inference.quantize import quantize
    from shardlm.plan.inference import unreached_expert_bytes
    group = None
    if tp > 1:  # under torchrun: one GPU a rank, every rank the same requests, rank 0 reports
        import torch.distributed as dist

        from shardlm.mesh import build_mesh, world_from_env
        world, rank, local = world_from_env()
        assert world == tp, f"shardlm-tp{tp} runs as {tp} ranks, not {world}"
        if device == "cuda":
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
        group = build_mesh(tp=tp).group("tp")
    model, cfg = build(args, device, group)
    weights = weight_bytes(model) * tp  # GB/s below counts the 16-bit bytes the quantised weights stand for
    itemsize = next(model.parameters()).element_size()
    if quantized == "int4-torchao":
        torchao_int4(model)
    else:
        quantize(model, quantized)
    system = "shardlm" if quantized == "none" else f"shardlm-{quantized}"
    system = system if tp == 1 else f"shardlm-tp{tp}{variant}"
    one_shot = False if variant == "-nccl" else None
    rows = []
    for batch in args.batches:
        prompts = random_prompts(batch, [args.prompt] * batch, cfg.vocab_size)
        graphs = {"prefill_graphs": args.tp_prefill_graphs} if tp > 1 and args.tp_prefill_graphs is not None else {}
        engine = Engine(model, batch, args.prompt + args.new, compile=device == "cuda" or None, one_shot=one_shot,
                        **graphs)
        tp_variant(model, variant)
        engine.run([Request(p, args.new) for p in prompts])  # compiles and records the graphs
        sync(device)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        done = engine.run([Request(p, args.new) for p in prompts])
        sync(device)
        # of a mixture's routed experts, a step reads those its rows reach (the planner's expectation)
        read = weights - unreached_expert_bytes(cfg, itemsize, batch)
        rows.append(row(args, read, system, batch, time.perf_counter() - t, device, first=done[0].tokens[:8], tp=tp))
        if tp > 1 and torch.distributed.get_rank() == 0:  # now: the job's teardown may not end (below)
            print("RESULT " + json.dumps(rows[-1]), flush=True)
        if args.profile and batch == args.batches[0]:
            profile(args, engine, prompts[0], system, batch)
        del engine
    if tp > 1:
        # Tearing down NCCL under the decode step's captured CUDA graphs has hung past the driver's timeout
        # (bench/README.md): the rows are printed, so the job ends here.
        sys.stdout.flush()
        os._exit(0)
    return rows


def profile(args, engine, prompt, system, batch):
    """Where a decode step's time goes: the CUDA kernels of (up to) 32 new tokens (the compiled step's graphs
    replayed) by total time, written to --out as generate-SYSTEM-profile.txt; the top five printed."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    from shardlm.inference import Request
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.run([Request(prompt, min(32, args.new)) for _ in range(batch)])
        sync(engine.device.type)
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    trace = Path(args.out, f"generate-{system}-b{batch}-r{rank}-trace.json")
    prof.export_chrome_trace(str(trace))
    gaps = idle_gaps(json.loads(trace.read_text()), min(32, args.new))
    trace.unlink()  # tens of MB; the summary is what is kept
    Path(args.out, f"generate-{system}-b{batch}-r{rank}-profile.txt").write_text(table + "\n" + gaps + "\n")
    if rank == 0:
        print("\n".join(table.splitlines()[:9]) + "\n" + gaps, file=sys.stderr, flush=True)


def idle_gaps(trace: dict, tokens: int) -> str:
    """Where the GPU waits between kernels: the profile's kernels, copies and memsets merged into busy spans,
    and the gaps between them by length (a CUDA graph's launches a microsecond or so apart, a step's host work,
    a burst's host sync), each bucket's count and milliseconds a token over `tokens` new tokens (the prompt's
    prefill, once, included)."""
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in trace.get("traceEvents", [])
                   if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e)
    if not spans:
        return "idle gaps: no kernels in the trace"
    busy, gaps, (start, end) = 0.0, [], spans[0]
    for a, b in spans[1:]:
        if a > end:
            busy += end - start
            gaps.append(a - end)
            start = a
        end = max(end, b)
    busy += end - start
    span = end - spans[0][0]
    buckets = [(0, 2), (2, 10), (10, 100), (100, float("inf"))]
    parts = [f"{lo}-{hi if hi != float('inf') else ''} us: {sum(lo <= g < hi for g in gaps)} gaps "
             f"{sum(g for g in gaps if lo <= g < hi) / tokens / 1e3:.3f} ms" for lo, hi in buckets]
    return (f"idle gaps a token ({tokens} tokens): span {span / tokens / 1e3:.3f} ms, kernels busy "
            f"{busy / tokens / 1e3:.3f} ms, " + "; ".join(parts))


def hf_model(args, device):
    model, cfg = build(args, device)
    return hf_from(model, cfg, device), model, cfg


def hf_from(model, cfg, device):
    """transformers' LlamaForCausalLM holding `model`'s weights: the same greedy tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardlm.model.hf import to_hf_state
    hf_cfg = LlamaConfig(hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_size, num_hidden_layers=cfg.num_layers,
                         num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.kv_heads, vocab_size=cfg.vocab_size,
                         max_position_embeddings=cfg.max_seq_len, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.norm_eps,
                         tie_word_embeddings=cfg.tie_embeddings, attn_implementation="sdpa")
    with torch.device(device):
        hf = LlamaForCausalLM(hf_cfg).to(next(model.parameters()).dtype)
    hf.load_state_dict(to_hf_state(model.state_dict(), cfg))
    return hf.eval()


def run_hf(args, device, cache: str):
    hf, model, cfg = hf_model(args, device)
    rows = []
    for batch in args.batches:
        ids = torch.tensor(random_prompts(batch, [args.prompt] * batch, cfg.vocab_size), device=device)
        kw = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, pad_token_id=0,
                  eos_token_id=None, attention_mask=torch.ones_like(ids))
        if cache == "static":
            kw["cache_implementation"] = "static"
        with torch.no_grad():
            hf.generate(ids, **kw)  # compiles (static cache on a GPU)
            sync(device)
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            out = hf.generate(ids, **kw)
            sync(device)
        rows.append(row(args, weight_bytes(model), f"hf-{cache}", batch, time.perf_counter() - t, device,
                        first=out[0, args.prompt:args.prompt + 8].tolist()))
    return rows


def mixed_prompts(args, vocab):
    rng = random.Random(1)
    return random_prompts(args.mixed, [rng.randint(8, args.mixed_max) for _ in range(args.mixed)], vocab, seed=2)


def run_mixed_new(args, device):
    from shardlm.inference import Engine, Request
    model, cfg = build(args, device)
    prompts = mixed_prompts(args, cfg.vocab_size)
    engine = Engine(model, args.mixed_batch, max(map(len, prompts)) + args.mixed_new,
                    compile=device == "cuda" or None)
    engine.run([Request(p, args.mixed_new) for p in prompts[:args.mixed_batch]])  # compiles
    sync(device)
    t = time.perf_counter()
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))  # as generate_many submits them
    reqs = [Request(prompts[i], args.mixed_new) for i in order]
    engine.run(reqs)
    sync(device)
    seconds = time.perf_counter() - t
    out = {i: r.tokens for i, r in zip(order, reqs)}
    Path(args.tokens_out).write_text(json.dumps({str(i): out[i] for i in range(len(prompts))}))
    return [{"system": "shardlm-mixed", "prompts": len(prompts), "new_tokens": args.mixed_new, "seconds": seconds,
             "prompts_s": len(prompts) / seconds, "batch": args.mixed_batch}]


def run_mixed_old(args, device):
    """The old eval path: prompts grouped by token length, up to 8 of one length a batch, each batch decoded
    by the eager decoder; a random sample of its batches timed, the whole extrapolated."""
    from shardlm.inference import generate_ids
    model, cfg = build(args, device)
    prompts = mixed_prompts(args, cfg.vocab_size)
    by_length: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_length.setdefault(len(p), []).append(i)
    batches = [g[s:s + 8] for g in by_length.values() for s in range(0, len(g), 8)]
    sample = random.Random(3).sample(batches, min(args.old_batches, len(batches)))
    generate_ids(model, torch.tensor([prompts[0]], device=device), 4)  # warm
    sync(device)
    t = time.perf_counter()
    out = {}
    for rows in sample:
        new = generate_ids(model, torch.tensor([prompts[i] for i in rows], device=device), args.mixed_new)
        out.update(zip(rows, new.tolist()))
    sync(device)
    seconds = time.perf_counter() - t
    Path(args.tokens_out).write_text(json.dumps({str(i): v for i, v in out.items()}))
    total = seconds * len(batches) / len(sample)
    return [{"system": "old-eval-path", "prompts": len(prompts), "new_tokens": args.mixed_new, "seconds": total,
             "prompts_s": len(prompts) / total, "batch": 8,
             "note": f"{len(sample)} of its {len(batches)} batches timed ({seconds:.1f} s), the whole extrapolated"}]


def run_agree(args, device):
    """Greedy tokens in fp32 (no rounding noise to flip near ties of random weights' flat logits): the engine
    (compiled, CUDA graphs, all prompts in one batch) against the eager decoder and transformers, each prompt
    alone."""
    from shardlm.inference import Engine, Request, generate_ids
    args.dtype = torch.float32
    hf, model, cfg = hf_model(args, device)
    prompts = mixed_prompts(args, cfg.vocab_size)[:args.agree]
    new = args.mixed_new
    engine = Engine(model, len(prompts), max(map(len, prompts)) + new, compile=device == "cuda" or None)
    ours = [r.tokens for r in engine.run([Request(p, new) for p in prompts])]
    eager, theirs = [], []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            eager.append(generate_ids(model, ids, new)[0].tolist())
            out = hf.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                              eos_token_id=None, attention_mask=torch.ones_like(ids))
            theirs.append(out[0, len(p):].tolist())
    return [{"system": "agree-fp32", "prompts": len(prompts), "new_tokens": new,
             "engine_eq_eager": sum(a == b for a, b in zip(ours, eager)),
             "engine_eq_hf": sum(a == b for a, b in zip(ours, theirs)),
             "eager_eq_hf": sum(a == b for a, b in zip(eager, theirs))}]


def row(args, wb, system, batch, seconds, device, first, tp: int = 1):
    """`wb`: the weight bytes a step reads (every rank its 1/tp of them)."""
    tok_s = batch * args.new / seconds
    card = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    hbm = next((v * tp for k, v in HBM.items() if k in card), None)
    return {"system": system, "gpus": tp, "model": args.preset, "batch": batch, "prompt": args.prompt, "new_tokens": args.new,
            "seq": args.prompt + args.new, "micro_batch": batch, "tok_s": tok_s, "tok_s_gpu": tok_s / tp, "mfu": None,
            "gb_s": wb * args.new / seconds / 1e9,
            "bound_tok_s": hbm / wb if hbm else None, "weight_gb": wb / 1e9,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0,
            "first_tokens": first}


def worker(args):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch._dynamo.config.recompile_limit = 64
    if tp_of(args.system) > 1:
        variant = next((v for v in TP_VARIANTS if args.system.endswith(v)), "")
        return run_shardlm(args, device, tp=tp_of(args.system), variant=variant)
    run = {"shardlm": run_shardlm, "hf-static": lambda a, d: run_hf(a, d, "static"),
           "hf-dynamic": lambda a, d: run_hf(a, d, "dynamic"), "mixed-new": run_mixed_new,
           "mixed-old": run_mixed_old, "agree-fp32": run_agree,
           "shardlm-int8": lambda a, d: run_shardlm(a, d, "int8"),
           "shardlm-int4": lambda a, d: run_shardlm(a, d, "int4"),
           "shardlm-int4-torchao": lambda a, d: run_shardlm(a, d, "int4-torchao")}[args.system]
    for r in run(args, device):
        print("RESULT " + json.dumps(r), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=1, help="generation here runs on one GPU")
    p.add_argument("--preset", default="llama2-7b")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--batches", default="1,16")
    p.add_argument("--mixed", type=int, default=1000, help="prompts of the eval-style run")
    p.add_argument("--mixed-max", type=int, default=256, help="their lengths: uniform in 8 .. this")
    p.add_argument("--mixed-new", type=int, default=64)
    p.add_argument("--mixed-batch", type=int, default=64, help="the engine's slots in the eval-style run")
    p.add_argument("--old-batches", type=int, default=24, help="batches of the old path timed")
    p.add_argument("--agree", type=int, default=32, help="prompts of the fp32 agreement check")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="also shardlm-tpN: the engine over N tensor-parallel "
                   "GPUs (torchrun), its all-reduces one-shot where the GPUs allow; shardlm-tpN-nccl: by NCCL; "
                   "-unfused: the one-row row-parallel products as TP_VARIANTS says; shardlm-int4-torchao: "
                   "torchao's int4 product in the same layers")
    p.add_argument("--tp-prefill-graphs", type=int, default=None, help="shardlm-tpN's Engine(prefill_graphs=): "
                   "prompts replayed as CUDA graphs up to this many tokens (default the engine's: 2048; 0: none)")
    p.add_argument("--profile", type=int, default=0, help="1: each engine system's CUDA kernels by time (--out)")
    p.add_argument("--timeout", type=float, default=400)
    p.add_argument("--record", default=str(ROOT / "bench" / "results.jsonl"))
    p.add_argument("--out", default="/tmp", help="where each system's details and tokens go")
    p.add_argument("--system", default=None, help=argparse.SUPPRESS)
    p.add_argument("--tokens-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    batches = args.batches
    args.batches = [int(b) for b in str(batches).split(",")]
    if args.system:
        return worker(args)
    if args.gpus != max(map(tp_of, args.systems.split(","))):
        sys.exit("--gpus: the most GPUs one system uses (1, or N for shardlm-tpN)")
    from common import job_env, record, run_job
    Path(args.out).mkdir(parents=True, exist_ok=True)
    rows = []
    for system in args.systems.split(","):
        tokens = str(Path(args.out) / f"generate-{system}-tokens.json")
        launch = [sys.executable]
        if tp_of(system) > 1:
            launch += ["-m", "torch.distributed.run", "--nproc-per-node", str(tp_of(system)), "--master-port",
                       str(29500 + random.randrange(1000))]
        cmd = launch + [__file__, "--system", system, "--tokens-out", tokens, f"--batches={batches}"] + [
            f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k in WORKLOAD and v is not None]
        t = time.perf_counter()
        # every process of the job killed past the limit (a tp job's ranks too), each rank's stack in the log
        code, stdout, stderr = run_job(cmd, job_env(ROOT), args.timeout)
        (Path(args.out) / f"generate-{system}.log").write_text(stdout + stderr)
        got = [json.loads(x[7:]) for x in stdout.splitlines() if x.startswith("RESULT ")]  # what it measured
        if code is None:
            print(f"{system}: timed out after {args.timeout:.0f} s\n{stderr[-3000:]}", file=sys.stderr, flush=True)
        elif code or not got:
            print(f"{system}: failed ({code})\n{stderr[-3000:]}", file=sys.stderr, flush=True)
        for r in got:
            r["wall_s"] = time.perf_counter() - t
            print(json.dumps(r), flush=True)
        rows += got
    same = compare_mixed(args)
    for r in rows:
        if r["system"] == "shardlm-mixed" and same is not None:
            r["same_completions"] = same
    card = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    cmd = "python bench/generate.py " + " ".join(sys.argv[1:])
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or None
    for gpus in sorted({r.get("gpus", 1) for r in rows}):
        record(args.record, "generate", card, gpus, [{**{k: v for k, v in r.items() if k != "gpus"}, "commit": commit,
                                                      "command": cmd} for r in rows if r.get("gpus", 1) == gpus])
    print_table(rows, same)


def compare_mixed(args):
    """Of the prompts both eval-style runs decoded, the share whose greedy completions agree."""
    files = [Path(args.out) / f"generate-{s}-tokens.json" for s in ("mixed-new", "mixed-old")]
    if not all(f.is_file() for f in files):
        return None
    new, old = (json.loads(f.read_text()) for f in files)
    both = [k for k in old if k in new]
    return {"compared": len(both), "equal": sum(new[k] == old[k] for k in both)}


def print_table(rows, same):
    by = {(r["system"], r.get("batch")): r for r in rows}
    print(f"\n{'system':<16} {'batch':>5} {'tok/s':>9} {'GB/s':>7} {'of bound':>8} {'peak GiB':>8} {'vs hf-static':>12}  (int8/int4/tpN: vs shardlm)")
    for r in rows:
        if "tok_s" not in r:
            continue
        ref = by.get(("hf-static", r["batch"]))
        if r["system"].startswith(("shardlm-int", "shardlm-tp")):
            ref = by.get(("shardlm", r["batch"]))
        ratio = f"{r['tok_s'] / ref['tok_s']:.2f}x" if ref else "-"
        bound = f"{r['tok_s'] / r['bound_tok_s']:.0%}" if r.get("bound_tok_s") else "-"
        print(f"{r['system']:<16} {r['batch']:>5} {r['tok_s']:>9.1f} {r['gb_s']:>7.0f} {bound:>8} "
              f"{r['peak_mem_gib']:>8.1f} {ratio:>12}")
    for r in rows:
        if r["system"] == "agree-fp32":
            print(f"fp32 greedy, {r['prompts']} prompts x {r['new_tokens']} new: engine = eager decoder on "
                  f"{r['engine_eq_eager']}, engine = transformers on {r['engine_eq_hf']}, eager = transformers on "
                  f"{r['eager_eq_hf']}")
    mixed = {r["system"]: r for r in rows if "prompts_s" in r}
    if mixed:
        for r in mixed.values():
            print(f"{r['system']:<16} {r['prompts']} prompts x {r['new_tokens']} new: {r['seconds']:.1f} s "
                  f"({r['prompts_s']:.1f} prompts/s) {r.get('note', '')}")
        if len(mixed) == 2:
            print(f"engine / old path: {mixed['shardlm-mixed']['prompts_s'] / mixed['old-eval-path']['prompts_s']:.1f}x"
                  + (f"; same greedy completions in bf16: {same['equal']} of {same['compared']} (random weights' "
                     "flat logits: rounding flips near ties; agree-fp32 checks in fp32)" if same else ""))


if __name__ == "__main__":
    main()
