"""Low-rank adaptation (Hu et al. 2021, "LoRA"), as a transform of the model like the parallel strategies:
each targeted linear keeps its weight W0 frozen and adds scale * B A x, with A [rank, in] drawn Gaussian
(std 1 / rank, PEFT's "gaussian" init) and B [out, rank] zero, so training starts from the base model;
scale is alpha / rank, or alpha / sqrt(rank) with rsLoRA (Kalajdzievski 2023). Every other parameter is
frozen too: the optimizer holds state for the adapters alone.

Adapters are named as PEFT names them, one per Hugging Face module: the fused qkv linear carries q_proj,
k_proj and v_proj's (GPT-2's c_attn is one module, so one adapter), the fused gate/up linear gate_proj and
up_proj's, each adding into its rows of the fused output. So an adapter exports as PEFT's
adapter_model.safetensors (`peft_state`), and `merged` folds it into W0 for a plain checkpoint.

Under tensor parallelism an adapter is split like its base: on a column-parallel base, A is whole on every
rank and B's rows are split with the base's (each rank adds its rows of the update); on a row-parallel
base, A's columns are split with the base's input and B is whole, and the rank's B (A_r x_r) joins the
partial sums before the base's all-reduce (or reduce-scatter), so the adapter needs no collective of its
own. The gradients each rank computes only part of (A on column-parallel bases, B on row-parallel ones)
are summed over the group like the norms' (tensor.sum_partial_gradients).

Dropout on the adapters' input draws one process's masks under tensor parallelism: a column-parallel base's
input is whole on every rank, and the ranks' generators, seeded alike, draw the same mask; a row-parallel
base's input is split, and each rank draws the mask of the whole input and keeps its slice (as Megatron-LM
does for its sharded tensors), so the generators stay in step with one another and with one process's.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..sharded_read import LazyMap
from ..model.attention import WHOLE
from ..config import LORA_MODULES, ConfigError, LoRAConfig, ModelConfig, block_linears, fused_parts, lora_targets
from .placement import TPSharding, degree, rank_in, tag
from .tensor import ColumnParallelLinear, RowParallelLinear


def scale(lora: LoRAConfig) -> float:
    return lora.alpha / (math.sqrt(lora.rank) if lora.rslora else lora.rank)


class LoRA(nn.Module):
    """The adapters of one linear layer: `spans` gives each adapter's rows of the layer's (local) output,
    which has `out_features` rows; rows no adapter covers get no update."""

    def __init__(self, in_features: int, out_features: int, spans: list[tuple[str, int, int]], rank: int,
                 scaling: float, dropout: float):
        super().__init__()
        self.spans, self.out_features, self.scaling = spans, out_features, scaling
        self.A = nn.ParameterDict({n: nn.Parameter(torch.empty(rank, in_features)) for n, _, _ in spans})
        self.B = nn.ParameterDict({n: nn.Parameter(torch.empty(stop - start, rank)) for n, start, stop in spans})
        self.A.init_std = 1.0 / rank  # read by Decoder.init_parameter
        self.B.zero_init = True
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.input_shard: tuple[int, int] | None = None  # (rank, degree): x is that slice of the input's features
        self.sequence = None  # context parallelism's ContextParallel: x holds this rank's part of each sequence

    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A [rank x adapters, in] and B [out, rank x adapters]: the update of x is x A^T B^T.

        A fused layer's adapters as two products, their A stacked (x read once) and their B block-diagonal
        with the scale folded into its few weights: a product pair per adapter would read x once each, and
        scaling, slicing and concatenating the update are passes over activations, forward and backward. The
        zero blocks cost rank x (adapters - 1) columns in a product as wide as the layer."""
        rank = self.A[self.spans[0][0]].shape[0]
        a = torch.cat([self.A[name] for name, _, _ in self.spans]) if len(self.spans) > 1 else self.A[self.spans[0][0]]
        rows, at, width = [], 0, rank * len(self.spans)
        for i, (name, start, stop) in enumerate(self.spans):
            b = self.B[name]
            if start > at:
                rows.append(b.new_zeros(start - at, width))
            rows.append(F.pad(b, (i * rank, width - (i + 1) * rank)) if len(self.spans) > 1 else b)
            at = stop
        if at < self.out_features:
            rows.append(rows[-1].new_zeros(self.out_features - at, width))
        b = rows[0] if len(rows) == 1 else torch.cat(rows)
        return a, b * self.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.factors()
        return F.linear(F.linear(self._dropped(x), a), b)

    def _dropped(self, x: torch.Tensor) -> torch.Tensor:
        if (self.input_shard is None and self.sequence is None) or not self.drops():
            return self.dropout(x)
        # A mask drawn over the slice alone was no slice of one process's mask, and took fewer numbers from the
        # generator, so every later mask (the column-parallel layers' too) differed from one process's; the cp
        # ranks' slices of a sequence each drew the same mask, so its positions i and i + T / cp dropped alike.
        # Dropout of ones is the mask itself, drawn as F.dropout draws it on the whole input.
        rank, ranks = self.input_shard or (0, 1)
        width, parts = x.shape[-1], self.sequence.size if self.sequence is not None else 1
        # (contiguous: on a GPU an expanded input takes another kernel, which maps the draws to elements otherwise)
        mask = F.dropout(x.new_ones(*x.shape[:-2], x.shape[-2] * parts, width * ranks), self.dropout.p)
        if self.sequence is not None:
            mask = self.sequence.local(mask.transpose(-2, -1)).transpose(-2, -1)
        return x * mask[..., rank * width:(rank + 1) * width].contiguous()  # kept for backward: the slice alone

    def drops(self) -> bool:
        """Whether dropout changes the adapters' input now (training with lora.dropout > 0)."""
        return self.training and isinstance(self.dropout, nn.Dropout) and self.dropout.p > 0


