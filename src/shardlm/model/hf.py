"""Hugging Face interop: read and write checkpoint directories (config.json, *.safetensors, tokenizer.json)
of LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM, GPT2LMHeadModel, and the mixtures of experts
MixtralForCausalLM and Qwen2MoeForCausalLM (experts stacked [E, out, in] here, one tensor per expert there).

The mapping is a state-dict adapter in torchtitan's style: names and layouts are translated tensor by
tensor (q/k/v and gate/up are fused here, GPT-2's Conv1D weights are transposed), so no transformers
import is needed to load or save; the tests use transformers as the reference.
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..config import ConfigError, ModelConfig
from ..generation_config import derived_generation_config, with_eos, write_generation_config
from ..hf_config import hf_config_from_model, model_config_from_hf  # noqa: F401 (re-exported)

def _hf_names(cfg: ModelConfig, i: int) -> dict:
    if cfg.arch == "gpt2":
        p = f"transformer.h.{i}."
        return {"attn_norm": p + "ln_1", "mlp_norm": p + "ln_2", "qkv": p + "attn.c_attn", "out": p + "attn.c_proj",
                "up": p + "mlp.c_fc", "down": p + "mlp.c_proj"}
    p = f"model.layers.{i}."
    return {"attn_norm": p + "input_layernorm", "mlp_norm": p + "post_attention_layernorm",
            "q": p + "self_attn.q_proj", "k": p + "self_attn.k_proj", "v": p + "self_attn.v_proj",
            "out": p + "self_attn.o_proj", "gate": p + "mlp.gate_proj", "up": p + "mlp.up_proj",
            "down": p + "mlp.down_proj"}


def hf_recipes(keys, cfg: ModelConfig) -> dict[str, tuple[list[str], object]]:
    """How each of shardlm's tensors is made from an HF checkpoint with tensor names `keys` (any prefix
    convention): name -> (the HF names it reads, the function of those tensors that gives it)."""
    if cfg.arch == "gpt2":  # "h.0..." and "transformer.h.0..." both occur
        theirs = {(k if k.startswith("lm_head") else "transformer." + k.removeprefix("transformer.")): k
                  for k in keys}
    else:
        theirs = {k: k for k in keys}
    same, fuse = (lambda t: t), (lambda *ts: torch.cat(ts))
    conv1d = lambda t: t.t().contiguous()  # noqa: E731  (GPT-2's Conv1D stores [in, out])
    out: dict[str, tuple[list[str], object]] = {}

    def put(ours, names, how=same):
        missing = [n for n in names if n not in theirs]
        if missing:  # a ValueError, which the commands report as an error, not a traceback
            raise ValueError(f"the checkpoint lacks {missing[0]} (for {ours}): not a complete {cfg.arch} model; "
                             "fetch or export its weights again")
        out[ours] = ([theirs[n] for n in names], how)

    if cfg.arch == "gpt2":
        put("embed.weight", ["transformer.wte.weight"])
        put("pos_embed.weight", ["transformer.wpe.weight"])
        put("norm.weight", ["transformer.ln_f.weight"])
        put("norm.bias", ["transformer.ln_f.bias"])
    else:
        put("embed.weight", ["model.embed_tokens.weight"])
        put("norm.weight", ["model.norm.weight"])
    if not cfg.tie_embeddings:
        put("lm_head.weight", ["lm_head.weight"])
    for i in range(cfg.num_layers):
        n, p = _hf_names(cfg, i), f"layers.{i}."
        if cfg.arch == "gpt2":
            for ours in ("attn_norm", "mlp_norm"):
                put(p + ours + ".weight", [n[ours] + ".weight"])
                put(p + ours + ".bias", [n[ours] + ".bias"])
            for ours, hf in (("attn.qkv", "qkv"), ("attn.out", "out"), ("mlp.up", "up"), ("mlp.down", "down")):
                put(p + ours + ".weight", [n[hf] + ".weight"], conv1d)
                put(p + ours + ".bias", [n[hf] + ".bias"])
            continue
        put(p + "attn_norm.weight", [n["attn_norm"] + ".weight"])
        put(p + "mlp_norm.weight", [n["mlp_norm"] + ".weight"])
        put(p + "attn.qkv.weight", [n[x] + ".weight" for x in "qkv"], fuse)
        if cfg.qkv_bias:
            put(p + "attn.qkv.bias", [n[x] + ".bias" for x in "qkv"], fuse)
        put(p + "attn.out.weight", [n["out"] + ".weight"])
        if cfg.is_moe_layer(i):
            for ours, (names, how) in _expert_recipes(theirs, cfg, i).items():
                put(p + ours, names, how)
            continue
        put(p + "mlp.up.weight", [n["gate"] + ".weight", n["up"] + ".weight"], fuse)
        put(p + "mlp.down.weight", [n["down"] + ".weight"])
    return out


def _expert_names(cfg: ModelConfig, i: int, mixtral: bool) -> dict:
    """Layer i's mixture-of-experts tensors in HF checkpoints: Mixtral's block_sparse_moe (w1 gate, w3 up, w2
    down per expert) or Qwen2-MoE's mlp (gate/up/down_proj per expert, the shared expert and its gate)."""
    p = f"model.layers.{i}."
    if mixtral:
        e = p + "block_sparse_moe.experts.{}."
        return {"router": p + "block_sparse_moe.gate.weight", "gate": e + "w1.weight", "up": e + "w3.weight",
                "down": e + "w2.weight"}
    e = p + "mlp.experts.{}."
    return {"router": p + "mlp.gate.weight", "gate": e + "gate_proj.weight", "up": e + "up_proj.weight",
            "down": e + "down_proj.weight", "shared": p + "mlp.shared_expert.{}_proj.weight",
            "shared_gate": p + "mlp.shared_expert_gate.weight"}


