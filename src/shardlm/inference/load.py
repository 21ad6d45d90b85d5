"""A model for inference from a Hugging Face directory or a shardlm run or checkpoint, built on the meta
device and filled tensor by tensor straight into its place on the target device, in the dtype it will run
in: a 7B model never exists in fp32 on the host or the GPU. LoRA adapters (a run's own, or a PEFT adapter
directory's) are folded into each base weight as it is read. Quantised for inference (--quantize), each block is
quantised as it is filled: the 16-bit model never lies on the device whole.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open

from ..adapter_check import check_adapter_target
from ..checkpoint import MANIFEST, CheckpointError, read_state, resolve_checkpoint
from ..sharded_read import ShardedState
from ..config import ConfigError, LoRAConfig, ModelConfig, config_from_dict
from ..model import Decoder
from ..model.hf import open_hf_dir
from ..model.moe import moe_layers
from ..parallel.lora import is_adapter_key, merged, read_peft_dir
from ..precision import DTYPES
from ..runtime.first_rank import first_rank_result
from ..runtime.said import also_moved
from ..tokenizer import Tokenizer, fingerprint, load_tokenizer
from . import quantize as quantization
from .int8 import unquantised


def inference_dtype(name: str | torch.dtype | None, device: torch.device, stored: torch.dtype) -> torch.dtype:
    """`auto` (None): on a GPU the checkpoint's own 16-bit dtype, else bf16 (fp32 masters run in bf16, as
    they trained); on the CPU fp32, where 16-bit matrix products are slow or emulated."""
    if isinstance(name, torch.dtype):
        return name
    if name in (None, "auto"):
        if device.type == "cpu":
            return torch.float32
        return stored if stored in (torch.bfloat16, torch.float16) else torch.bfloat16
    if name not in DTYPES:
        raise ConfigError(f"--dtype {name!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def check_tp_degree(cfg: ModelConfig, tp: int) -> None:
    """--tp against the shapes it splits, on every rank alike before a weight is read: the attention heads and
    a dense MLP's hidden features (a mixture of experts' MLPs stay whole on each rank). A degree that did not
    divide the hidden features sliced them unevenly, and the rank whose slice came out a row longer stopped
    on a shape mismatch blamed on the checkpoint, naming no flag, while the others went on without it."""
    sizes = {"attention heads": cfg.num_heads}
    if not all(cfg.is_moe_layer(i) for i in range(cfg.num_layers)):
        sizes["MLP hidden features"] = cfg.ffn_size
    both = math.gcd(*sizes.values())
    fits = [str(d) for d in range(2, both + 1) if both % d == 0]
    fix = (f"give --tp {', '.join(fits[:-1])}{' or ' if len(fits) > 1 else ''}{fits[-1]}" if fits else
           "no --tp above 1 fits it: run one process, without --tp")
    for what, n in sizes.items():
        if n % tp:
            raise ConfigError(f"--tp {tp} does not divide the model's {n} {what}: {fix}")


_STORED_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


class _Source:
    """The model's tensors by name, read one at a time: `names`, `read(name)`, `dtype` as stored."""

    def __init__(self, path: Path, log=None, verify: bool = True):
        # config.json makes it an HF directory, weights or not: its own error (no weights, an architecture not
        # supported) says what is wrong, where the checkpoint's advised training from it (--train.init_from).
        if (path / "config.json").is_file():
            self.cfg, tensors = open_hf_dir(path)
            self.lora, self.tok_dir, self.router_bias = LoRAConfig(), path, None
            self.names, self.read = list(tensors.names), tensors
            first = next(iter(tensors.where))
            with safe_open(str(tensors.where[first]), framework="pt") as st:
                self.dtype = _STORED_DTYPES.get(st.get_slice(first).get_dtype(), torch.float32)
            return
        ckpt = resolve_checkpoint(path, log, verify=verify)
        state = read_state(ckpt)
        full = config_from_dict(state["config"])
        self.cfg, self.lora, self.tok_dir = full.model, full.lora, ckpt
        self.router_bias = state.get("router_bias")  # DeepSeek-V3's selection bias per MoE layer, if trained
        self.dtype = torch.float32  # the masters
        if (ckpt / MANIFEST).is_file():  # a sharded save: each tensor assembled from its pieces when read
            masters = ShardedState(ckpt, json.loads((ckpt / MANIFEST).read_text())).masters()
            self.names, self.read = list(masters), masters.__getitem__
            return
        self.file = str(ckpt / "model.safetensors")
        try:
            with safe_open(self.file, framework="pt") as st:
                self.names = list(st.keys())
        except Exception as e:  # safetensors raises its own error type for any damage it finds
            raise CheckpointError(f"{self.file} could not be read ({e})") from None

    def read(self, name: str) -> torch.Tensor:
        with safe_open(self.file, framework="pt") as st:
            return st.get_tensor(name)


def _agreed(path: Path, tp_group, stall_s: float | None) -> Path:
    """The checkpoint every tensor-parallel rank loads: the first rank's pick of a run's newest that verifies (it
    notes one skipped as damaged), sent to the others. Each picking its own, a save that a run still training
    committed between two ranks' looks gave them slices of different steps: one model of two checkpoints."""
    if (path / "config.json").is_file():  # an HF directory: nothing to pick
        return path
    return Path(first_rank_result(lambda moved: str(resolve_checkpoint(path, progress=also_moved(None, moved))),
                                  tp_group, stall_s, "rank 0's check of the checkpoint"))