def _adapter(base: nn.Module, cfg: ModelConfig, path: str, chosen: set[str], lora: LoRAConfig) -> LoRA | None:
    modules = LORA_MODULES[cfg.arch][path]
    parts = fused_parts(cfg, path)
    # One module per component (q_proj, k_proj, v_proj), or one module over all of them (c_attn).
    covers = [(i,) for i in range(len(parts))] if len(modules) == len(parts) else [tuple(range(len(parts)))]
    spec = getattr(base, "shardings", {}).get("weight")
    column = isinstance(base, ColumnParallelLinear)
    local = spec.local_sizes() if column else list(parts)
    starts = [sum(local[:i]) for i in range(len(local) + 1)]
    mine = [(m.rsplit(".", 1)[1], c) for m, c in zip(modules, covers) if m in chosen]
    spans = [(name, starts[c[0]], starts[c[-1] + 1]) for name, c in mine]
    if not spans:
        return None
    out, inp = base.weight.shape
    adapter = LoRA(inp, out, spans, lora.rank, scale(lora), lora.dropout)
    if isinstance(base, RowParallelLinear):
        group = base.group
        full_in = inp * degree(group)
        tag(adapter.A, {n: TPSharding(rank_in(group), degree(group), 1, (full_in,), (True,)) for n, _, _ in spans})
        tag(adapter.B, {n: TPSharding(rank_in(group), degree(group)) for n, _, _ in spans},
             {n: 0 for n, _, _ in spans} if degree(group) > 1 else {})
        if degree(group) > 1:
            adapter.input_shard = (rank_in(group), degree(group))
    elif column:
        group = base.group
        tag(adapter.A, {n: TPSharding(rank_in(group), degree(group)) for n, _, _ in spans},
             {n: 0 for n, _, _ in spans} if degree(group) > 1 else {})
        b_specs, b_partial = {}, {}
        for name, c in mine:
            split = tuple(spec.split[i] for i in c)
            b_specs[name] = TPSharding(spec.rank, spec.degree, 0, tuple(parts[i] for i in c), split,
                                       spec.pad if c[-1] == len(parts) - 1 else 0)
            if not all(split):  # rows kept whole on every rank (key/value heads): partial, as the base's
                b_partial[name] = sum(local[i] for i in c if spec.split[i])
        tag(adapter.B, b_specs, b_partial)
    return adapter


def apply_lora(model: nn.Module, lora: LoRAConfig) -> None:
    """Attach adapters to the targeted linears of every block (after tensor parallelism, before the weights
    exist) and freeze every other parameter."""
    cfg = model.cfg
    chosen = lora_targets(cfg.arch, lora.targets)
    for block in model.parts().layers:
        for path in block_linears(cfg, block.attn.layer):
            base = block.get_submodule(path)
            adapter = _adapter(base, cfg, path, chosen, lora)
            if adapter is not None:
                base.lora = adapter
                adapter.sequence = None if getattr(model, "sequence", WHOLE) is WHOLE else model.sequence
    adapters = adapter_names(model)
    if not adapters:  # the config's check saw adapters somewhere: this slice's MLPs are all experts
        layers = [block.attn.layer for block in model.parts().layers]
        raise ConfigError(f"lora.targets = {lora.targets!r} adapts no linear of this pipeline stage's layers "
                          f"{layers[0]}-{layers[-1]} (their MLPs are mixtures of experts, which take no adapters): "
                          "nothing to train there; add attention's modules (q_proj,k_proj,v_proj,o_proj) or move "
                          "the stage's bounds (parallel.pp_layers)")
    for name, p in model.named_parameters():
        p.requires_grad_(name in adapters)