def _expert_recipes(theirs, cfg: ModelConfig, i: int) -> dict:
    """shardlm's MoE tensors of layer i (below `layers.i.`): per-expert HF tensors stacked into [E, out, in]."""
    n = _expert_names(cfg, i, mixtral=_expert_names(cfg, i, True)["router"] in theirs)
    experts = range(cfg.num_experts)
    fused = f"model.layers.{i}.mlp.experts.gate_up_proj"  # transformers 5's in-memory layout, already stacked

    def stack_up(*ts):  # gate_0..gate_E-1, up_0..up_E-1 -> [E, 2f, h], rows [gate; up] per expert
        return torch.stack([torch.cat(pair) for pair in zip(ts[:cfg.num_experts], ts[cfg.num_experts:])])

    out = {"mlp.router.weight": ([n["router"]], lambda t: t)}
    if fused in theirs:
        out["mlp.experts.up.weight"] = ([fused], lambda t: t)
        out["mlp.experts.down.weight"] = ([f"model.layers.{i}.mlp.experts.down_proj"], lambda t: t)
    else:
        out["mlp.experts.up.weight"] = ([n["gate"].format(j) for j in experts] + [n["up"].format(j) for j in experts],
                                        stack_up)
        out["mlp.experts.down.weight"] = ([n["down"].format(j) for j in experts], lambda *ts: torch.stack(ts))
    if cfg.shared_expert_ffn_hidden_size:
        out["mlp.shared.up.weight"] = ([n["shared"].format("gate"), n["shared"].format("up")], lambda *ts: torch.cat(ts))
        out["mlp.shared.down.weight"] = ([n["shared"].format("down")], lambda t: t)
        out["mlp.shared_gate.weight"] = ([n["shared_gate"]], lambda t: t)
    return out