def with_adapters_chat_template(tok: Tokenizer, adapter: str | Path) -> Tokenizer:
    """The adapter's own tokenizer where the base has no chat template and it has one of the same tokens: a
    shardlm adapter export carries its run's (data prepare writes a template where the base has none) and the
    run's generation_config.json, whose end-of-text ids a tokenizer read from the adapter takes."""
    from ..data.instruct import chat_prompter
    adapter = Path(adapter)
    if not (adapter / "tokenizer.json").is_file() or chat_prompter(tok) is not None:
        return tok
    own = load_tokenizer(adapter)
    return own if fingerprint(own) == fingerprint(tok) and chat_prompter(own) is not None else tok


def load_pretrained(path: str | Path, device="cpu", dtype: str | torch.dtype | None = None,
                    adapter: str | Path | None = None, tp_group=None, verify: bool = True,
                    check_tokenizer=None, stall_s: float | None = None,
                    quantize: str = "none") -> tuple[Decoder, Tokenizer, ModelConfig]:
    """The model in eval mode on `device` in `dtype` (`inference_dtype`), its tokenizer and config. A LoRA
    run's adapters, or those of the PEFT adapter directory `adapter`, are merged into its weights. With
    `tp_group`, the model is the training's tensor-parallel one (parallel/tensor.py) and this rank keeps only
    its slice of each sharded weight. `verify` False: `path` is a checkpoint verified already.
    `check_tokenizer(tok)`: called before the weights load, to refuse input the tokenizer cannot take early.
    `stall_s`: how long the other ranks of `tp_group` wait for the first rank's check of a checkpoint to make
    progress (the group's timeout). `quantize` (inference/quantize.py's kinds): the blocks' linear layers in int8
    or int4, each block quantised as it is filled."""
    quantization.check_kind(quantize)
    path, device = Path(path), torch.device(device)
    if not path.exists():  # a Hub name as from_pretrained takes it (gpt2, meta-llama/...): nothing is fetched
        raise FileNotFoundError(f"--model {path}: no such directory (for a Hugging Face Hub model, download its "
                                "config.json, *.safetensors, tokenizer.json and tokenizer_config.json into a "
                                "directory and give that)")
    src = _Source(path, verify=verify) if tp_group is None else _Source(_agreed(path, tp_group, stall_s), verify=False)
    tok = load_tokenizer(src.tok_dir)  # an HF directory without tokenizer.json was named after its weights loaded
    if adapter is not None:
        tok = with_adapters_chat_template(tok, adapter)
    if check_tokenizer is not None:
        check_tokenizer(tok)
    cfg = src.cfg
    dtype = inference_dtype(dtype, device, src.dtype)
    lora, adapters = None, {}
    if src.lora.rank:
        lora = src.lora
        adapters = {n: src.read(n) for n in src.names if is_adapter_key(n)}
    if adapter is not None:
        check_adapter_target(path, adapter)
        lora, adapters = read_peft_dir(adapter, cfg)
    with torch.device("meta"):
        model = Decoder(cfg).to(dtype)
    specs = {}
    if tp_group is not None:
        from ..parallel.placement import degree, shardings
        from ..parallel.tensor import tensor_parallel
        check_tp_degree(cfg, degree(tp_group))
        tensor_parallel(model, tp_group)
        model.to(dtype)  # the parallel layers it put in are made in the default dtype (fp32)
        specs = shardings(model)
    shapes = dict(model.named_parameters())  # on meta: what the checkpoint must hold
    missing = set(shapes) - {n for n in src.names if not is_adapter_key(n)}
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{path} lacks {sorted(missing)[0]}{more} of its model")
    extra = next((n for n in src.names if not is_adapter_key(n) and n not in shapes), None)
    if extra is not None:
        raise CheckpointError(f"{path} holds {extra}, which a {cfg.arch} model of its config has not")

    def fill(names: list[str], params: dict) -> None:
        for name in names:
            t = src.read(name)
            if adapters:
                prefix = name.removesuffix(".weight") + ".lora."
                mine = {k: v for k, v in adapters.items() if k.startswith(prefix)}
                if mine:
                    t = merged({name: t, **mine}, cfg, lora)[name]
            if name in specs:
                if tuple(t.shape) != specs[name].full_shape(params[name].shape):
                    raise CheckpointError(f"{path}: {name} has shape {tuple(t.shape)}, the config gives "
                                          f"{specs[name].full_shape(params[name].shape)}")
                t = specs[name].local(t)
            if t.shape != params[name].shape:
                raise CheckpointError(f"{path}: {name} has shape {tuple(t.shape)}, the config gives "
                                      f"{tuple(params[name].shape)}")
            with torch.no_grad():
                params[name].copy_(t)
    names = [n for n in src.names if not is_adapter_key(n)]
    if quantize == "none":
        model.to_empty(device=device)
        fill(names, dict(model.named_parameters()))
    else:  # the blocks made, filled and quantised one at a time, the rest first
        kept = unquantised(model)
        model.to_empty(device=device, recurse=False)
        for child in model.children():
            if child is not model.layers:
                child.to_empty(device=device)
        fill([n for n in names if not n.startswith("layers.")], dict(model.named_parameters()))
        for key, block in model.layers.items():
            block.to_empty(device=device)
            prefix = f"layers.{key}."
            fill([n for n in names if n.startswith(prefix)],
                 {prefix + n: p for n, p in block.named_parameters()})
            quantization.quantize_block(block, quantize, kept)
        quantization.quantize(model, quantize)  # the head; int4 refused where no layer could take it
    for m in moe_layers(model) if src.router_bias else ():  # routed as in training (parallel/moe_balance.py)
        m.router_bias = torch.tensor(src.router_bias[str(m.layer)], dtype=torch.float32, device=device)
    model.eval()
    return model, tok, cfg
