"""The line `shardlm train` opens with: the model's size, the steps to run, the batch, the device and precision,
and every choice of the layout that decides the speed or what trains (tensor, pipeline and context
parallelism, adapters, frozen parameters, the data-parallel engine auto resolved to)."""
from __future__ import annotations


def run_header(cfg, trainer, out) -> str:
    n, p = cfg.model.num_params(), cfg.parallel
    layout = ""
    if p.tp > 1:
        layout += f", tensor parallel over {p.tp} ranks" + (" with sequence parallelism" if p.sp else "")
    if p.pp > 1:
        # interleaved with one virtual stage a rank is 1F1B's order: the label alone would promise a smaller bubble
        flat = p.pp_schedule == "interleaved" and p.virtual_stages == 1
        how = "interleaved with one virtual stage a rank, 1F1B's order: parallel.virtual_stages 2 interleaves" \
            if flat else p.pp_schedule
        layout += f", {p.pp} pipeline stages ({how})"
    if p.cp > 1:
        how = "ring attention" if p.cp_comm == "p2p" else "Ulysses"
        layout += f", each sequence split over {p.cp} ranks (context parallel, {how})"
    if cfg.lora.rank:  # the engine holds the trainable parameters, summed over this rank's stage only
        adapters = sum(q.numel() for q in trainer.model.parameters() if q.requires_grad)
        base = f" over an {cfg.lora.quantize.upper()} base (QLoRA)" if cfg.lora.quantize != "none" else ""
        base += "" if cfg.train.init_from else " over a random base, frozen (no train.init_from to fine-tune)"
        # model.router_bias_update_rate moves no bias of the router LoRA freezes with the base: said, not silent
        held = len(trainer.moe.layers) if trainer.moe.rate > 0 else 0
        bias = f"; the routing bias of {held} MoE layer{'s' if held > 1 else ''} held with its router" if held else ""
        layout += f", LoRA rank {cfg.lora.rank}{base} ({adapters / 1e6:.3f}M trainable on this rank{bias})"
    elif cfg.lora != type(cfg.lora)():  # [lora] keys given beside rank 0, which switches adapters off
        layout += ", lora.rank 0: no adapters, every weight trains (the other [lora] keys unused)"
    if cfg.train.freeze:  # train.freeze: what it holds fixed on this rank
        frozen = sum(q.numel() for q in trainer.model.parameters() if not q.requires_grad)
        # the routing bias (model.router_bias_update_rate) is no parameter: said, as a frozen router stops it too
        held = sum(not m.router.weight.requires_grad for m in trainer.moe.layers) if trainer.moe.rate > 0 else 0
        bias = f", and the routing bias of {held} MoE layer{'s' if held > 1 else ''}" if held else ""
        layout += f", {cfg.train.freeze!r} frozen ({frozen / 1e6:.3f}M parameters on this rank{bias})"
    if p.replicas > 1:  # what auto resolved to is worth seeing: it decides the speed
        kind = "classic DP" if p.dp_mode == "classic" else (f"ZeRO-{p.zero_stage}" if p.zero_stage else "DDP")
        algo = getattr(trainer.engine, "algo", None)
        over = f"{p.replicas} ranks" + (f" (dp {p.dp} x cp {p.cp})" if p.cp > 1 else "")
        layout += f", {kind} over {over}" + (f" (reduce_algo {algo})" if algo else "")
    left = cfg.train.steps - trainer.step
    steps = f"{left} more step{'s' if left > 1 else ''} (to {cfg.train.steps})" if trainer.step else \
        f"{cfg.train.steps} step{'s' if cfg.train.steps > 1 else ''}"
    return (f"shardlm: {n / 1e6:.2f}M parameters, {steps} of {cfg.train.global_batch_size} x "
            f"{cfg.train.seq_len} tokens on {trainer.device} ({cfg.train.precision}){layout}, writing {out}")