def _experts_to_hf(state: dict, cfg: ModelConfig, i: int, out: dict) -> None:
    """Layer i's MoE tensors in the per-expert layout of the HF class that computes them (hf_config's choice)."""
    n, p = _expert_names(cfg, i, hf_config_from_model(cfg)["model_type"] == "mixtral"), f"layers.{i}.mlp."
    out[n["router"]] = state[p + "router.weight"]
    for j, (up, down) in enumerate(zip(state[p + "experts.up.weight"], state[p + "experts.down.weight"])):
        gate, up = up.chunk(2)
        out[n["gate"].format(j)], out[n["up"].format(j)] = gate.contiguous(), up.contiguous()
        out[n["down"].format(j)] = down.contiguous()
    if cfg.shared_expert_ffn_hidden_size:
        gate, up = state[p + "shared.up.weight"].chunk(2)
        out[n["shared"].format("gate")], out[n["shared"].format("up")] = gate.contiguous(), up.contiguous()
        out[n["shared"].format("down")] = state[p + "shared.down.weight"]
        out[n["shared_gate"]] = state[p + "shared_gate.weight"]
    elif "shared" in n:  # Qwen2-MoE builds its shared expert whatever its size: one of 0 features, as it saves one
        w = state[p + "router.weight"]
        out[n["shared"].format("gate")] = out[n["shared"].format("up")] = w.new_zeros(0, cfg.hidden_size)
        out[n["shared"].format("down")] = w.new_zeros(cfg.hidden_size, 0)
        out[n["shared_gate"]] = w.new_zeros(1, cfg.hidden_size)


