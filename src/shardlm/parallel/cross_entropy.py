"""Vocab-parallel, chunked, fused output head + cross-entropy.

The head's vocabulary rows are split over the tensor-parallel group (Megatron-LM's vocab-parallel
cross-entropy, Shoeybi et al. 2019, `megatron/core/tensor_parallel/cross_entropy.py`), and the tokens are
processed in chunks whose gradients are formed in the forward pass (Wijmans et al. 2024, "Cut Your Losses
in Large-Vocabulary Language Models"; model/loss.py is the single-device version). Per chunk each rank
forms only its own [chunk, vocab/tp] logits; the softmax normaliser needs three numbers per token from
the whole vocabulary, which two small all-reduces provide (the global max, then the sum of exponentials
stacked with the target's logit), so neither the full [tokens, vocab] logits nor a gather of them across
ranks ever exists.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ..config import IGNORE
from ..model.loss import CHUNK_TOKENS, chunked_cross_entropy, linear_cross_entropy


def _fp32(logits: torch.Tensor, valid: int) -> torch.Tensor:
    x = logits.float()
    if valid < x.shape[-1]:
        # Padding rows (vocabulary padded to a multiple of tp) are no token: -inf gives them no
        # probability mass, hence a zero gradient, whatever their weights hold.
        cols = torch.arange(x.shape[-1], device=x.device)
        x = x.masked_fill(cols >= valid, float("-inf"))
    return x


def local_max(logits: torch.Tensor, valid: int) -> torch.Tensor:
    return _fp32(logits, valid).amax(dim=-1)


def local_partials(logits, valid: int, gmax, t_local, owned) -> torch.Tensor:
    """[2, rows]: this rank's share of sum_v exp(x_v - max) and of the target's logit (0 where the
    target row lives on another rank), stacked so that one all-reduce sums both."""
    x = _fp32(logits, valid)
    sum_exp = (x - gmax[:, None]).exp().sum(dim=-1)
    target = x.gather(1, t_local[:, None]).squeeze(1).masked_fill(~owned, 0.0)
    return torch.stack([sum_exp, target])


def local_logit_grad(logits, valid: int, lse, t_local, owned, trained, n) -> torch.Tensor:
    """d(mean loss over n)/d(local logits) = (softmax - onehot) / n where trained, 0 elsewhere, in the
    logits' dtype."""
    x = _fp32(logits, valid)
    grad = (x - lse[:, None]).exp()
    grad = grad.scatter_add(1, t_local[:, None], -owned[:, None].to(grad.dtype)) * trained[:, None]
    return (grad / n).to(logits.dtype)


_compiled_steps = None


def _steps(compiled: bool):
    global _compiled_steps
    if not compiled:
        return local_max, local_partials, local_logit_grad
    if _compiled_steps is None:
        _compiled_steps = tuple(torch.compile(f, dynamic=False) for f in (local_max, local_partials, local_logit_grad))
    return _compiled_steps


def _chunk_loss(group, vocab_start: int, valid: int, steps, hc, weight, tc, n, want_grad: bool):
    """Summed fp32 loss of one chunk and, if wanted, d(mean loss)/d(local logits)."""
    max_fn, partials_fn, grad_fn = steps
    logits = hc @ weight.t()
    trained = tc != IGNORE
    owned = (tc >= vocab_start) & (tc < vocab_start + weight.shape[0])  # an IGNORE target is owned by none
    t_local = (tc - vocab_start).clamp(0, weight.shape[0] - 1)  # any in-range index where not owned
    gmax = max_fn(logits, valid)
    dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=group)
    stats = partials_fn(logits, valid, gmax, t_local, owned)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
    lse = gmax + stats[0].log()
    loss = ((lse - stats[1]) * trained).sum()
    # grad_h = grad @ weight is then partial: this rank's vocabulary rows only (see below).
    return loss, (grad_fn(logits, valid, lse, t_local, owned, trained, n) if want_grad else None)


def vocab_parallel_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, group,
                                 vocab_start: int, vocab_size: int, chunk: int = CHUNK_TOKENS,
                                 compiled: bool = False) -> torch.Tensor:
    """mean_i CE(h_i W^T, t_i) in fp32, the same on every rank of `group`, where W is the full head
    whose rows [vocab_start, vocab_start + len(weight)) this rank holds in `weight`.

    h: [..., hidden], all the tokens, identical on every rank; targets: [...] global ids in
    [0, vocab_size). Rows of `weight` whose global index is >= vocab_size are padding: they take no part
    in the softmax and get a zero gradient (their weights must be finite; zero is the natural init).

    Gradient contract: the returned gradient of `h` is PARTIAL, the contribution of this rank's
    vocabulary rows only. The caller must put `copy_to_tp(h, group)` (identity forward, all-reduce
    backward) in front of `h`, which sums the partials over the group; this function does not. The
    gradient of `weight` is complete for this rank's rows. With no group (degree 1) this is
    model.loss.linear_cross_entropy.
    """
    if group is None or dist.get_world_size(group) == 1:
        return linear_cross_entropy(h, weight[:vocab_size] if weight.shape[0] > vocab_size else weight,
                                    targets, chunk, compiled)
    valid = max(0, min(weight.shape[0], vocab_size - vocab_start))
    chunk_loss = functools.partial(_chunk_loss, group, vocab_start, valid, _steps(compiled))
    return chunked_cross_entropy(h, weight, targets, chunk, chunk_loss)
