"""Many LoRA adapters over one base model, each row of a batch with its own (or none): the adapters are not
merged but stacked, and every adapted linear adds B[a] A[a] x for its row's adapter a (S-LoRA, Sheng et al.
2023; Punica's batched gather-matmul, Chen et al. 2023), so requests for different fine-tunes share one
batch and one copy of the base weights.

A fused linear (q/k/v, gate/up) may carry one adapter per component (PEFT's q_proj, k_proj, v_proj): their
A's are stacked along the rank and their B's placed block-diagonally over the components' output rows, so
one pair of batched products covers all of them. Each adapter's scale is folded into its B. Slot 0 of the
stack is all zeros: rows without an adapter add nothing.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..config import LORA_MODULES, ConfigError, ModelConfig, block_linears, fused_parts
from ..model import Decoder
from ..parallel.lora import read_peft_dir, scale


class AdapterRows:
    """Which adapter (index into the stacks, 0: none) each row of the next forward uses: `ids` [rows]. The
    engine sets it before each forward; every RowLoRA of the model reads the same one."""

    def __init__(self):
        self.ids: torch.Tensor | None = None


class RowLoRA(nn.Module):
    """The update of one linear layer for a batch whose rows may each use another adapter: A [n, rank, in] and
    B [n, out, rank] stacked over the adapters, gathered per row."""

    def __init__(self, A: torch.Tensor, B: torch.Tensor, rows: AdapterRows):
        super().__init__()
        self.register_buffer("A", A, persistent=False)
        self.register_buffer("B", B, persistent=False)
        self.rows = rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = self.rows.ids
        shape = x.shape
        x = x.reshape(shape[0], -1, shape[-1])  # [rows, tokens, in]
        h = torch.bmm(x, self.A[ids].transpose(1, 2))
        return torch.bmm(h, self.B[ids].transpose(1, 2)).reshape(*shape[:-1], -1)


def _updates(directory: str | Path, cfg: ModelConfig) -> dict[tuple[int, str], list[tuple[int, torch.Tensor,
                                                                                         torch.Tensor]]]:
    """A PEFT adapter directory's updates by (layer, block linear path): [(first output row, A, scaled B)]."""
    lora, state = read_peft_dir(directory, cfg)
    s = scale(lora)
    out: dict = {}
    for key, a in state.items():
        if ".lora.A." not in key:
            continue
        prefix, name = key.split(".lora.A.")
        layer, path = prefix.removeprefix("layers.").split(".", 1)
        modules, parts = LORA_MODULES[cfg.arch][path], fused_parts(cfg, path)
        start = 0
        if len(modules) == len(parts):
            start = sum(parts[:[m.rsplit(".", 1)[1] for m in modules].index(name)])
        b = state[f"{prefix}.lora.B.{name}"].float() * s
        out.setdefault((int(layer), path), []).append((start, a.float(), b))
    return out


def install_adapters(model: Decoder, directories: dict[str, str | Path], rows: AdapterRows) -> dict[str, int]:
    """Stack the PEFT adapters `directories` (name -> directory) onto the model's linears; returns each name's
    index for `AdapterRows.ids` (from 1). Replaces adapters installed before."""
    cfg = model.cfg
    names = list(directories)
    loaded = [_updates(directories[n], cfg) for n in names]
    p = next(model.parameters())
    for name, updates in zip(names, loaded):
        for (layer, path), ups in updates.items():
            base = model.blocks([layer])[0].get_submodule(path) if str(layer) in model.layers else None
            for start, a, b in ups:
                if base is None or a.shape[1] != base.in_features or start + b.shape[0] > base.out_features:
                    raise ConfigError(f"adapter {name!r} ({directories[name]}) does not fit this model: its "
                                      f"layers.{layer}.{path} update is {tuple(b.shape[:1])} x {tuple(a.shape[1:])}")
    for block in model.blocks():
        for path in block_linears(cfg, block.attn.layer):
            base = block.get_submodule(path)
            base.lora = None
            key = (block.attn.layer, path)
            per_adapter = [u.get(key, []) for u in loaded]
            rank = max((sum(a.shape[0] for _, a, _ in ups) for ups in per_adapter), default=0)
            if rank == 0:
                continue
            out_features, in_features = base.out_features, base.in_features  # int4's words are [out/8, in/8, 8]
            A = torch.zeros(len(names) + 1, rank, in_features)
            B = torch.zeros(len(names) + 1, out_features, rank)
            for i, ups in enumerate(per_adapter, start=1):
                at = 0
                for start, a, b in ups:
                    r = a.shape[0]
                    A[i, at:at + r] = a
                    B[i, start:start + b.shape[0], at:at + r] = b
                    at += r
            base.lora = RowLoRA(A.to(p.device, p.dtype), B.to(p.device, p.dtype), rows)
    return {n: i for i, n in enumerate(names, start=1)}
