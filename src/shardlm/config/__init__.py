"""Typed run configuration: five sections (model, data, train, parallel, lora) loaded from TOML or a preset,
overridden by dotted command-line flags, validated before any work starts.

The layout follows torchtitan's job config (dataclasses + TOML + `--section.key value` flags). This
package imports no torch: the planner shares `ModelConfig` and its shape arithmetic with the runtime,
so parameter counts have one source of truth. By concern:

  schema.py   the sections as dataclasses, their defaults, the TOML writer
  load.py     presets, TOML files and command-line overrides, converted to each field's type
  checks.py   `validate` (every value, and what the runtime cannot run) and `check_layout` (the layout)
  shapes.py   the arithmetic of a model's shapes: parameters, FLOPs, KV bytes, LoRA's adapters
  errors.py   ConfigError and RunError
"""
from __future__ import annotations

from .checks import BLOCK_RECOMPUTE, CHOICES, NON_NEGATIVE, POSITIVE, UNIT_INTERVAL, Naming, check_layout, validate
from .rope_checks import ROPE_KEYS
from .expert_checks import check_expert_lora
from .errors import ConfigError, RunError
from .load import CONFIG_DIRS, apply_overrides, config_from_dict, load_config, parse_overrides, preset_names
from .schema import IGNORE, SECTIONS, Config, DataConfig, LoRAConfig, ModelConfig, ParallelConfig, TrainConfig, dump_toml
from .shapes import (FREE_GRAD_BUCKET_MB, LORA_MODULES, NF4_BLOCK, NF4_BYTES_PER_WEIGHT, RING_QUERY_ROWS, block_linears, exchanged_kv_heads,
                     fused_parts, lora_targets)
from .stage_checks import check_stages_train, rank_layers

__all__ = ["BLOCK_RECOMPUTE", "CHOICES", "CONFIG_DIRS", "FREE_GRAD_BUCKET_MB", "IGNORE", "LORA_MODULES", "NF4_BLOCK", "NF4_BYTES_PER_WEIGHT", "NON_NEGATIVE",
           "POSITIVE", "RING_QUERY_ROWS", "ROPE_KEYS", "SECTIONS", "UNIT_INTERVAL", "Config", "ConfigError",
           "DataConfig", "LoRAConfig", "ModelConfig", "Naming", "ParallelConfig", "RunError", "TrainConfig",
           "apply_overrides", "block_linears", "check_expert_lora", "check_layout",
           "check_stages_train", "config_from_dict", "dump_toml", "exchanged_kv_heads", "fused_parts",
           "load_config", "lora_targets", "parse_overrides", "preset_names", "rank_layers", "validate"]
