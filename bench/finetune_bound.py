"""The fastest any LoRA fine-tuning (or full training, tensor-parallel or not) of a Llama shape can run on
this GPU: its matrix products alone, timed.

    python bench/finetune_bound.py [--preset llama2-7b] [--seq 2048] [--micro-batch 1] [--peer-tok-s 10957]
    python bench/finetune_bound.py --train full --tp 2 --seq 4096 --peer-tok-s 9938   # a tp 2 rank's products

A LoRA step keeps the base weights frozen, so it computes no weight gradient for them, but every frozen
linear still runs its forward and its backward through the inputs; with full recomputation (what fits a
7B model's activations beside its weights on one GPU) the forward runs twice. Attention's core adds the same
count of FlashAttention forwards and one backward. This script times exactly those products at the step's
shapes (M = micro-batch x seq tokens, bf16, cuBLAS and SDPA's flash kernel, CUDA events over repeated calls
after a warm-up) and adds them up per layer and for the head (forward and backward through its input, never
recomputed). Everything else a real step does (the adapters' rank-r products, norms, RoPE, SiLU, the loss,
the optimizer) is left out, so tokens / (that sum) is an upper bound on any system's tokens/s:
- "full": every block's forward twice (forward and recomputation) and its input-backward once;
- "none": once and once, the bound without recomputation (which needs every layer's activations kept).
`--train full` adds every linear's (and the head's) weight-gradient product and charges full training's FLOPs
(ModelConfig.flops_per_token); `--tp N` times one rank's products under Megatron's split (q, k, v, gate, up
and the head by output columns, o and down by input rows, heads over ranks: every rank computes every token
of the micro-batch, so tokens/s per GPU is the micro-batch's tokens over the sum, over N), and leaves out the
collectives. With --peer-tok-s (a peer's measured tokens/s per GPU on this card), it prints what 1.5x that
would need against each bound. Appends rows with bench "finetune_bound" (system gemm-bound-full /
gemm-bound-none, with "-train" and "-tpN" where those are asked).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from common import PEAK, record  # noqa: E402


def seconds(fn, reps: int) -> float:
    """Mean seconds of one fn() over `reps` calls after three warm-up calls (CUDA events)."""
    import torch
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def parts(preset: str, seq: int, micro_batch: int, reps: int, tp: int = 1) -> dict:
    """One block's products at this shape (one rank's of `tp`), timed on this GPU: each linear's forward
    ("fwd", by name), input-backward ("bwd") and weight-backward ("wgt"), attention's forward and backward,
    and the head's forward and input-backward ("head") and weight-backward ("head_w")."""
    import torch
    import torch.nn.functional as F

    from shardlm.config import load_config
    m = load_config(preset).model
    tokens, dt = micro_batch * seq, torch.bfloat16
    heads, kv_heads = m.num_heads // tp, max(m.kv_heads // tp, 1)  # key/value heads fewer than tp: kept whole
    q, kv, ffn = heads * m.head_size, kv_heads * m.head_size, m.ffn_size // tp
    linears = {"q": (m.hidden_size, q), "k": (m.hidden_size, kv), "v": (m.hidden_size, kv), "o": (q, m.hidden_size),
               "gate": (m.hidden_size, ffn), "up": (m.hidden_size, ffn), "down": (ffn, m.hidden_size)}
    out = {"fwd": {}, "bwd": {}, "wgt": {}, "layers": m.num_layers}
    with torch.no_grad():
        for name, (k_in, n_out) in linears.items():
            x, w = torch.randn(tokens, k_in, device="cuda", dtype=dt), torch.randn(n_out, k_in, device="cuda", dtype=dt)
            dy = torch.randn(tokens, n_out, device="cuda", dtype=dt)
            out["fwd"][name] = seconds(lambda: x @ w.t(), reps)
            out["bwd"][name] = seconds(lambda: dy @ w, reps)
            out["wgt"][name] = seconds(lambda: dy.t() @ x, reps)
        shape = (micro_batch, heads, seq, m.head_size)
        qh = torch.randn(shape, device="cuda", dtype=dt)
        kh, vh = (torch.randn(micro_batch, kv_heads, seq, m.head_size, device="cuda", dtype=dt) for _ in range(2))
    qh.requires_grad_(), kh.requires_grad_(), vh.requires_grad_()
    gqa = {"enable_gqa": True} if kv_heads != heads else {}
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        with torch.no_grad():
            out["attn_f"] = seconds(lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, **gqa), reps)
        y = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, **gqa)
        grad = torch.randn_like(y)
        # The backward alone, again and again over one kept graph (the forward's saved outputs).
        out["attn_b"] = seconds(lambda: torch.autograd.grad(y, (qh, kh, vh), grad, retain_graph=True), reps)
    with torch.no_grad():
        h, head = torch.randn(tokens, m.hidden_size, device="cuda", dtype=dt), \
            torch.randn(-(-m.vocab_size // tp), m.hidden_size, device="cuda", dtype=dt)
        dlogits = torch.randn(tokens, head.shape[0], device="cuda", dtype=dt)
        out["head"] = seconds(lambda: h @ head.t(), reps) + seconds(lambda: dlogits @ head, reps)
        out["head_w"] = seconds(lambda: dlogits.t() @ h, reps)
    torch.cuda.empty_cache()
    return out


# The forward products each recomputation runs again (model/recompute.py): none, attention's core, or the
# whole block less the projections whose outputs backward never reads.
RECOMPUTED = {"none": (), "selective": ("attn",), "full": ("q", "k", "v", "o", "gate", "up", "down", "attn"),
              "full-skip-down": ("q", "k", "v", "o", "gate", "up", "attn"),
              "full-skip-out-down": ("q", "k", "v", "gate", "up", "attn")}


def bound_seconds(t: dict, recompute: str, train: str = "lora") -> float:
    """Seconds of one micro-batch's products under `recompute`: every block's forward, its input-backward,
    the forward products `recompute` runs again, and the head; in full training the weight-backwards too."""
    fwd = {**t["fwd"], "attn": t["attn_f"]}
    layer = sum(fwd.values()) + sum(t["bwd"].values()) + t["attn_b"] + sum(fwd[n] for n in RECOMPUTED[recompute])
    if train == "full":
        return t["layers"] * (layer + sum(t["wgt"].values())) + t["head"] + t["head_w"]
    return t["layers"] * layer + t["head"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama2-7b")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--train", default="lora", choices=("lora", "full"), help="full: weight gradients for all")
    p.add_argument("--tp", type=int, default=1, help="one rank's products under tensor parallelism of this degree")
    p.add_argument("--peer-tok-s", type=float, default=None, help="a peer's measured tokens/s on this card")
    p.add_argument("--record", default=str(ROOT / "bench" / "results.jsonl"))
    args = p.parse_args()

    import torch

    from shardlm.config import load_config
    m = load_config(args.preset).model
    tokens = args.micro_batch * args.seq
    t = parts(args.preset, args.seq, args.micro_batch, args.reps, args.tp)
    bounds = {name: bound_seconds(t, name, args.train) for name in ("full", "none")}
    card = torch.cuda.get_device_name()
    if args.train == "full":
        flops = m.flops_per_token(args.seq)
    else:
        flops = load_config(args.preset, {"lora.rank": "16"}).lora.flops_per_token(m, args.seq)
    tokens /= args.tp  # each GPU's share of the micro-batch's tokens
    suffix = ("-train" if args.train == "full" else "") + (f"-tp{args.tp}" if args.tp > 1 else "")
    print(f"\n{card}, {args.preset}, {args.micro_batch} x {args.seq} tokens a micro-batch, {args.train}, tp "
          f"{args.tp}; one layer: linears "
          f"{1e3 * sum(t['fwd'].values()):.3f} ms forward / {1e3 * sum(t['bwd'].values()):.3f} ms input-backward, "
          f"attention {1e3 * t['attn_f']:.3f} / {1e3 * t['attn_b']:.3f} ms; head {1e3 * t['head']:.3f} ms")
    print(f"{'bound':<18}{'s / micro-batch':>16}{'tok/s at most':>15}{'MFU at most':>13}")
    rows = []
    for name, s in bounds.items():
        tok_s = tokens / s
        print(f"{'gemm-bound-' + name:<18}{s:>16.4f}{tok_s:>15.0f}{100 * tok_s * flops / PEAK:>12.1f}%")
        rows.append({"system": f"gemm-bound-{name}{suffix}", "tok_s": tok_s, "mfu": tok_s * flops / PEAK})
    if args.peer_tok_s:
        need = 1.5 * args.peer_tok_s
        for name, s in bounds.items():
            print(f"1.5x the peer's {args.peer_tok_s:.0f} tok/s = {need:.0f}: {need / (tokens / s):.2f}x the "
                  f"'{name}' bound ({'beyond it' if need > tokens / s else 'within it'})")
    if args.record:
        command = (f"python bench/finetune_bound.py --preset {args.preset} --seq {args.seq} --micro-batch "
                   f"{args.micro_batch} --train {args.train} --tp {args.tp}")
        record(args.record, "finetune_bound", card, args.tp,
               [{"system": r["system"], "model": args.preset, "seq": args.seq, "micro_batch": args.micro_batch,
                 "tok_s_gpu": round(r["tok_s"]), "mfu": round(r["mfu"], 4), "peak_mem_gib": None, "command": command}
                for r in rows])

if __name__ == "__main__":
    main()
