"""The fastest any LoRA fine-tuning of a Llama shape can run on this GPU: its matrix products alone, timed.

    python bench/finetune_bound.py [--preset llama2-7b] [--seq 2048] [--micro-batch 1] [--peer-tok-s 10957]

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
With --peer-tok-s (a peer's measured tokens/s on this card), it prints what 1.5x that would need against
each bound. Appends rows with bench "finetune_bound" (system gemm-bound-full / gemm-bound-none).
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


def parts(preset: str, seq: int, micro_batch: int, reps: int) -> dict:
    """One block's products at this shape, timed on this GPU: each linear's forward ("fwd", by name) and
    input-backward ("bwd"), attention's forward and backward, and the head's forward and input-backward."""
    import torch
    import torch.nn.functional as F

    from shardlm.config import load_config
    m = load_config(preset).model
    tokens, dt = micro_batch * seq, torch.bfloat16
    q, kv = m.num_heads * m.head_size, m.kv_heads * m.head_size
    linears = {"q": (m.hidden_size, q), "k": (m.hidden_size, kv), "v": (m.hidden_size, kv), "o": (q, m.hidden_size),
               "gate": (m.hidden_size, m.ffn_size), "up": (m.hidden_size, m.ffn_size),
               "down": (m.ffn_size, m.hidden_size)}
    out = {"fwd": {}, "bwd": {}, "layers": m.num_layers}
    with torch.no_grad():
        for name, (k_in, n_out) in linears.items():
            x, w = torch.randn(tokens, k_in, device="cuda", dtype=dt), torch.randn(n_out, k_in, device="cuda", dtype=dt)
            dy = torch.randn(tokens, n_out, device="cuda", dtype=dt)
            out["fwd"][name] = seconds(lambda: x @ w.t(), reps)
            out["bwd"][name] = seconds(lambda: dy @ w, reps)
        shape = (micro_batch, m.num_heads, seq, m.head_size)
        qh = torch.randn(shape, device="cuda", dtype=dt)
        kh, vh = (torch.randn(micro_batch, m.kv_heads, seq, m.head_size, device="cuda", dtype=dt) for _ in range(2))
    qh.requires_grad_(), kh.requires_grad_(), vh.requires_grad_()
    gqa = {"enable_gqa": True} if m.kv_heads != m.num_heads else {}
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        with torch.no_grad():
            out["attn_f"] = seconds(lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, **gqa), reps)
        y = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, **gqa)
        grad = torch.randn_like(y)
        # The backward alone, again and again over one kept graph (the forward's saved outputs).
        out["attn_b"] = seconds(lambda: torch.autograd.grad(y, (qh, kh, vh), grad, retain_graph=True), reps)
    with torch.no_grad():
        h, head = torch.randn(tokens, m.hidden_size, device="cuda", dtype=dt), \
            torch.randn(m.vocab_size, m.hidden_size, device="cuda", dtype=dt)
        dlogits = torch.randn(tokens, m.vocab_size, device="cuda", dtype=dt)
        out["head"] = seconds(lambda: h @ head.t(), reps) + seconds(lambda: dlogits @ head, reps)
    torch.cuda.empty_cache()
    return out


# The forward products each recomputation runs again (model/recompute.py): none, attention's core, or the
# whole block less the projections whose outputs backward never reads.
RECOMPUTED = {"none": (), "selective": ("attn",), "full": ("q", "k", "v", "o", "gate", "up", "down", "attn"),
              "full-skip-down": ("q", "k", "v", "o", "gate", "up", "attn"),
              "full-skip-out-down": ("q", "k", "v", "gate", "up", "attn")}


def bound_seconds(t: dict, recompute: str) -> float:
    """Seconds of one micro-batch's products under `recompute`: every block's forward, its input-backward,
    the forward products `recompute` runs again, and the head."""
    fwd = {**t["fwd"], "attn": t["attn_f"]}
    layer = sum(fwd.values()) + sum(t["bwd"].values()) + t["attn_b"] + sum(fwd[n] for n in RECOMPUTED[recompute])
    return t["layers"] * layer + t["head"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama2-7b")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--peer-tok-s", type=float, default=None, help="a peer's measured tokens/s on this card")
    p.add_argument("--record", default=str(ROOT / "bench" / "results.jsonl"))
    args = p.parse_args()

    import torch

    from shardlm.config import load_config
    m = load_config(args.preset).model
    tokens = args.micro_batch * args.seq
    t = parts(args.preset, args.seq, args.micro_batch, args.reps)
    bounds = {name: bound_seconds(t, name) for name in ("full", "none")}
    card = torch.cuda.get_device_name()
    flops = load_config(args.preset, {"lora.rank": "16"}).lora.flops_per_token(m, args.seq)
    print(f"\n{card}, {args.preset}, {args.micro_batch} x {args.seq} tokens a micro-batch; one layer: linears "
          f"{1e3 * sum(t['fwd'].values()):.3f} ms forward / {1e3 * sum(t['bwd'].values()):.3f} ms input-backward, "
          f"attention {1e3 * t['attn_f']:.3f} / {1e3 * t['attn_b']:.3f} ms; head {1e3 * t['head']:.3f} ms")
    print(f"{'bound':<18}{'s / micro-batch':>16}{'tok/s at most':>15}{'MFU at most':>13}")
    rows = []
    for name, s in bounds.items():
        tok_s = tokens / s
        print(f"{'gemm-bound-' + name:<18}{s:>16.4f}{tok_s:>15.0f}{100 * tok_s * flops / PEAK:>12.1f}%")
        rows.append({"system": f"gemm-bound-{name}", "tok_s": tok_s, "mfu": tok_s * flops / PEAK})
    if args.peer_tok_s:
        need = 1.5 * args.peer_tok_s
        for name, s in bounds.items():
            print(f"1.5x the peer's {args.peer_tok_s:.0f} tok/s = {need:.0f}: {need / (tokens / s):.2f}x the "
                  f"'{name}' bound ({'beyond it' if need > tokens / s else 'within it'})")
    if args.record:
        command = f"python bench/finetune_bound.py --preset {args.preset} --seq {args.seq} --micro-batch {args.micro_batch}"
        record(args.record, "finetune_bound", card, 1,
               [{"system": r["system"], "model": args.preset, "seq": args.seq, "micro_batch": args.micro_batch,
                 "tok_s_gpu": round(r["tok_s"]), "mfu": round(r["mfu"], 4), "peak_mem_gib": None, "command": command}
                for r in rows])

if __name__ == "__main__":
    main()
