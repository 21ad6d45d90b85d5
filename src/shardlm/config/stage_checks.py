"""What pipeline stages need of a layout: as many micro-batches a step as their schedule runs, and something to
train on every rank. Under `train.freeze` or LoRA a stage can hold nothing trainable (its layers
all frozen, or all mixtures of experts, whose linears take no adapters). The engine refuses such a stage on its
own ranks only, after the rendezvous, while the other stages wait for it in the pipeline's first exchange; so
the layout is refused here, before any process starts, by the model's own parameter names
(ModelConfig.parameter_shapes) and the runtime's own split of the layers (schedules.split_layers). No torch."""
from __future__ import annotations

from ..naming import Naming
from ..schedules import ScheduleError, rank_of, split_layers
from ..schedules import check_layout as check_schedule
from .errors import ConfigError
from .freeze_patterns import frozen_by_pattern
from .schema import LoRAConfig, ModelConfig, ParallelConfig
from .shapes import LORA_MODULES, block_linears, lora_targets


def rank_layers(m: ModelConfig, pp: int, virtual_stages: int, pp_layers: str) -> list[list[int]]:
    """The layers each pipeline rank holds: its stages rank, rank + pp, ... of the runtime's split."""
    stages = pp * virtual_stages
    split = split_layers(m, stages, pp_layers)
    return [[i for s in range(r, stages, pp) for i in split[s]] for r in range(pp)]


def _rank_parameters(m: ModelConfig, names, layers: list[int], first: bool, last: bool) -> set[str]:
    """The names of the parameters a pipeline rank's slice allocates (model.Decoder(layers, first, last)): its
    layers', the embeddings where first, the final norm and head where last (a tied head's embedding copy)."""
    mine = {str(i) for i in layers}
    ends = set()
    if first:
        ends |= {"embed", "pos_embed"}
    if last:
        ends |= {"norm", "lm_head"} | ({"embed"} if m.tie_embeddings else set())
    return {n for n in names if (n.startswith("layers.") and n.split(".")[1] in mine) or n.split(".")[0] in ends}


def check_stages_train(m: ModelConfig, pp: int, virtual_stages: int, pp_layers: str, freeze: str,
                       lora: LoRAConfig, naming: Naming | None = None) -> None:
    """Every pipeline rank has something to train: an adapter under LoRA, a parameter train.freeze leaves."""
    if pp == 1 or not (freeze.strip() or lora.rank):
        return
    naming = naming or Naming()
    show = naming.show
    layers = rank_layers(m, pp, virtual_stages, pp_layers)
    split = (f"{show('pp_layers', pp_layers)}" if pp_layers else
             f"{show('pp', pp)}'s split balanced by compute ({', '.join(str(len(x)) for x in layers)} layers)")
    last = rank_of(pp * virtual_stages - 1, pp)
    names = m.parameter_shapes()
    frozen = set() if lora.rank else set().union(*frozen_by_pattern(freeze, names).values())
    chosen = lora_targets(m.arch, lora.targets) if lora.rank else set()
    for r, mine in enumerate(layers):
        where = (f"pipeline rank {r}'s layer{'s' if len(mine) > 1 else ''} {_spans(mine)}" if mine
                 else f"pipeline rank {r} (no layers)")
        if lora.rank:
            if not any(n in chosen for i in mine for path in block_linears(m, i) for n in LORA_MODULES[m.arch][path]):
                raise ConfigError(f"{show('targets', lora.targets)} adapts no linear of {where} under {split} "
                                  "(their MLPs are mixtures of experts, which take no adapters): that stage would "
                                  "have nothing to train; add attention's modules (q_proj,k_proj,v_proj,o_proj) or "
                                  f"move the stages' bounds ({naming.key('pp_layers')})")
            continue  # train.freeze under LoRA freezes adapters, whose names the run checks
        held = _rank_parameters(m, names, mine, r == 0, r == last)
        if held <= frozen:
            raise ConfigError(f"{show('freeze', freeze)} freezes every parameter of {where} under {split}: that "
                              "stage would have nothing to train; freeze less, or move the stages' bounds "
                              f"({naming.key('pp_layers')}) so that each holds a trained layer")


def dividing_micro(global_batch: int, micro_batch: int, dp: int, p: ParallelConfig) -> int | None:
    """The largest micro batch up to `micro_batch` that splits `global_batch` evenly over `dp` ranks into as
    many micro-batches as `p`'s pipeline schedule needs (at least pp; a multiple of it interleaved); None where
    there is none."""
    if dp < 1 or micro_batch < 1 or global_batch % dp:
        return None
    share = global_batch // dp
    fits = [d for d in range(1, min(micro_batch, share) + 1) if share % d == 0 and schedule_takes(share // d, p)]
    return max(fits, default=None)


def schedule_takes(micro_batches: int, p: ParallelConfig) -> bool:
    """Whether `p`'s pipeline schedule runs this many micro-batches a step (its own check, schedules')."""
    if p.pp == 1:
        return True
    try:
        check_schedule(p.pp_schedule, p.pp, p.virtual_stages, micro_batches)
    except ScheduleError:
        return False
    return True


def batch_fix(global_batch: int, micro_batch: int, dp: int, p: ParallelConfig) -> tuple[str, int, int]:
    """How to make `global_batch` split into micro-batches of at most `micro_batch` over `dp` ranks that `p`'s
    schedule runs: (the setting, its value, the unit it is a multiple of: 0 for a micro batch) - a smaller micro
    batch, else a global batch rounded up to dp x micro x pp."""
    micro = dividing_micro(global_batch, micro_batch, dp, p)
    if micro is not None:
        return "micro_batch", micro, 0
    unit = micro_batch * dp * p.pp
    return "global_batch", -(-global_batch // unit) * unit, unit


def check_batch(p: ParallelConfig, seq: int, micro_batch: int, global_batch: int, naming: Naming) -> None:
    """A positive batch whose global size splits into micro-batches over the dp ranks."""
    key, show = naming.key, naming.show
    bad = [f"{key(k)} ({v})" for k, v in (("seq", seq), ("micro_batch", micro_batch), ("global_batch", global_batch))
           if v < 1]
    if bad:
        raise ConfigError(f"{' and '.join(bad)} must be positive")
    if global_batch % (micro_batch * p.dp):
        name, value, unit = batch_fix(global_batch, micro_batch, p.dp, p)
        fix = f"set {key(name)} to " + (f"a multiple of {unit}, e.g. {value}" if unit else str(value))
        raise ConfigError(f"{show('global_batch', global_batch)} is not divisible by {key('micro_batch')} "
                          f"({micro_batch}) x {key('dp')} ({p.dp}): {fix}")


def _spans(layers: list[int]) -> str:
    """Layers as runs, "0-3, 8-11" (an interleaved rank holds several)."""
    runs, start = [], layers[0]
    for a, b in zip(layers, layers[1:] + [None]):
        if b != a + 1:
            runs.append(f"{start}-{a}" if a != start else str(a))
            start = b
    return ", ".join(runs)