def adapter_names(model: nn.Module) -> set[str]:
    """The names of the model's adapter parameters, found by their modules."""
    return {f"{mod_name}.{name}" for mod_name, module in model.named_modules() if isinstance(module, LoRA)
            for name, _ in module.named_parameters()}


def is_adapter_key(key: str) -> bool:
    """Whether a key of a saved state (a checkpoint, or shardlm's own adapter files) names an adapter tensor:
    the stored format's naming, read where there is no model to ask."""
    return ".lora." in key


# ---- full state by name: PEFT's format, and the merged weights ---------------------------------------

def _adapters(state: dict, cfg: ModelConfig):
    """(layer, block linear path, module name, A, B) of every adapter in a full state dict."""
    for key in state:  # the keys alone: the base weights are not read (a sharded checkpoint assembles them)
        if ".lora.A." not in key:
            continue
        prefix, name = key.split(".lora.A.")
        layer, path = prefix.removeprefix("layers.").split(".", 1)
        yield int(layer), path, name, state[key], state[f"{prefix}.lora.B.{name}"]


def peft_state(state: dict, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The adapters of a full state dict under PEFT's names (adapter_model.safetensors)."""
    root = "base_model.model.transformer.h" if cfg.arch == "gpt2" else "base_model.model.model.layers"
    out = {}
    for layer, path, name, a, b in _adapters(state, cfg):
        module = next(m for m in LORA_MODULES[cfg.arch][path] if m.rsplit(".", 1)[1] == name)
        out[f"{root}.{layer}.{module}.lora_A.weight"] = a.contiguous()
        out[f"{root}.{layer}.{module}.lora_B.weight"] = b.contiguous()
    return out


def peft_config(cfg: ModelConfig, lora: LoRAConfig, base: str | None = None) -> dict:
    """adapter_config.json for `peft_state`'s tensors."""
    # Only the modules some layer has: where every MLP is a mixture of experts, the dense MLP's names listed
    # modules the model lacks, as if adapted.
    present = {n for layer in range(cfg.num_layers) for path in block_linears(cfg, layer)
               for n in LORA_MODULES[cfg.arch][path]}
    chosen = sorted(lora_targets(cfg.arch, lora.targets) & present)
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
            "lora_dropout": lora.dropout, "use_rslora": lora.rslora, "target_modules": chosen, "bias": "none",
            "fan_in_fan_out": cfg.arch == "gpt2", "init_lora_weights": "gaussian", "inference_mode": True,
            "modules_to_save": None, "base_model_name_or_path": base}


def merged(state: Mapping, cfg: ModelConfig, lora: LoRAConfig) -> LazyMap:
    """A full state with every adapter folded into its base weight (W0 + scale B A on its rows, in fp32) and
    removed: the plain model's state. Each merged weight is made when it is read, so an export of a large
    model holds one full tensor at a time."""
    updates: dict[str, list] = {}
    for layer, path, name, a, b in _adapters(state, cfg):
        modules, parts, start = LORA_MODULES[cfg.arch][path], fused_parts(cfg, path), 0
        if len(modules) == len(parts):
            index = [m.rsplit(".", 1)[1] for m in modules].index(name)
            start = sum(parts[:index])
        updates.setdefault(f"layers.{layer}.{path}.weight", []).append((start, a, b))

    def get(key: str) -> torch.Tensor:
        if key not in updates:
            return state[key]
        w = state[key].float().clone()
        for start, a, b in updates[key]:
            w[start:start + b.shape[0]] += scale(lora) * (b.float() @ a.float())
        return w  # fp32: an update below a bf16 base's spacing would be lost casting back; writers cast
    return LazyMap([k for k in state if not is_adapter_key(k)], get)


def write_peft_dir(state: dict, cfg: ModelConfig, lora: LoRAConfig, out, dtype=None, base: str | None = None,
                   metadata: dict | None = None) -> None:
    """PEFT's adapter directory (adapter_config.json, adapter_model.safetensors) from a full state dict, which
    `peft.PeftModel.from_pretrained` loads onto the Hugging Face base model."""
    import json

    from safetensors.torch import save_file
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.to(dtype) if dtype else v).contiguous() for k, v in peft_state(state, cfg).items()}
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt", **(metadata or {})})
    (out / "adapter_config.json").write_text(json.dumps(peft_config(cfg, lora, base), indent=1) + "\n")


