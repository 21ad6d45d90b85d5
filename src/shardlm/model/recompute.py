"""Activation recomputation (`train.recompute`): which of a block's activations backward recomputes.

- none: every activation kept.
- selective: only the attention core (softmax(q k^T) v) recomputed (Korthikanti et al. 2022, "Reducing
  Activation Recomputation in Large Transformer Models", section 5; Megatron's "selective"): attention.py.
- full: each block kept as its input alone and run again in backward (Chen et al. 2016; Megatron's "full").
- full-skip-down: as full, but the recomputed forward never runs the MLP's down projection.
- full-skip-out-down: as full-skip-down, and the attention's output projection is not run again either;
  each block also keeps its mid-residual (x + attention(x)), one [tokens, hidden] tensor.

Why a recomputed forward may skip them: for y = x W^T, backward needs x (W's gradient, a LoRA adapter's A
and B gradients) and W (x's gradient), never y. The down projection's output only enters the residual sum
that leaves the block, so nothing backward needs is computed from it; its input (SwiGLU's product) and the
attention output projection's input (the attention core's output) are recomputed anyway, as the saved
tensors of what produces them, so keeping them would cost memory for nothing. The output projection's
output does feed what backward needs (the MLP norm saves x + out(...)), so skipping it means keeping that
sum: full-skip-out-down checkpoints the two halves of a block separately, and the second half's input is
that sum.

How the skip happens. Eager: torch's non-reentrant checkpoint stops a recomputation once it has recomputed
as many saved tensors as the forward saved (its early stop), and autograd saves a product's inputs before
the product runs, so a region that ends in a linear stops just before that linear's matmul (and before a
row-parallel linear's all-reduce or reduce-scatter). That needs the linear's base product to be the
region's last saver: Linear and RowParallelLinear compute a LoRA adapter's update before the base product
for this. Compiled blocks (train.compile): the checkpoint is placed inside the block's compiled graph (the
wrappers below are what Block.forward, attn_half and mlp_half call), where AOTAutograd tags the region's
nodes with the recompute policies of torch's selective activation checkpointing (SAC: CheckpointPolicy,
`create_selective_checkpoint_contexts`) and its partitioner recomputes only what the backward graph reads,
saving the tensor between two regions (the mid-residual); a checkpoint outside a compiled graph would rerun
all of it. (Compiled gradients are tested with AOTAutograd; that inductor's backward drops the two products
is the partitioner's behaviour, not yet measured on a GPU.) An op-level SAC policy was not used: its policy
sees aten ops, not modules, so it cannot tell the out projection's matmul from the others under compile.
`full` keeps its checkpoint outside the block (Decoder.hidden_states), as before.
"""
from __future__ import annotations

from torch.utils.checkpoint import checkpoint

from ..config import BLOCK_RECOMPUTE

# The block methods each mode wraps in a checkpoint of its own ("forward": the whole block).
WRAPPED = {"full-skip-down": ("forward",), "full-skip-out-down": ("attn_half", "mlp_half")}
assert set(WRAPPED) | {"full"} == set(BLOCK_RECOMPUTE)


class Checkpointed:
    """`fn` (Block.forward or attn_half) recomputed in backward while its block trains without a KV cache."""

    def __init__(self, block, fn):
        self.block, self.fn = block, fn

    def __call__(self, x, rope=None, cache=None, mask=None):
        if self.block.training and cache is None:
            return checkpoint(self.fn, x, rope, None, mask, use_reentrant=False)
        return self.fn(x, rope, cache, mask)


class CheckpointedMLP(Checkpointed):
    """mlp_half (its input alone) recomputed in backward while its block trains."""

    def __call__(self, x):
        return checkpoint(self.fn, x, use_reentrant=False) if self.block.training else self.fn(x)


def set_block_recompute(block, mode: str) -> None:
    """Install (or remove) the checkpoint wrappers `mode` puts on `block`'s methods, as instance attributes
    (as Block.compile_in_halves installs compiled ones), so a later compile traces them into its graph."""
    for name in ("forward", "attn_half", "mlp_half"):
        if isinstance(block.__dict__.get(name), Checkpointed):
            del block.__dict__[name]
    for name in WRAPPED.get(mode, ()):
        kind = CheckpointedMLP if name == "mlp_half" else Checkpointed
        setattr(block, name, kind(block, getattr(block, name)))


def run_block(model, block, x, rope, cache, mask):
    """One block of `model.hidden_states`: under `full`, the checkpoint around the whole block (its input in
    host memory with activation offload); the partial modes' checkpoints are inside the block."""
    if model.recompute == "full" and model.training and cache is None:
        if model.activation_offload is not None:
            return model.activation_offload.checkpoint(block, x, rope, None, mask)
        return checkpoint(block, x, rope, None, mask, use_reentrant=False)
    return block(x, rope, cache, mask)
