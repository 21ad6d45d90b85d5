"""The RoPE scaling a config may give (model.rope_scaling, an HF config.json's rope_scaling or rope_parameters): the
types the model implements and the keys each reads (transformers' linear and Llama 3 forms)."""
from __future__ import annotations

import math

from .errors import ConfigError

ROPE_KEYS = {"default": (), "linear": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def check_rope_scaling(scaling: dict) -> None:
    """RoPE scaling of a supported type with every key it reads, each a positive number: a config.json read for
    inference (no `validate`) once met a missing key as a KeyError, and a string as a TypeError, in the first
    forward pass."""
    if not scaling:
        return
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_KEYS:
        raise ConfigError(f"model.rope_scaling type {kind!r} is not supported ({', '.join(ROPE_KEYS)})")
    unread = sorted(k for k in scaling if k not in ("rope_type", "type"))
    if kind == "default" and unread:  # {"factor": 2} was taken as unscaled RoPE, its factor never applied
        them = "them" if len(unread) > 1 else "it"
        why = (", which rope_type 'default' does not read" if {"rope_type", "type"} & scaling.keys() else
               f" but no rope_type, so nothing would read {them}")
        theta = " (the base is model.rope_theta)" if "rope_theta" in unread else ""
        raise ConfigError(f"model.rope_scaling sets {', '.join(unread)}{why}{theta}: give rope_type "
                          f"({', '.join(repr(k) for k in ROPE_KEYS if k != 'default')}), or leave rope_scaling out")
    missing = [k for k in ROPE_KEYS[kind] if k not in scaling]
    if missing:
        raise ConfigError(f"model.rope_scaling of type {kind!r} lacks {', '.join(missing)} (it has "
                          f"{', '.join(sorted(scaling)) or 'nothing'})")
    for k in ROPE_KEYS[kind]:
        v = scaling[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ConfigError(f"model.rope_scaling.{k} = {v!r} must be a positive number")
