"""`shardlm eval --tasks loss`: perplexity = exp(mean NLL) over the exact tokens of the file."""
import json
import math

import pytest
import torch

from helpers import cli_here


def tiny_model():
    from shardlm.config import load_config
    from shardlm.model import build_model
    return build_model(load_config("tiny").model, seed=0).eval()


@pytest.mark.timeout(60)
def test_a_loss_past_exps_range_has_an_infinite_perplexity_not_a_traceback():
    """A diverged model (here: the head's weights scaled up) scores a mean NLL above 709.78 nats, where
    math.exp overflows: evaluate_ids raised OverflowError (a traceback from `shardlm eval`, which only catches
    ValueError) instead of reporting the loss with an infinite perplexity, as transformers' run_clm does."""
    from shardlm.inference import evaluate_ids
    model = tiny_model()
    with torch.no_grad():
        model.head_weight.mul_(3000)
    ids = list(range(100)) * 3
    r = evaluate_ids(model, ids, 16)
    w = torch.tensor(ids[:18 * 16]).view(18, 16)
    with torch.no_grad():
        logits = model(w[:, :-1]).float()
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1)).item()
    assert r["loss"] > 710 and r["loss"] == pytest.approx(want, rel=1e-5)
    assert r["perplexity"] == math.inf and r["tokens"] == 18 * 15
