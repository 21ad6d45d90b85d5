"""How a layout check names the settings it refuses: by config key (`parallel.tp = 3`), as a run reads them, or
by the planner's flags (`--tp 3`). Below config and the pipeline schedules (it imports nothing of shardlm), so both checks share it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Naming:
    """How a layout check names what it refuses: by config key (`parallel.tp = 3`), or by the planner's
    flags (`--tp 3`)."""
    flags: bool = False
    CONFIG_KEYS = {"global_batch": "train.global_batch_size", "micro_batch": "train.micro_batch_size",
                   "seq": "train.seq_len", "quantize": "lora.quantize", "targets": "lora.targets",
                   "num_experts": "model.num_experts", "freeze": "train.freeze"}
    FLAGS = {"zero_stage": "zero", "targets": "lora_targets", "num_experts": "experts"}

    def key(self, name: str) -> str:
        if self.flags:
            return "--" + self.FLAGS.get(name, name).replace("_", "-")
        return self.CONFIG_KEYS.get(name, f"parallel.{name}")

    def show(self, name: str, value) -> str:
        if self.flags:
            return self.key(name) if value is True else f"{self.key(name)} {value}"
        return f"{self.key(name)} = {value!r}"
