"""Fine-tuning speed and memory on one GPU: shardlm's LoRA and QLoRA beside Hugging Face transformers + PEFT,
on the same model shape, micro-batches and global batch.

    python bench/finetune.py [--preset llama2-7b --seq 2048 --micro-batch 1 --microbatches 8 --recompute full]
    python bench/finetune.py --systems shardlm-lora peft-lora --peer-compile 0
    python bench/finetune.py --device cpu --preset tiny --seq 32 --micro-batch 2 --microbatches 2 \\
        --warm 1 --steps 1 --compile 0          # smoke run of the code, not a measurement

Each system runs as its own `torchrun --nproc-per-node 1` job (clean allocator, honest peak); a step is
`--microbatches` micro-batches of `--micro-batch` sequences of random weights' model (the preset's shape),
then AdamW over the adapters, rank `--rank` (16) with alpha `--alpha` (32) on `--targets` (every block
linear), no dropout, activations recomputed as `--recompute` says (full by default, for 7B's activations).
- shardlm-lora: the trainer's step with `lora.rank`, bf16, blocks compiled (`--compile`), parallel.dp 1.
- shardlm-qlora: the same with `lora.quantize nf4` (the frozen block linears in torchao's NF4).
- peft-lora: LlamaForCausalLM (sdpa, bf16 weights) + peft's LoraConfig on q/k/v/o/gate/up/down_proj, as
  an HF Trainer user with bf16=True runs it: PEFT's fp32 adapters under bf16 autocast, non-reentrant
  activation checkpointing on every layer when --recompute is not none (HF has no selective form),
  `enable_input_require_grads`, gradient clipping at 1.0, fused torch AdamW; `--peer-compile 1`
  compiles the PEFT model, and a compile that fails is reported and the system runs eagerly (the row's
  "compiled" says which).
- peft-qlora: the same over bitsandbytes' 4-bit NF4 linears (double quantisation, bf16 compute) with
  `prepare_model_for_kbit_training`; skipped with a note where bitsandbytes does not import.
Every system is charged the same FLOPs per token (`shardlm.config.LoRAConfig.flops_per_token`: the frozen forward and the
backward through the inputs, the adapters' forward and both backwards, attention) against 989 TFLOP/s.
Peak memory is torch.cuda.max_memory_allocated over the timed steps; "base" is the bytes of the frozen
weights (shardlm.parallel.qlora.base_bytes; the quantised codes and scales for NF4). The driver prints a
table with the ratios to peft-lora and the issue's floors, and appends rows (bench "finetune") to
bench/results.jsonl. On --device cpu (gloo, fp32 for the peers) it runs the code only: no memory figures,
no rows recorded.
`--profile N`: N more steps of each job under torch.profiler after its timing (common.profile_steps), the
trace and the top kernels written to `--profile-dir` as JOB.trace.json(.gz) and JOB.kernels.txt, and a line
of GPU busy time by kernel class printed for each.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

from common import (PEAK, busy_line, driver_args, forwarded, job_env, profile_steps, run_systems, shardlm_trainer,
                    timed, workload_args)

ROOT = Path(__file__).resolve().parents[1]
SHARDLM = {"shardlm-lora": "none", "shardlm-qlora": "nf4"}
PEERS = ("peft-lora", "peft-qlora")
BASELINE = "peft-lora"


def model_config(args):
    from shardlm.config import load_config
    return load_config(args.preset, {"model.max_seq_len": str(max(args.seq, load_config(args.preset).model.max_seq_len))})


def adapted_modules(m, targets: str) -> dict[str, tuple[int, int]]:
    """(in, out) features of each Llama block linear `targets` adapts, by its Hugging Face name."""
    from shardlm.config import lora_targets
    if m.arch != "llama":
        raise SystemExit(f"finetune.py compares against HF's LlamaForCausalLM: preset arch {m.arch!r} is not llama")
    h, q, kv, f = m.hidden_size, m.num_heads * m.head_size, m.kv_heads * m.head_size, m.ffn_size
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}
    return {name: shapes[name] for name in (n.rsplit(".", 1)[1] for n in lora_targets(m.arch, targets))}


def shardlm_step(args, system: str, extra: list[str]):
    from shardlm.parallel.qlora import base_bytes
    over = {"train.seq_len": str(args.seq), "train.micro_batch_size": str(args.micro_batch),
            "train.global_batch_size": str(args.micro_batch * args.microbatches), "train.steps": "1000000",
            "train.precision": "bf16", "train.tensorboard": "false", "train.compile": str(bool(args.compile)).lower(),
            "train.recompute": args.recompute, "train.device": args.device,
            "model.max_seq_len": str(model_config(args).model.max_seq_len), "parallel.dp": "1",
            "lora.rank": str(args.rank), "lora.alpha": str(args.alpha), "lora.dropout": "0",
            "lora.targets": args.targets, "lora.quantize": SHARDLM[system]}
    trainer, step = shardlm_trainer(args.preset, over, extra)
    model = trainer.model
    info = {"trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "base_gib": base_bytes(model) / 2**30, "compiled": bool(args.compile), "recompute": args.recompute,
            # ZeRO's or DDP's buffers in symmetric memory are outside the allocator's peak; none at dp 1.
            "outside_gib": trainer.engine.symmetric_bytes() / 2**30}
    return step, info, trainer.close


def _bnb_linears(model):
    """The block linears of `model` (on the GPU, bf16) replaced by bitsandbytes' NF4 ones, as
    `from_pretrained(quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
    bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=bfloat16))` builds them from a checkpoint; the
    weights here are random, so there is no checkpoint to load."""
    import bitsandbytes as bnb
    import torch
    for layer in model.model.layers:
        for path in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            owner, attr = path.rsplit(".", 1)
            parent, old = layer.get_submodule(owner), layer.get_submodule(path)
            new = bnb.nn.Linear4bit(old.in_features, old.out_features, bias=False, compute_dtype=torch.bfloat16,
                                    compress_statistics=True, quant_type="nf4", device="meta")
            new.weight = bnb.nn.Params4bit(old.weight.data, requires_grad=False, compress_statistics=True,
                                           quant_type="nf4")
            setattr(parent, attr, new.to("cuda"))  # Params4bit quantises as it moves to the GPU
            del old
    torch.cuda.empty_cache()
    # What PEFT's prepare_model_for_kbit_training reads to treat the model as quantised.
    model.is_loaded_in_4bit = True


def _bnb_bytes(model) -> int:
    """Frozen bytes of a model with bitsandbytes' 4-bit weights: the packed codes, their absmax (int8 under
    double quantisation) and the absmax's own fp32 scales."""
    total = 0
    for p in model.parameters():
        if p.requires_grad:
            continue
        total += p.numel() * p.element_size()
        state = getattr(p, "quant_state", None)
        while state is not None:
            total += sum(t.numel() * t.element_size() for t in (state.absmax, state.code) if t is not None)
            state = getattr(state, "state2", None)
    return total