def read_peft_files(path) -> tuple[dict, dict[str, torch.Tensor]]:
    """A PEFT adapter directory's adapter_config.json and tensors as they are stored, refused (ConfigError) where
    either cannot be read: what a server checks of its adapters before it loads the base model."""
    import json

    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    try:
        conf = json.loads((path / "adapter_config.json").read_text())
        tensors = load_file(str(path / "adapter_model.safetensors"))
    except (OSError, ValueError, SafetensorError) as e:
        raise ConfigError(f"{path} is not a readable PEFT adapter directory (adapter_config.json, "
                          f"adapter_model.safetensors): {e}{_given_instead(path)}") from None
    if not isinstance(conf, dict):  # `[]` ended in an AttributeError's traceback
        raise ConfigError(f"{path}: adapter_config.json holds {type(conf).__name__}, not a JSON object: save the "
                          "adapter again")
    return conf, tensors


def read_peft_dir(path, cfg: ModelConfig) -> tuple[LoRAConfig, dict[str, torch.Tensor]]:
    """A PEFT LoRA adapter directory: its settings and its tensors under this model's names (the inverse of
    `write_peft_dir`), for `merged`."""
    path = Path(path)
    conf, tensors = read_peft_files(path)
    if conf.get("peft_type") != "LORA":
        raise ConfigError(f"{path}: peft_type {conf.get('peft_type')!r} is not LORA")
    # Settings that would change the update and that this version does not apply: refused, not ignored.
    # alora_invocation_tokens (activated LoRA) applies the update only after those tokens: loaded as plain
    # LoRA it was applied everywhere, other logits without a word; lora_bias and layer_replication were
    # refused naming a tensor or a layer, not the setting.
    unsupported = [k for k in ("rank_pattern", "alpha_pattern", "modules_to_save", "use_dora", "layers_to_transform",
                               "alora_invocation_tokens", "lora_bias", "layer_replication") if conf.get(k)]
    if unsupported or conf.get("bias", "none") != "none":
        raise ConfigError(f"{path}: adapter_config.json sets {', '.join(unsupported) or 'bias = ' + repr(conf['bias'])}, "
                          "which this version does not load (plain LoRA: one r and lora_alpha for every module)")
    # These initialisations subtract the initial B A from the base weights, which PEFT recomputes from the base
    # on loading: the adapter is an update of that residual base, and on the base itself gave other logits.
    init = conf.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(("pissa", "corda", "olora", "loftq", "lora_ga")):
        raise ConfigError(f"{path}: adapter_config.json sets init_lora_weights = {init!r}, whose adapter updates a "
                          "base PEFT rewrites on loading, which this version does not do: save it with PEFT's "
                          "save_pretrained(..., path_initial_model_for_weight_conversion=DIR) for a plain LoRA "
                          "adapter of the original base, or merge it in PEFT (merge_and_unload) and give that as "
                          "--model")
    if not isinstance(conf.get("r"), int) or "lora_alpha" not in conf:
        raise ConfigError(f"{path}: adapter_config.json lacks r or lora_alpha")
    lora = LoRAConfig(rank=conf["r"], alpha=conf["lora_alpha"], dropout=conf.get("lora_dropout", 0.0),
                      rslora=bool(conf.get("use_rslora", False)))
    where = {m: path_ for path_, modules in LORA_MODULES[cfg.arch].items() for m in modules}
    state, names = {}, {}
    for key, t in tensors.items():
        head, _, kind = key.rpartition(".lora_")  # ...layers.3.self_attn.q_proj, A.weight
        parts = head.split(".")
        blocks = "h" if cfg.arch == "gpt2" else "layers"
        # An adapter of another architecture (GPT-2's transformer.h.N on Llama) or of lm_head/embed_tokens
        # ended in ValueError("'layers' is not in list"), naming neither the adapter nor the tensor.
        i = next((j for j, p in enumerate(parts[:-1]) if p == blocks and parts[j + 1].isdigit()), None)
        if i is None:
            raise ConfigError(f"{path}: {key} is no adapter of a linear inside a {cfg.arch} block (no {blocks}.N in "
                              "its name): this version loads adapters of the blocks' linears only (not of lm_head or "
                              "embed_tokens), and an adapter of another architecture does not fit: use the adapter "
                              "trained on this --model's base")
        layer, module = int(parts[i + 1]), ".".join(parts[i + 2:])
        if module not in where or kind not in ("A.weight", "B.weight"):
            raise ConfigError(f"{path}: {key} is no adapter of a {cfg.arch} block linear this version loads")
        state[f"layers.{layer}.{where[module]}.lora.{kind[0]}.{module.rsplit('.', 1)[1]}"] = t
        names[f"{layer}.{module}"] = names.get(f"{layer}.{module}", "") + kind[0]
    if not state:  # an empty file (a save that failed midway) served the base's answers as the adapter's
        raise ConfigError(f"{path}: adapter_model.safetensors holds no adapter tensors: save or export it again")
    # A file missing one of a pair (a copy cut down by hand): a lone A was a KeyError, a lone B dropped unsaid.
    for linear, kinds in names.items():
        if len(set(kinds)) < 2:
            have, lack = (("lora_A", "lora_B") if kinds[0] == "A" else ("lora_B", "lora_A"))
            raise ConfigError(f"{path}: the adapter of layers.{linear} has its {have} but no {lack} in "
                              "adapter_model.safetensors: the file is incomplete; save or export the adapter again")
    _check_shapes(path, state, cfg, lora.rank)
    return lora, state


