"""Vocab-parallel fused linear + cross-entropy against the one-process F.cross_entropy reference."""
import pytest
import torch
import torch.nn.functional as F

import ce_fns
from shardlm.model.loss import linear_cross_entropy
from shardlm.parallel.cross_entropy import vocab_parallel_cross_entropy
from shardlm.testing.distributed import run_distributed

SHAPE, HIDDEN = (2, 6), 8  # 12 tokens


def reference(seed, shape, hidden, vocab):
    h, w, t = ce_fns.problem(seed, shape, hidden, vocab)
    h.requires_grad_()
    w.requires_grad_()
    loss = F.cross_entropy(F.linear(h, w).float().reshape(-1, vocab), t.reshape(-1))
    loss.backward()
    return loss.detach(), h.grad, w.grad


def cases(world):
    # Vocabularies divisible by the world and not (37 pads to 38 at tp 2, to 40 at tp 4; 5 pads to 8 at
    # tp 4, leaving rank 3 only padding rows); chunks of all the tokens, one that divides 12, two that do
    # not (5, and 100 > 12).
    vocabs = [8 * world, 37] + ([5] if world == 4 else [])
    return [(i, SHAPE, HIDDEN, v, c) for i, (v, c) in enumerate((v, c) for v in vocabs for c in (12, 4, 5, 100))]


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_equals_reference(world):
    cs = cases(world)
    per_rank = run_distributed(ce_fns.vocab_parallel_cases, world, cs, timeout=120)
    # Sums over ranks and chunks run in another order than the reference's, yet these small cases stay
    # within assert_close's fp32 defaults.
    for k, (seed, shape, hidden, vocab, chunk) in enumerate(cs):
        loss, grad_h, grad_w = reference(seed, shape, hidden, vocab)
        rows = -(-vocab // world)
        padded_grad_w = torch.cat([grad_w, grad_w.new_zeros(rows * world - vocab, hidden)])
        partial_sum = sum(r[k]["grad_h_partial"] for r in per_rank)
        torch.testing.assert_close(partial_sum, grad_h)
        for rank, r in enumerate(per_rank):
            res = r[k]
            torch.testing.assert_close(res["loss"], loss)
            assert torch.equal(res["loss"], per_rank[0][k]["loss"])  # identical on every rank
            assert torch.equal(res["eval_loss"], res["loss"])  # the no-grad path: same chunks, same sums
            torch.testing.assert_close(res["grad_h"], grad_h)  # copy_to_tp summed the partials
            local = padded_grad_w[rank * rows:(rank + 1) * rows]
            torch.testing.assert_close(res["grad_w"], local)
            pad = max(0, min(rows, (rank + 1) * rows - vocab))
            if pad:
                assert torch.equal(res["grad_w"][rows - pad:], torch.zeros(pad, hidden))


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("chunk", [12, 5])
def test_degree_one_is_linear_cross_entropy(chunk, padded):
    h, w, t = ce_fns.problem(0, SHAPE, HIDDEN, 37)
    h_a, w_a = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref = linear_cross_entropy(h_a, w_a, t, chunk=chunk)
    ref.backward()
    h_b = h.clone().requires_grad_()
    w_b = (torch.cat([w, torch.zeros(3, HIDDEN)]) if padded else w.clone()).requires_grad_()
    loss = vocab_parallel_cross_entropy(h_b, w_b, t, None, 0, 37, chunk=chunk)
    loss.backward()
    assert torch.equal(loss, ref)
    assert torch.equal(h_b.grad, h_a.grad)
    assert torch.equal(w_b.grad[:37], w_a.grad)
    assert torch.equal(w_b.grad[37:], torch.zeros(w_b.shape[0] - 37, HIDDEN))
    with torch.no_grad():
        assert torch.equal(vocab_parallel_cross_entropy(h, w_b, t, None, 0, 37, chunk=chunk),
                           linear_cross_entropy(h, w, t, chunk=chunk))


def test_autocast_runs_in_bf16_and_returns_fp32_grads():
    res = run_distributed(ce_fns.vocab_parallel_autocast, 2, 0, SHAPE, HIDDEN, 37, 5, timeout=120)
    ref_loss, _, ref_grad_w = reference(0, SHAPE, HIDDEN, 37)
    for rank, (loss, grad_w) in enumerate(res):
        assert loss.dtype == torch.float32 and grad_w.dtype == torch.float32
        # bf16 logits (8 significant bits) against fp32 ones: a loose tolerance.
        torch.testing.assert_close(loss, ref_loss, rtol=2e-2, atol=2e-2)
        ref_local = torch.cat([ref_grad_w, torch.zeros(1, HIDDEN)])[19 * rank:19 * (rank + 1)]  # 37 pads to 38
        torch.testing.assert_close(grad_w, ref_local, rtol=5e-2, atol=5e-2)


def test_a_frozen_head_gets_no_weight_gradient_and_the_same_input_gradient():
    """LoRA freezes the head: its weight gradient is neither formed nor returned."""
    h, w, t = ce_fns.problem(1, SHAPE, HIDDEN, 37)
    h_a, w_a = h.clone().requires_grad_(), w.clone().requires_grad_()
    linear_cross_entropy(h_a, w_a, t, chunk=5).backward()
    h_b = h.clone().requires_grad_()
    linear_cross_entropy(h_b, w, t, chunk=5).backward()
    assert torch.equal(h_b.grad, h_a.grad)
