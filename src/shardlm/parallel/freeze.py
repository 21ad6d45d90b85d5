"""`train.freeze`: fine-tuning with some modules held fixed (issue 44 item 5), e.g. "experts,router" on a
MoE model, "embed", "layers.0".

The value is a comma-separated list of patterns over the model's module and parameter names (the one-process
names, `layers.3.mlp.experts.up.weight`, which every layout keeps). A pattern matches a name when it matches,
fnmatch-style (`*`, `?`, `[...]`; `*` crosses dots), the whole name or any dotted suffix of it: "router"
matches `layers.1.mlp.router`, "layers.0" the first block, "layers.*.attn" every attention, "embed" the
token embedding, "norm" every norm (a suffix ends at a dot, so "norm" does not match `attn_norm`). Every
parameter under a matched module (or matched itself) is frozen.

Frozen parameters get requires_grad False on the meta model, before the engine is built, so they are in no
flat buffer: no gradients, no fp32 master, no moments (ZeRO-3 shards them as it shards a LoRA base, around
use, parallel/zero3_frozen.py), and autograd computes no gradient for them (a frozen router's logits still
pass gradients to their input; frozen experts under expert parallelism still send their inputs' gradients
back through the all-to-all). Checkpoints save them as they save a LoRA base. Composes with LoRA, which froze
the base already: a pattern may freeze adapters too.

Refused (ConfigError, before anything is allocated): a pattern that freezes nothing in the whole model (it
matches no name, only modules without parameters, or only a LoRA base's weights), and a freeze that leaves
nothing to train.
"""
from __future__ import annotations


from torch import nn

from ..config import ConfigError
from ..config.freeze_patterns import frozen_by_pattern, patterns


def frozen_names(model: nn.Module, spec: str) -> set[str]:
    """The names of the parameters `spec` freezes in `model`; a pattern that freezes none (it matches no
    name, or only modules without parameters) is a ConfigError naming it."""
    frozen = frozen_by_pattern(spec, (n for n, _ in model.named_parameters()))
    pats = list(frozen)
    # Under LoRA the base is frozen already: a pattern naming only base weights ("embed", "experts") once
    # trained exactly as without it.
    idle = [p for p in pats if not any(model.get_parameter(n).requires_grad for n in frozen[p])]
    if idle:
        one = len(idle) == 1
        raise ConfigError(f"train.freeze: {', '.join(map(repr, idle))} match{'es' if one else ''} only weights frozen "
                          f"already (the base under LoRA adapters), so {'it freezes' if one else 'they freeze'} "
                          "nothing: name modules that carry adapters (lora.targets), or leave it out")
    return set().union(*frozen.values())


def apply_freeze(model: nn.Module, spec: str, whole: nn.Module | None = None) -> set[str]:
    """Freeze the parameters of `model` (this rank's part) that `spec` names; `whole`: the one-process model
    (on meta) that the patterns are checked against, so that a pattern naming another pipeline stage's layers
    is not refused here (None: `model` is the whole). Returns the names frozen on this rank."""
    if not patterns(spec):
        return set()
    reference = model if whole is None else whole
    every = frozen_names(reference, spec)
    if all(n in every or not p.requires_grad for n, p in reference.named_parameters()):
        raise ConfigError(f"train.freeze = {spec!r} freezes every trainable parameter: nothing would train")
    mine = {n for n in every if _has(model, n)}
    for name in mine:
        model.get_parameter(name).requires_grad_(False)
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(f"train.freeze = {spec!r} leaves this rank's part of the model (a pipeline stage) "
                          "nothing to train")
    return mine


def _has(model: nn.Module, name: str) -> bool:
    try:
        model.get_parameter(name)
        return True
    except AttributeError:
        return False