def _given_instead(path: Path) -> str:
    """What a directory that is no adapter holds instead, where it is plain, and the fix ('; ...'), or ''."""
    # Runs and models, which --adapter users often pass, and what PEFT itself writes in other forms.
    if (path / "adapter_model.bin").is_file() and not (path / "adapter_model.safetensors").exists():
        return ("; it holds adapter_model.bin, PEFT's older pickle format, and shardlm reads safetensors only: "
                "convert it with PEFT, PeftModel.from_pretrained(base, DIR).save_pretrained(OUT, "
                "safe_serialization=True), and give OUT")
    if (path / "checkpoints").is_dir() or (path / "state.json").is_file():
        return (f"; it is a shardlm run or checkpoint: `shardlm export --checkpoint {path} --out ADAPTER_DIR` "
                "writes its adapter (or give it as --model, its adapters merged)")
    if (path / "config.json").is_file():
        return "; it is a model, not an adapter: give it as --model"
    if path.is_file():
        return f"; it is a file: give the directory holding it ({path.parent})"
    try:
        named = sorted(d.name for d in path.iterdir() if (d / "adapter_config.json").is_file())
    except OSError:  # missing or unreadable: the error says so
        named = []
    if named:  # PEFT saves each adapter of a model but the default one under DIR/NAME
        return (f"; it holds no adapter itself, its subfolder{'s' if len(named) > 1 else ''} "
                f"{', '.join(named)} {'do' if len(named) > 1 else 'does'}: give that folder, e.g. {path / named[0]}")
    return ""


def _check_shapes(path, state: dict, cfg: ModelConfig, rank: int) -> None:
    """An adapter of another model (more layers, other widths) or another r is refused by name, not left to
    fail inside `merged` with a broadcasting error."""
    for layer, linear, name, a, b in _adapters(state, cfg):
        modules = LORA_MODULES[cfg.arch][linear]
        parts = fused_parts(cfg, linear)
        rows = parts[[m.rsplit(".", 1)[1] for m in modules].index(name)] if len(modules) == len(parts) else sum(parts)
        inputs = {"attn.out": cfg.num_heads * cfg.head_size, "mlp.down": cfg.ffn_size}.get(linear, cfg.hidden_size)
        want_a, want_b = (rank, inputs), (rows, rank)
        if layer >= cfg.num_layers:
            raise ConfigError(f"{path} does not fit this model: it adapts layer {layer}, the model has "
                              f"{cfg.num_layers} layers: use the adapter trained on this --model's base")
        if linear not in block_linears(cfg, layer):
            raise ConfigError(f"{path} adapts the MLP of layer {layer} ({name}), which in this model is a mixture "
                              "of experts: its experts take no adapters; use the adapter trained on this --model's base")
        if a.shape[0] != rank or b.shape[-1] != rank:  # the adapter disagrees with itself, whatever the model
            raise ConfigError(f"{path}: adapter_config.json gives r = {rank}, but its {name} adapter of layer {layer} "
                              f"has rank {a.shape[0]} (A {tuple(a.shape)}, B {tuple(b.shape)}): the config is not the "
                              "tensors' (a per-module rank_pattern left out?): save the adapter again with PEFT")
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise ConfigError(f"{path} does not fit this model: its {name} adapter of layer {layer} has A "
                              f"{tuple(a.shape)}, B {tuple(b.shape)}, the model (hidden {cfg.hidden_size}, r {rank}) "
                              f"needs A {want_a}, B {want_b}: use the adapter trained on this --model's base")
