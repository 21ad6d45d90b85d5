"""One mixture-of-experts layer alone, forward and backward: shardlm's MoE (model/moe.py) beside transformers'
MixtralSparseMoeBlock of the same shape (grouped_mm experts), eager and compiled, under balanced and skewed
routing; and the bare grouped GEMMs (torch._grouped_mm, forward and backward) at the same group sizes. It says
which part of a step is sensitive to the experts' load: bench/moe.py measured shardlm's whole step 1.69x slower
at natural routing (3.9x max/mean load at initialisation) than at balanced routing, HF's 1.06x, with both
models' routing equally skewed at initialisation (2.3-3.6x max/mean per layer).

    python bench/moe_layer.py [--preset moe-1b] [--tokens 8192] [--skew 3.9] [--iters 10]

Routing is forced (the router still runs): balanced, token t's k experts (t k + j) mod E; skewed, each token's
k distinct experts drawn from shares that decay geometrically so that the busiest expert gets about `--skew`
times the mean load. bf16 weights and inputs on a GPU (fp32 on the CPU, where it is a smoke run).
"""
from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

ROUTING = {"mode": "balanced", "experts": None}


def forced_experts(tokens: int, k: int, e: int, mode: str, skew: float, device) -> torch.Tensor:
    """[tokens, k] distinct experts per token: round-robin (balanced) or drawn from geometric shares."""
    if mode == "balanced":
        return (torch.arange(tokens * k, device=device) % e).view(tokens, k)
    g = torch.Generator().manual_seed(0)
    ratio = 1.0
    while True:  # the decay whose busiest expert's share of the k copies is skew / e of them
        shares = ratio ** torch.arange(e, dtype=torch.float64)
        shares /= shares.sum()
        if shares[0] * e >= min(skew, e / k) or ratio < 0.05:
            break
        ratio *= 0.97
    picks = torch.multinomial(shares.float().expand(tokens, e), k, replacement=False, generator=g)
    return picks.to(device)


def patch_routers() -> None:
    """Both models' top-k choice replaced by ROUTING["experts"] (their logits and weights still computed)."""
    from transformers.models.mixtral import modeling_mixtral

    from shardlm.model.moe import MoE
    natural_moe, natural_hf = MoE.route, modeling_mixtral.MixtralTopKRouter.forward

    def route(self, x):
        logits, experts, weights = natural_moe(self, x)
        experts = ROUTING["experts"]
        weights = logits.softmax(-1).gather(-1, experts)
        return logits, experts, weights / weights.sum(-1, keepdim=True)

    def forward(self, hidden_states):
        logits, weights, experts = natural_hf(self, hidden_states)
        experts = ROUTING["experts"]
        weights = logits.float().softmax(-1).gather(-1, experts)
        return logits, weights / weights.sum(-1, keepdim=True), experts
    MoE.route = route
    modeling_mixtral.MixtralTopKRouter.forward = forward


def layers(m, device, dtype):
    """shardlm's MoE layer and HF's sparse block of shape `m`, random weights."""
    from moe import hf_model

    from shardlm.model.moe import MoE
    ours = MoE(m, 0).to(device)
    for p in ours.parameters():
        torch.nn.init.normal_(p, std=0.02)
    hf = hf_model(replace(m, num_layers=1), "grouped_mm", 128, device).model.layers[0].mlp
    return ours.to(dtype).train(), hf.to(dtype).train()


def timed(fn, iters: int, device: str) -> float:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):
        fn()
    sync()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t) / iters * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="moe-1b")
    p.add_argument("--tokens", type=int, default=8192, help="tokens through the layer (micro-batch x seq)")
    p.add_argument("--skew", type=float, default=3.9, help="the skewed routing's busiest expert / mean load")
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    from shardlm.config import load_config
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    m = load_config(args.preset).model
    patch_routers()
    ours, hf = layers(m, device, dtype)
    x = torch.randn(args.tokens, m.hidden_size, device=device, dtype=dtype, requires_grad=True)
    systems = {"shardlm": ours, "shardlm-compiled": torch.compile(ours), "hf": hf, "hf-compiled": torch.compile(hf)}
    e, k = m.num_experts, m.top_k
    up = torch.randn(e, 2 * m.moe_ffn_size, m.hidden_size, device=device, dtype=dtype, requires_grad=True)
    down = torch.randn(e, m.hidden_size, m.moe_ffn_size, device=device, dtype=dtype, requires_grad=True)
    rows = []
    for mode in ("balanced", "skewed"):
        experts = forced_experts(args.tokens, k, e, mode, args.skew, device)
        ROUTING["experts"] = experts
        counts = torch.bincount(experts.reshape(-1), minlength=e)
        load = (counts.max() / counts.float().mean()).item()
        # Backward from a fixed output gradient: a loss over the output would add its own elementwise passes
        # (over [tokens x k, 2 ffn] for the bare GEMMs, more than the GEMM's time).
        grad = torch.randn(args.tokens, m.hidden_size, device=device, dtype=dtype)
        for name, layer in systems.items():
            def step(layer=layer):
                out = layer(x[None] if name.startswith("hf") else x)
                out = out[0] if isinstance(out, tuple) else out
                out.backward(grad.view(out.shape))
            rows.append((name, mode, load, timed(step, args.iters, device)))
        offs = counts.cumsum(0).to(torch.int32)
        for label, w, width in (("grouped_mm up", up, m.hidden_size), ("grouped_mm down", down, m.moe_ffn_size)):
            rows_in = torch.randn(args.tokens * k, width, device=device, dtype=dtype, requires_grad=True)
            grad_out = torch.randn(args.tokens * k, w.shape[1], device=device, dtype=dtype)

            def gemm(w=w, rows_in=rows_in, grad_out=grad_out):
                if not hasattr(torch, "_grouped_mm") or (device == "cpu" and width * rows_in.element_size() % 16):
                    return
                torch._grouped_mm(rows_in, w.transpose(-2, -1), offs=offs).backward(grad_out)
            rows.append((label, mode, load, timed(gemm, args.iters, device)))
    print(f"\n{args.preset} MoE layer, {args.tokens} tokens, top-{k} of {e}, {dtype}, {device}")
    print(f"{'what':<18}{'routing':<10}{'max/mean':>9}{'fwd+bwd ms':>11}{'skewed/balanced':>16}")
    by = {(n, r): ms for n, r, _, ms in rows}
    for n, r, load, ms in rows:
        ratio = f"{ms / by[(n, 'balanced')]:.2f}x" if r == "skewed" and by.get((n, "balanced")) else ""
        print(f"{n:<18}{r:<10}{load:>9.2f}{ms:>11.2f}{ratio:>16}")


if __name__ == "__main__":
    main()
