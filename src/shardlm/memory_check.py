"""Refusing a run that cannot fit before anything is allocated: the weights, gradients and optimizer state
against the device's free memory, offload's host share against the node's available memory."""
from __future__ import annotations

import os
from dataclasses import replace

import torch

from .config import ConfigError


def check_memory(cfg, device: torch.device, any_rank) -> None:
    """Refuse a model whose weights, gradients and optimizer state alone (a lower bound of what training
    needs, by the planner's count) exceed the memory this device has free, before allocating any."""
    from .plan import Layout, Workload, estimate_memory, host_bytes
    t = cfg.train
    layout = Layout.from_config(cfg)
    work = Workload(t.seq_len, t.micro_batch_size, t.global_batch_size)
    mem = estimate_memory(cfg.model, work, layout)
    # every gradient exists at the step, where one process frees them between steps too (train.free_grads)
    held = estimate_memory(cfg.model, work, replace(layout, free_grads=False))
    need = held.params + held.grads + held.optimizer  # LoRA's: the frozen base, and the adapters' states
    free = free_memory(device)
    short = free is not None and need > free
    if any_rank(short):  # one rank's busy GPU stops them all, not that rank alone
        where = f"{device} has {free / 2**30:.1f} GiB free" if short else "another rank's device has less free"
        raise ConfigError(f"the model ({cfg.model.num_params() / 1e9:.3g}B parameters) needs at least "
                          f"{need / 2**30:.1f} GiB per rank for its weights, gradients and optimizer state, and "
                          f"{where}: shrink the model, or shard it ({_sharding_hint(cfg.parallel)})")
    _check_rope_table(cfg.model, device, any_rank, free)
    _check_activations(cfg, device, any_rank, mem, free)
    # Offload's host memory: every rank of this node takes its share of the same RAM.
    host, local = host_bytes(cfg.model, layout, work), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    avail = free_memory(torch.device("cpu")) if host else None
    short = avail is not None and host * local > avail
    if any_rank(short):
        where = f"this host has {avail / 2**30:.1f} GiB available" if short else "another rank's host has less"
        what = f"parallel.offload = {cfg.parallel.offload!r}" if cfg.parallel.offload != "none" \
            else "parallel.offload_activations = True"
        # the disk tier exists for exactly this; the refusal named every remedy but it
        disk = ", or keep the optimizer state on a local disk (parallel.offload_dir)" \
            if cfg.parallel.offload != "none" and not cfg.parallel.offload_dir else ""
        raise ConfigError(f"{what} keeps {host / 2**30:.1f} GiB per rank "
                          f"in host memory ({local} rank{'s' if local > 1 else ''} on this node: "
                          f"{host * local / 2**30:.1f} GiB), and {where}: shard it over more ranks or nodes "
                          f"(parallel.dp, parallel.cp), or use a host with more memory{disk}")


def _sharding_hint(p) -> str:
    """What shards a model's state further under this layout: ZeRO-2/3 are refused beside pipeline stages."""
    if p.pp > 1:
        split = ", a balanced split (parallel.pp_layers '')" if p.pp_layers else ""
        return f"parallel.zero_stage 1, parallel.tp, more pipeline stages (parallel.pp){split}"
    return "parallel.zero_stage 3, parallel.tp, more ranks"


def _check_rope_table(m, device: torch.device, any_rank, free: int | None) -> None:
    """Refuse a rotary table that cannot fit: it is built for every position up to model.max_seq_len, which a
    typo can make 10**11, and the out-of-memory error that followed blamed train.seq_len."""
    # positions x head_dim float32s, about four such tensors alive at once while cos and sin are taken
    need = 16 * m.max_seq_len * m.head_size if m.arch != "gpt2" else 0
    share = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if device.type == "cpu" else 1  # ranks share host memory
    short = free is not None and need * share > free
    if any_rank(short):
        where = (f"{device} has {free / 2**30:,.1f} GiB free{f' for {share} ranks' if share > 1 else ''}" if short
                 else "another rank's device has less free")
        raise ConfigError(f"model.max_seq_len = {m.max_seq_len:,} needs about {need / 2**30:,.1f} GiB for the rotary "
                          f"position table built for every position, and {where}: lower model.max_seq_len to the "
                          "longest sequence the model is to see")


def _check_activations(cfg, device: torch.device, any_rank, mem, free: int | None) -> None:
    """Refuse a micro-batch whose activations cannot fit (a sequence length of 10**6 typed for 10**3): on a GPU
    it would fail at the first step's forward, on a CPU the kernel would kill the process without a word."""
    t = cfg.train
    share = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if device.type == "cpu" else 1  # ranks share host memory
    # The planner's count is within 10% on GPUs and below the use measured on CPUs: refused only beyond that.
    slack = 1.0 if device.type == "cpu" else 1.25
    short = free is not None and mem.total * share > free * slack  # the planner's peak
    if any_rank(short):
        if not short:
            raise ConfigError("another rank's device has too little free memory for a micro-batch's activations "
                              "(its message says how much)")
        fixes = ["lower train.seq_len or train.micro_batch_size"] + \
            (["recompute (train.recompute full)"] if t.recompute != "full" else []) + \
            ["split each sequence (parallel.cp)"]
        act = mem.activations + mem.buffers
        beside = ""
        # Activations that would fit alone are refused for the model state beside them, which the message named
        # not: moe-1b's 7.1 GiB "against 22.9 GiB free" (its 18.2 GiB of weights and AdamW state unsaid).
        if act * share <= free * slack:
            beside = (f", beside {(mem.total - act) / 2**30:,.1f} GiB for the weights, gradients and optimizer state "
                      f"({mem.total / 2**30:,.1f} GiB in all)")
            fixes.append(f"shard the model ({_sharding_hint(cfg.parallel)})")
        raise ConfigError(f"a micro-batch of {t.micro_batch_size} x {t.seq_len:,} tokens (train.micro_batch_size x "
                          f"train.seq_len) needs about {act / 2**30:,.1f} GiB for its activations by the planner's "
                          f"count{beside}, and {device} has {free / 2**30:.1f} GiB free"
                          f"{f' for {share} ranks' if share > 1 else ''}: {', '.join(fixes[:-1])}, or {fixes[-1]}")


def free_memory(device: torch.device) -> int | None:
    """Bytes free on `device` (None where it cannot be told)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