def from_hf_state(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF tensors (any prefix convention) -> shardlm's state dict."""
    return {ours: how(*(hf[k] for k in keys)) for ours, (keys, how) in hf_recipes(hf.keys(), cfg).items()}


def to_hf_state(state: dict[str, torch.Tensor], cfg: ModelConfig, out=None) -> dict[str, torch.Tensor]:
    """shardlm's state dict -> HF tensor names and layouts (the exact inverse of from_hf_state); `out`: where the
    tensors go, one by one, as they are made (a dict, or a `SafetensorsShards` writing them)."""
    out = {} if out is None else out
    q, kv = cfg.num_heads * cfg.head_size, cfg.kv_heads * cfg.head_size
    if cfg.arch == "gpt2":
        out["transformer.wte.weight"] = state["embed.weight"]
        out["transformer.wpe.weight"] = state["pos_embed.weight"]
        out["transformer.ln_f.weight"], out["transformer.ln_f.bias"] = state["norm.weight"], state["norm.bias"]
    else:
        out["model.embed_tokens.weight"] = state["embed.weight"]
        out["model.norm.weight"] = state["norm.weight"]
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    for i in range(cfg.num_layers):
        n, p = _hf_names(cfg, i), f"layers.{i}."
        if cfg.arch == "gpt2":
            for ours in ("attn_norm", "mlp_norm"):
                out[n[ours] + ".weight"], out[n[ours] + ".bias"] = state[p + ours + ".weight"], state[p + ours + ".bias"]
            for ours, theirs in (("attn.qkv", "qkv"), ("attn.out", "out"), ("mlp.up", "up"), ("mlp.down", "down")):
                out[n[theirs] + ".weight"] = state[p + ours + ".weight"].t().contiguous()
                out[n[theirs] + ".bias"] = state[p + ours + ".bias"]
            continue
        out[n["attn_norm"] + ".weight"], out[n["mlp_norm"] + ".weight"] = state[p + "attn_norm.weight"], state[p + "mlp_norm.weight"]
        for x, part in zip("qkv", state[p + "attn.qkv.weight"].split([q, kv, kv])):
            out[n[x] + ".weight"] = part.contiguous()
        if cfg.qkv_bias:
            for x, part in zip("qkv", state[p + "attn.qkv.bias"].split([q, kv, kv])):
                out[n[x] + ".bias"] = part.contiguous()
        out[n["out"] + ".weight"] = state[p + "attn.out.weight"]
        if cfg.is_moe_layer(i):
            _experts_to_hf(state, cfg, i, out)
            continue
        gate, up = state[p + "mlp.up.weight"].chunk(2)
        out[n["gate"] + ".weight"], out[n["up"] + ".weight"] = gate.contiguous(), up.contiguous()
        out[n["down"] + ".weight"] = state[p + "mlp.down.weight"]
    return out


def is_hf_dir(path: str | Path) -> bool:
    path = Path(path)
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def read_hf_dir(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """config.json and the tensors of the weight files transformers reads (open_hf_dir, _weight_files)."""
    cfg, tensors = open_hf_dir(path)
    return cfg, {name: tensors(name) for name in tensors.names}


class HFTensors:
    """shardlm's tensors of an HF checkpoint, each read from the safetensors files only when asked for, so a
    rank that needs its pipeline stage's (or one tensor at a time) never holds the whole model."""

    def __init__(self, files: list[Path], cfg: ModelConfig):
        self.where = {}
        for f in files:
            with _opened(f) as st:
                self.where.update((k, f) for k in st.keys())
        self.recipes = hf_recipes(self.where.keys(), cfg)
        self.names = list(self.recipes)

    def __call__(self, name: str) -> torch.Tensor:
        keys, how = self.recipes[name]
        parts = []
        for k in keys:
            with _opened(self.where[k]) as st:
                try:
                    parts.append(st.get_tensor(k))
                except Exception as e:  # the header read, the data not: truncated after the header
                    raise _unreadable(self.where[k], e) from None
        return how(*parts)


def _unreadable(f: Path, e: Exception) -> ConfigError:
    return ConfigError(f"{f} is not a readable safetensors file ({str(e).splitlines()[0][:200] or type(e).__name__}):"
                       " it is truncated, empty or damaged; download or export it again")


@contextmanager
def _opened(f: Path):
    """safe_open, its errors (SafetensorError, OSError: an empty file, a bad header) as one ConfigError."""
    try:
        st = safe_open(str(f), framework="pt")
    except Exception as e:
        try:  # safetensors says "No such file or directory" of a file this user may not read
            open(f, "rb").close()
        except OSError as denied:
            raise ConfigError(f"{f} cannot be read: {denied.strerror or denied}") from None
        raise _unreadable(f, e) from None
    with st:
        yield st


def open_hf_dir(path: str | Path) -> tuple[ModelConfig, HFTensors]:
    """config.json, and the checkpoint's tensors to be read by name (HFTensors)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json")
    try:  # first: weights of an architecture not supported are no use
        hf = json.loads((path / "config.json").read_text())
    except ValueError as e:
        raise ConfigError(f"{path / 'config.json'} is not valid JSON ({e}): download or save the model again") from None
    try:
        cfg = model_config_from_hf(hf)
    except ConfigError as e:  # say which directory's config (--model's, train.init_from's) is refused
        raise ConfigError(f"{path / 'config.json'}: {e}") from None
    files = _weight_files(path, sorted(path.glob("*.safetensors")))  # the index's, which may lie in subdirectories
    if not files:
        # PyTorch's pickled weights are what older save_pretrained wrote: say how to get the safetensors.
        pickled = sorted(p.name for p in path.glob("*.bin")) or sorted(p.name for p in path.glob("*.pt"))
        fix = (f": it holds {pickled[0]}{' and others' if len(pickled) > 1 else ''}, PyTorch's pickled weights, "
               "which shardlm does not read: save the model as safetensors (transformers: `AutoModelForCausalLM."
               "from_pretrained(DIR).save_pretrained(NEW_DIR)`) or download its *.safetensors files"
               if pickled else ": download or export the weights into it")
        raise FileNotFoundError(f"{path} has no *.safetensors weights{fix}")
    try:
        return cfg, HFTensors(files, cfg)
    except ConfigError:
        raise
    except ValueError as e:  # a tensor the model needs is in no file: say which directory
        raise ConfigError(f"{path}: {e}") from None


def _weight_files(path: Path, found: list[Path]) -> list[Path]:
    """The files transformers' from_pretrained reads: model.safetensors, else those its index lists (a shard
    listed and missing, a download cut short, is named rather than the first tensor it held), else every
    *.safetensors. Other files beside them (an earlier download's shards, a consolidated.safetensors) are not
    read: a stale shard once replaced the model's tensors silently."""
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return found
    try:
        listed = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return found  # not the index transformers writes: the tensors found are checked one by one instead
    if not listed or not all(isinstance(f, str) for f in listed):
        return found
    missing = [f for f in listed if not (path / f).is_file()]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConfigError(f"{path / missing[0]}{more}, which {index.name} lists, is missing: the download or copy "
                          "is incomplete; fetch the model's files again")
    return [path / f for f in listed]


class SafetensorsShards:
    """A sink for HF tensors that writes them to `model.safetensors`, or where they pass `max_bytes`, to
    `model-0000i-of-0000n.safetensors` files and the index transformers reads (save_pretrained's layout):
    at most `max_bytes` and one tensor are held at once, so a state read one tensor at a time (a sharded
    checkpoint's) is exported without the whole model in memory. `done`: called with the elements of each file
    written."""

    def __init__(self, out: Path, dtype: torch.dtype | None = None, metadata: dict | None = None,
                 max_bytes: int = 2**30, done=None):
        self.out, self.cast, self.max_bytes, self.done = out, dtype, max_bytes, done
        self.metadata = {"format": "pt", **(metadata or {})}
        self.staged, self.size, self.total, self.files, self.dtype = {}, 0, 0, [], dtype

    def __setitem__(self, name: str, tensor: torch.Tensor) -> None:
        tensor = (tensor.to(self.cast) if self.cast is not None else tensor).contiguous()
        self.dtype = self.dtype or tensor.dtype
        self.staged[name] = tensor
        self.size += tensor.numel() * tensor.element_size()
        self.total += tensor.numel() * tensor.element_size()
        if self.size >= self.max_bytes:
            self._flush()

    def _flush(self) -> None:
        if self.staged:
            path = self.out / f".part-{len(self.files):05d}.safetensors"
            save_file(self.staged, str(path), metadata=self.metadata)
            if self.done is not None:
                self.done(sum(t.numel() for t in self.staged.values()))
            self.files.append((path, list(self.staged)))
            self.staged, self.size = {}, 0

    def __enter__(self):
        return self

    def __exit__(self, kind, *rest) -> None:
        if kind is not None:
            return
        self._flush()
        if len(self.files) == 1:
            self.files[0][0].replace(self.out / "model.safetensors")
            return
        n, weight_map = len(self.files), {}
        for i, (path, names) in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            path.replace(self.out / final)
            weight_map.update(dict.fromkeys(names, final))
        (self.out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": self.total}, "weight_map": weight_map}, indent=2) + "\n")


def write_hf_dir(state: dict[str, torch.Tensor], cfg: ModelConfig, out: str | Path, tokenizer=None,
                 dtype: torch.dtype | None = None, metadata: dict | None = None,
                 max_shard_bytes: int = 2**30, generation_config: dict | None = None, progress=None,
                 stops: tuple[int | None, ...] = ()) -> None:
    """A directory that transformers' from_pretrained loads: config.json, model.safetensors (or its shards of about
    `max_shard_bytes` and their index), tokenizer files, and generation_config.json as save_pretrained writes
    it: `generation_config` (the weights' source's, carried through the run), else one made from config.json's
    bos/eos ids as GenerationConfig.from_model_config makes it; either also stops at the tokenizer's end-of-text
    and at `stops` (a chat template's end of turn), as shardlm does. `progress`: called with the elements to write,
    it returns what to call with the elements of each file written (a large model is minutes of writing)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    done = progress(cfg.num_params()) if progress is not None else None
    with SafetensorsShards(out, dtype, metadata, max_shard_bytes, done) as shards:
        to_hf_state(state, cfg, shards)
    dtype_name = str(shards.dtype).removeprefix("torch.")
    eos = tokenizer.eos_id if tokenizer is not None else None
    bos = tokenizer.bos_ids[0] if tokenizer is not None and tokenizer.bos_ids else None
    config = hf_config_from_model(cfg, dtype_name, eos, bos)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_generation_config(out, with_eos(generation_config, eos, *stops) if generation_config is not None else
                            with_eos(derived_generation_config(config["bos_token_id"], config["eos_token_id"]), *stops))
    if tokenizer is not None:
        tokenizer.save(out)
        if not (out / "tokenizer_config.json").is_file():
            eos_tok = tokenizer.tok.id_to_token(eos) if eos is not None else None
            bos_tok = tokenizer.tok.id_to_token(bos) if bos is not None else eos_tok
            (out / "tokenizer_config.json").write_text(json.dumps(
                {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos_tok, "bos_token": bos_tok,
                 "model_max_length": cfg.max_seq_len}, indent=2) + "\n")