def peft_step(args, system: str, say):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    m = model_config(args).model
    cuda = args.device == "cuda"
    quantize = system == "peft-qlora"
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    hf = LlamaConfig(hidden_size=m.hidden_size, intermediate_size=m.ffn_size, num_hidden_layers=m.num_layers,
                     num_attention_heads=m.num_heads, num_key_value_heads=m.kv_heads, head_dim=m.head_size,
                     vocab_size=m.vocab_size, max_position_embeddings=m.max_seq_len, rms_norm_eps=m.norm_eps,
                     rope_theta=m.rope_theta, tie_word_embeddings=m.tie_embeddings, attn_implementation="sdpa")
    torch.manual_seed(0)
    # Built in bf16 directly: 7B in fp32 first would need 27 GB for a moment.
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = LlamaForCausalLM(hf)
    finally:
        torch.set_default_dtype(default)
    recompute = args.recompute != "none"
    # Non-reentrant: transformers 5's default and PyTorch's advice, and the form torch.compile can trace.
    ckpt = {"use_reentrant": False}
    if quantize:
        from peft import prepare_model_for_kbit_training
        _bnb_linears(model)  # every block linear, whichever the adapters target: QLoRA's base
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=recompute,
                                                gradient_checkpointing_kwargs=ckpt)
    elif recompute:
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs=ckpt)
        else:  # transformers before 5
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=ckpt)
        model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=args.alpha, lora_dropout=0.0, bias="none",
                                             target_modules=sorted(adapted_modules(m, args.targets)),
                                             task_type="CAUSAL_LM"))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=cuda)
    accum = args.microbatches
    torch.manual_seed(1)
    x = torch.randint(0, m.vocab_size, (args.micro_batch, args.seq), device=device)
    state = {"fwd": model, "compiled": False, "compile_error": None}
    if args.peer_compile:
        state.update(fwd=torch.compile(model), compiled=True)

    def run():
        for _ in range(accum):
            with torch.autocast("cuda", torch.bfloat16) if cuda else nullcontext():
                loss = state["fwd"](input_ids=x, labels=x).loss
            (loss / accum).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def step():
        try:
            run()
        except Exception as e:
            if not state["compiled"]:
                raise
            # The row says it ran eagerly; the error goes with it.
            say(f"torch.compile of the PEFT model failed, running it eagerly: {type(e).__name__}: {e}")
            state.update(fwd=model, compiled=False, compile_error=f"{type(e).__name__}: {str(e)[:300]}")
            opt.zero_grad(set_to_none=True)
            torch._dynamo.reset()
            if cuda:
                torch.cuda.empty_cache()
            run()
    frozen = _bnb_bytes(model) if quantize else sum(p.numel() * p.element_size() for p in model.parameters()
                                                    if not p.requires_grad)
    info = {"trainable": sum(p.numel() for p in params), "base_gib": frozen / 2**30,
            "recompute": "full" if recompute else "none", "outside_gib": 0.0}
    return step, info, state


def worker(args, extra):
    import torch

    from shardlm.config import LoRAConfig
    t0 = time.perf_counter()
    say = lambda msg: print(f"[{args.system}] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    close, state = None, None
    job = args.system
    if "/" in job:  # a job of bench/finetune_sweep.py: system/micro-batch/recompute, the same sequences a step
        args.system, micro, args.recompute = job.split("/")
        args.microbatches, args.micro_batch = args.micro_batch * args.microbatches // int(micro), int(micro)
    if args.system in SHARDLM:
        step, info, close = shardlm_step(args, args.system, extra)
    else:
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        step, info, state = peft_step(args, args.system, say)
    say(f"built in {time.perf_counter() - t0:.0f} s")
    for i in range(args.warm):
        step()
        say(f"warm step {i} done at {time.perf_counter() - t0:.0f} s")
    dt, mem = timed(step, 0, args.steps, args.device)
    prof = None
    if args.profile:
        name = job.replace("/", "-")
        try:
            prof = profile_steps(step, args.profile, args.device, Path(args.profile_dir, f"{name}.trace.json"))
            with open(Path(args.profile_dir, f"{name}.kernels.txt"), "w") as f:
                f.write(f"{job}: {args.profile} steps, top kernels by total time (busy {prof['busy_ms']:.2f} "
                        f"ms/step, timed step {dt * 1e3:.2f} ms)\n{prof.pop('table')}")
        except Exception as e:  # noqa: BLE001 (the timing stands)
            prof = {"error": repr(e)[:300]}
    if state is not None:
        info.update(compiled=state["compiled"], compile_error=state["compile_error"])
    m = model_config(args).model
    lora = LoRAConfig(rank=args.rank, alpha=args.alpha, targets=args.targets)
    adapters = lora.adapter_count(m)
    if info["trainable"] != adapters:  # the FLOPs charged would not be what this system trains
        say(f"trains {info['trainable']} parameters where the FLOP count assumes {adapters} in adapters")
    flops = lora.flops_per_token(m, args.seq)
    tok = args.micro_batch * args.microbatches * args.seq / dt
    outside = info.pop("outside_gib")
    print("RESULT " + json.dumps({"system": args.system, "job": job, "micro_batch": args.micro_batch,
                                  "microbatches": args.microbatches, "gpus": 1, "step_s": dt, "tok_s_gpu": tok,
                                  "mfu": tok * flops / PEAK, "peak_mem_gib": mem + outside, "flops_per_token": flops,
                                  **info, **({"profile": prof} if prof else {})}), flush=True)
    if close is not None:
        close()  # the trainer's process group released before the interpreter exits


CARD_GIB = 80e9 / 2**30  # "fits an 80 GB card"


def floors(rows: list[dict]) -> list[str]:
    """The issue's floors, each with the measured ratio and whether it holds. Rows may be jobs of several
    settings (system/micro-batch/recompute): LoRA's speed is compared at each PEFT row's setting (the same
    micro-batch, shardlm's recomputation that setting's or a partial form of it, at no more memory) and with
    each system at its fastest row that fits an 80 GB card; QLoRA's against rows of the same setting."""
    def ratio(a, b, key):
        """System a's `key` over system b's, of their first rows at one setting (micro-batch, recomputation)."""
        pairs = ((x, y) for x in rows if x["system"] == a for y in rows if y["system"] == b
                 and (x["micro_batch"], x["recompute"]) == (y["micro_batch"], y["recompute"]) and y[key])
        x, y = next(pairs, (None, None))
        return None if x is None else x[key] / y[key]

    def line(text, value, ok):
        return f"{text}: {'-' if value is None else f'{value:.2f}'} ({'-' if value is None else 'met' if ok(value) else 'NOT met'})"
    lines = []
    for peft in (r for r in rows if r["system"] == BASELINE):
        same = [r for r in rows if r["system"] == "shardlm-lora" and r["micro_batch"] == peft["micro_batch"]
                and r["recompute"].startswith(peft["recompute"]) and r["peak_mem_gib"] <= peft["peak_mem_gib"]]
        best = max(same, key=lambda r: r["tok_s_gpu"], default=None)
        lines.append(line(f"shardlm-lora / peft-lora tok/s at PEFT's {peft['micro_batch']}/{peft['recompute']} "
                          f"({best['recompute'] if best else 'no shardlm row'}, no more memory), floor >= 1.1",
                          best and best["tok_s_gpu"] / peft["tok_s_gpu"], lambda v: v >= 1.1))
    fastest = {s: max((r for r in rows if r["system"] == s and r["peak_mem_gib"] <= CARD_GIB),
                      key=lambda r: r["tok_s_gpu"], default=None) for s in ("shardlm-lora", BASELINE)}
    if all(fastest.values()) and len([r for r in rows if r["system"] == BASELINE]) > 1:
        a, b = fastest["shardlm-lora"], fastest[BASELINE]
        lines.append(line(f"shardlm-lora / peft-lora each at its fastest under 80 GB ({a['job']} / {b['job']}), "
                          f"floor >= 1.2", a["tok_s_gpu"] / b["tok_s_gpu"], lambda v: v >= 1.2))
    base = ratio("shardlm-qlora", "shardlm-lora", "base_gib")
    peak = ratio("shardlm-qlora", "shardlm-lora", "peak_mem_gib")
    qlora_speed = ratio("shardlm-qlora", "peft-qlora", "tok_s_gpu")
    return lines + [line("shardlm-qlora / peft-qlora tok/s, floor >= 1.0", qlora_speed, lambda v: v >= 1.0),
                    line("shardlm-qlora / shardlm-lora base weights, floor <= 0.3", base, lambda v: v <= 0.3),
                    line("shardlm-qlora / shardlm-lora peak memory, floor <= 0.6", peak, lambda v: v <= 0.6)]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload_args(p)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--targets", default="all-linear", help="HF module names (q_proj,v_proj,...) or all-linear")
    p.add_argument("--recompute", default="full", choices=("none", "selective", "full", "full-skip-down", "full-skip-out-down"),
                   help="every system's recomputation (the peers have no selective form: full)")
    p.add_argument("--warm", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--compile", type=int, default=1, help="shardlm's train.compile")
    p.add_argument("--peer-compile", type=int, default=None, help="torch.compile the PEFT model (default: --compile)")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the systems' code on gloo (tiny presets)")
    p.add_argument("--systems", nargs="+", default=[*SHARDLM, *PEERS])
    p.add_argument("--profile", type=int, default=0, help="steps profiled after each job's timing")
    p.add_argument("--profile-dir", default="profiles", help="where --profile writes traces and kernel tables")
    driver_args(p, timeout=1200)
    args, extra = p.parse_known_args()
    if args.peer_compile is None:
        args.peer_compile = args.compile
    if args.system:
        return worker(args, extra)
    systems = list(args.systems)
    if "peft-qlora" in systems:
        try:
            import importlib
            importlib.import_module("bitsandbytes")
            if args.device != "cuda":
                raise ImportError("its 4-bit linears quantise on the GPU")
        except Exception as e:  # a broken install raises more than ImportError
            print(f"peft-qlora: skipped, bitsandbytes does not import here ({type(e).__name__}: {e})", flush=True)
            systems.remove("peft-qlora")
    args.profile_dir = str(Path(args.profile_dir).resolve())
    own = forwarded(args, ("preset", "seq", "micro_batch", "microbatches", "rank", "alpha", "targets", "recompute",
                           "warm", "steps", "compile", "peer_compile", "device", "profile", "profile_dir"))
    rows = run_systems(__file__, systems, lambda s: 1, lambda s: [*own, *extra], job_env(ROOT), args.timeout, args.budget)
    card = "cpu"
    if args.device == "cuda":
        import torch
        card = torch.cuda.get_device_name()
    peft = [r for r in rows if r["system"] == BASELINE]
    print(f"\n{card} x1, {args.preset}, seq {args.seq}, {args.microbatches} micro-batches of {args.micro_batch}, "
          f"LoRA rank {args.rank} alpha {args.alpha:g} on {args.targets}, recompute {args.recompute}, "
          f"{rows[0]['flops_per_token'] / 1e9:.4g} GFLOP/token" if rows else "")
    print(f"{'job':<30}{'compiled':>9}{'tok/s':>10}{'MFU':>8}{'peak GiB':>10}{'base GiB':>10}{'trainable M':>13}"
          f"{'vs ' + peft[0]['job'] if peft else '':>22}")
    for r in rows:
        rel = f"{r['tok_s_gpu'] / peft[0]['tok_s_gpu']:.2f}" if peft else "-"
        print(f"{r['job']:<30}{'yes' if r['compiled'] else 'no':>9}{r['tok_s_gpu']:>10.0f}{100 * r['mfu']:>7.1f}%"
              f"{r['peak_mem_gib']:>10.2f}{r['base_gib']:>10.3f}{r['trainable'] / 1e6:>13.3f}{rel:>22}")
    for r in rows:
        if r.get("compile_error"):
            print(f"{r['system']}: torch.compile failed, measured eagerly: {r['compile_error']}")
    for r in rows:
        if "error" in r.get("profile", {}):
            print(f"{r['job']}: profiling failed: {r['profile']['error']}")
        elif r.get("profile"):
            print(busy_line(r["job"], r["step_s"] * 1e3, r["profile"]))
    if args.device != "cuda":
        print("(a CPU smoke run: the floors below are for the GPU measurement)")
    for text in floors(rows):
        print(text)
    if args.record and args.device == "cuda":
        with open(args.record, "a") as f:
            for r in rows:
                peer = r["system"] in PEERS
                f.write(json.dumps({"bench": "finetune", "date": datetime.date.today().isoformat(), "card": card,
                                    "gpus": 1, "system": r["system"], "model": args.preset, "seq": args.seq,
                                    "micro_batch": r["micro_batch"], "microbatches": r["microbatches"],
                                    "tok_s_gpu": round(r["tok_s_gpu"]), "mfu": round(r["mfu"], 4),
                                    "peak_mem_gib": round(r["peak_mem_gib"], 2), "base_gib": round(r["base_gib"], 3),
                                    "trainable": r["trainable"], "recompute": r["recompute"],
                                    "compiled": r["compiled"],
                                    **({"compile_error": r["compile_error"]} if r.get("compile_error") else {}),
                                    "command": f"python bench/finetune.py --preset {args.preset} --seq {args.seq} "
                                               f"--micro-batch {r['micro_batch']} --microbatches {r['microbatches']} "
                                               f"--rank {args.rank} --alpha {args.alpha:g} --targets {args.targets} "
                                               f"--recompute {r['recompute']} "
                                               + (f"--peer-compile {args.peer_compile} " if peer else
                                                  f"--compile {args.compile} ")
                                               + f"--systems {r['system']}"}) + "\n")


if __name__ == "__main__":
    main()
