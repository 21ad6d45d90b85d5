"""Typed run configuration: four sections (model, data, train, parallel) loaded from TOML or a preset,
overridden by dotted command-line flags, validated before any work starts.

The layout follows torchtitan's job config (dataclasses + TOML + `--section.key value` flags). This
module imports no torch: the planner shares `ModelConfig` and its shape arithmetic with the runtime,
so parameter counts have one source of truth.
"""
from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_type_hints

from .schedules import SCHEDULES, ScheduleError
from .schedules import check_layout as check_schedule

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


# A target that is not trained on (F.cross_entropy's ignore_index): a prompt token or padding of
# instruction data (data/instruct.py); the losses (model/loss.py, parallel/cross_entropy.py) skip it.
IGNORE = -100


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the key and the value."""


class RunError(RuntimeError):
    """A run cannot go on (a damaged checkpoint, numbers that stopped being finite, a failed save): the
    command reports it in one line and exits non-zero."""


@dataclass
class ModelConfig:
    arch: str = "llama"            # llama (RoPE, RMSNorm, SwiGLU, GQA) | gpt2 (learned positions, LayerNorm, GELU)
    vocab_size: int = 0            # 0: the training data's tokenizer size
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 0          # 0 means num_heads (multi-head attention)
    head_dim: int = 0              # 0 means hidden_size // num_heads
    ffn_hidden_size: int = 0       # 0 means 4h for gpt2, the Llama rule (8h/3 rounded up to 256) for llama
    max_seq_len: int = 2048
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=dict)  # HF's rope_scaling, e.g. {"rope_type": "llama3", ...}
    tie_embeddings: bool = False
    qkv_bias: bool = False         # Qwen2 puts biases on q, k, v only
    sliding_window: int = 0        # Mistral's window: position i attends to i-window+1..i; 0: full causal attention
    num_experts: int = 0           # Mixtral-style MoE MLP with this many experts (planner only so far)
    top_k: int = 2                 # experts each token is routed to
    init_std: float = 0.02

    # Derived shapes. Everything that counts parameters or FLOPs goes through these.
    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        if self.arch == "gpt2":
            return 4 * self.hidden_size
        return 256 * math.ceil(int(8 * self.hidden_size / 3) / 256)

    @property
    def has_bias(self) -> bool:
        return self.arch == "gpt2"

    def param_counts(self) -> dict[str, int]:
        """Parameters by group, exactly as the runtime model allocates them."""
        h, q, kv, f, v = self.hidden_size, self.num_heads * self.head_size, self.kv_heads * self.head_size, self.ffn_size, self.vocab_size
        bias = self.has_bias
        qkv = h * (q + 2 * kv) + ((q + 2 * kv) if (bias or self.qkv_bias) else 0)
        attn_out = q * h + (h if bias else 0)
        if self.arch == "gpt2":
            mlp = 2 * h * f + f + h
            norms = 2 * 2 * h
        else:
            mlp = 3 * h * f
            norms = 2 * h
        experts = max(1, self.num_experts)
        router = h * self.num_experts
        layer = qkv + attn_out + mlp * experts + router + norms
        embed = v * h
        pos = self.max_seq_len * h if self.arch == "gpt2" else 0
        final_norm = 2 * h if self.arch == "gpt2" else h
        head = 0 if self.tie_embeddings else v * h
        return {"embedding": embed, "position": pos, "layers": layer * self.num_layers,
                "per_layer": layer, "final_norm": final_norm, "lm_head": head,
                # what one token's forward multiplies by: top_k of the experts
                "active_per_layer": layer - mlp * (experts - min(experts, self.top_k)),
                "expert_per_layer": mlp * self.num_experts}

    def kv_bytes_per_token(self, itemsize: int, kv_heads: int | None = None) -> int:
        """The keys and values one position holds in a KV cache over every layer (`kv_heads` per layer, the
        model's by default)."""
        return 2 * self.num_layers * (kv_heads or self.kv_heads) * self.head_size * itemsize

    def num_params(self) -> int:
        c = self.param_counts()
        return c["embedding"] + c["position"] + c["layers"] + c["final_norm"] + c["lm_head"]

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 x (parameters that do a matmul per token) + attention.

        Matmul parameters exclude the input and position embeddings (a lookup) but include the output
        head, tied or not. Attention adds 12 * L * (heads * head_dim) * seq per token (QK^T and AV,
        forward and backward, counting the full square as torchtitan and Megatron's MFU do).
        """
        c = self.param_counts()
        matmul = c["active_per_layer"] * self.num_layers + c["final_norm"] + self.vocab_size * self.hidden_size
        return 6 * matmul + 12 * self.num_layers * self.num_heads * self.head_size * seq_len


@dataclass
class DataConfig:
    path: str = ""                 # a directory from `shardlm data prepare`; "" uses the embedded default corpus
    eval_path: str = ""            # another prepared directory for eval; "" holds out the last windows of `path`
    eval_windows: int = 16         # windows held out when eval_path is empty
    tokenizer: str = "byte"        # the default corpus's (byte only); data.path's is the one it was prepared with
    skip_untrained: bool = False   # a step whose batch holds no trained token: skipped and counted, not an error


@dataclass
class TrainConfig:
    steps: int = 20
    global_batch_size: int = 8
    micro_batch_size: int = 8
    seq_len: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 2
    lr_schedule: str = "cosine"    # cosine | linear | constant
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    optimizer: str = "adamw"       # adamw | sgd (SGD with momentum, for tests that Adam's scale invariance would hide)
    momentum: float = 0.9
    grad_clip: float = 1.0         # 0 disables clipping
    seed: int = 0
    precision: str = "fp32"        # fp32 | bf16 | fp16
    recompute: str = "none"        # none | selective | full
    compile: bool = False          # torch.compile each block
    loss_chunk_tokens: int = 2048  # fused head + cross-entropy over chunks of this many tokens; 0: plain
    attention: str = "auto"        # SDPA backend: auto | flash | cudnn | efficient | math
    device: str = "auto"           # auto | cpu | cuda
    log_every: int = 10
    eval_every: int = 0            # 0 disables periodic eval
    eval_batches: int = 4
    save_every: int = 0            # 0 saves only at the end
    keep_checkpoints: int = 2
    peak_tflops: float = 0.0       # 0 looks the device up; used for MFU
    sample_tokens: int = 0         # print a sample of this many tokens after training
    sample_prompt: str = ""
    tensorboard: bool = True
    init_from: str = ""            # an HF checkpoint directory: its config.json the model section, its weights the start


@dataclass
class LoRAConfig:
    """Low-rank adapters (parallel/lora.py): the base weights frozen, rank-`rank` A and B trained."""
    rank: int = 0                  # 0: off, every weight trained
    alpha: float = 16.0            # the update is scaled by alpha / rank (alpha / sqrt(rank) with rslora)
    dropout: float = 0.0           # on the adapters' input
    targets: str = "all-linear"    # Hugging Face module names (q_proj,v_proj / c_attn, ...), or every block linear
    rslora: bool = False           # rank-stabilised scaling (Kalajdzievski 2023)
    quantize: str = "none"         # none | nf4: QLoRA's 4-bit base (parallel/qlora.py, through torchao)

    def adapter_count(self, m: ModelConfig) -> int:
        """Parameters of all the model's adapters (A: rank x in, B: its rows x rank per adapted module)."""
        chosen = lora_targets(m.arch, self.targets)
        inputs = {"attn.out": m.num_heads * m.head_size, "mlp.down": m.ffn_size}
        total = 0
        for path, modules in LORA_MODULES[m.arch].items():
            parts = fused_parts(m, path)
            rows = list(parts) if len(modules) == len(parts) else [sum(parts)]
            total += sum(self.rank * (inputs.get(path, m.hidden_size) + r) for n, r in zip(modules, rows) if n in chosen)
        return m.num_layers * total

    def flops_per_token(self, m: ModelConfig, seq: int) -> int:
        """Training FLOPs per token of LoRA fine-tuning: what is computed, not full training's 6 x N. The
        frozen matmul parameters N (ModelConfig.flops_per_token's: every block linear and the head) cost 2 N
        forward and 2 N in the backward through their inputs, with no weight gradient; the adapters all
        three, 6 x theirs; attention its forward and backward, 12 x layers x heads x head_dim x seq. A
        recomputed forward is not counted (the MFU convention), nor NF4's dequantisation (no matmul)."""
        attention = 12 * m.num_layers * m.num_heads * m.head_size * seq
        matmul = (m.flops_per_token(seq) - attention) // 6
        return 4 * matmul + 6 * self.adapter_count(m) + attention


NF4_BLOCK = 64  # weights per absmax scale in QLoRA's NF4 (the paper's and torchao's)
NF4_BYTES_PER_WEIGHT = 0.5 + 1 / NF4_BLOCK + 4 / (NF4_BLOCK * 256)  # codes, int8 scales, their fp32 scales


def fused_parts(m: ModelConfig, path: str) -> tuple[int, ...]:
    """The full sizes of the fused components of a block linear's output (ColumnParallelLinear's parts)."""
    hd, f, h = m.head_size, m.ffn_size, m.hidden_size
    if path == "attn.qkv":
        return (m.num_heads * hd, m.kv_heads * hd, m.kv_heads * hd)
    if path == "mlp.up":
        return (f, f) if m.arch != "gpt2" else (f,)
    return (h,)


@dataclass
class ParallelConfig:
    """The layout: how the work is split over the ranks. One schema for the runtime and the planner (whose
    `plan.Layout` adds the training options that change memory and time); `check_layout` checks it."""
    dp: int = 1                    # data parallel
    tp: int = 1                    # tensor parallel (Megatron column/row split), innermost in the mesh
    pp: int = 1                    # pipeline stages
    cp: int = 1                    # context parallel (sequence split over ranks)
    cp_comm: str = "a2a"           # a2a: Ulysses' all-to-all of heads (context.py) | p2p: ring attention (ring_attention.py)
    ep: int = 1                    # expert parallel, carved out of dp x cp
    sp: bool = False               # Megatron sequence parallelism (with tp > 1)
    tp_async: bool = False         # collectives fused with their matmuls (async_tp.py): refused on GPUs for now
    zero_stage: int = 0
    offload: str = "none"          # none | optimizer | params
    pp_schedule: str = "1f1b"      # naive | gpipe | 1f1b | interleaved | zb-h1 (schedules.py)
    virtual_stages: int = 1        # model chunks per pipeline rank (interleaved 1F1B)
    pp_layers: str = ""            # layers per pipeline stage, e.g. "10,11,11"; "": balanced by compute
    pp_transfer: str = "auto"      # auto | process_group | copy_engine: how stages pass activations (comm/p2p.py)
    dp_mode: str = "ddp"           # ddp | classic
    bucket_mb: float = 25.0        # gradient bucket size for DDP and ZeRO-1/2 communication
    reduce_dtype: str = "fp32"     # fp32 | compute: the dtype gradients are reduced in
    reduce_algo: str = "auto"      # auto | all_to_all | ring | copy_engine (DDP, ZeRO on GPUs): how gradients are summed (comm/)
    persist_threshold: int = 100000  # ZeRO-3 keeps parameters of at most this many elements whole
    prefetch_units: int = 1        # ZeRO-3 gathers this many blocks ahead of the one running (more: memory for overlap)
    timeout_s: float = 600.0       # process-group timeout: a dead or stalled rank ends the others
    offload_threads: int = 0       # CPU threads for an offloaded step; 0: this rank's share of the cores (less one with a GPU)
    offload_dir: str = ""          # with offload: keep the fp32 masters and moments in files here (NVMe), not in RAM
    delayed_update: bool = False   # ZeRO-Offload's delayed update: each gradient one update stale (changes the math)
    overlap_update: bool = False   # offload at dp 1: the CPU update beside the next forward, which waits block by block (exact)
    offload_activations: bool = False  # with train.recompute full: each block's input kept in host memory

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def replicas(self) -> int:
        """The ranks holding the same parameters, over which gradients are reduced and ZeRO shards: data and
        context parallelism's."""
        return self.dp * self.cp


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    @property
    def grad_accum_steps(self) -> int:
        return self.train.global_batch_size // (self.train.micro_batch_size * self.parallel.dp)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        return dump_toml(self.to_dict())


SECTIONS = ("model", "data", "train", "parallel", "lora")
CONFIG_DIRS = (Path(__file__).resolve().parent / "configs", Path(__file__).resolve().parents[2] / "configs")

CHOICES = {
    "model.arch": ("llama", "gpt2"),
    "data.tokenizer": ("byte",),  # any other value was silently ignored
    "train.lr_schedule": ("cosine", "linear", "constant"),
    "train.precision": ("fp32", "bf16", "fp16"),
    "train.recompute": ("none", "selective", "full"),
    "train.optimizer": ("adamw", "sgd"),
    "train.device": ("auto", "cpu", "cuda"),
    "train.attention": ("auto", "flash", "cudnn", "efficient", "math"),
    "parallel.offload": ("none", "optimizer", "params"),
    "parallel.dp_mode": ("ddp", "classic"),
    "parallel.reduce_dtype": ("fp32", "compute"),
    "parallel.reduce_algo": ("auto", "all_to_all", "ring", "copy_engine"),
    "parallel.pp_transfer": ("auto", "process_group", "copy_engine"),
    "parallel.pp_schedule": SCHEDULES,
    "parallel.cp_comm": ("a2a", "p2p"),
    "lora.quantize": ("none", "nf4"),
}
POSITIVE = ("model.hidden_size", "model.num_layers", "model.num_heads", "model.max_seq_len",
            "train.steps", "train.global_batch_size", "train.micro_batch_size", "train.seq_len",
            "train.log_every", "train.eval_batches", "parallel.dp", "parallel.tp", "parallel.pp", "parallel.cp",
            "parallel.ep", "parallel.virtual_stages", "parallel.prefetch_units", "model.init_std",
            "parallel.timeout_s", "parallel.bucket_mb", "model.norm_eps", "model.rope_theta", "train.keep_checkpoints",
            "lora.alpha", "train.eps")  # alpha 0: no update at all; eps 0: Adam's 0 / 0 where a gradient is 0
NON_NEGATIVE = ("model.vocab_size", "model.num_kv_heads", "model.num_experts", "model.top_k", "model.head_dim", "model.ffn_hidden_size", "model.sliding_window",
                "train.lr", "train.warmup_steps", "train.weight_decay", "train.grad_clip", "train.eval_every",
                "train.save_every", "train.sample_tokens", "train.loss_chunk_tokens", "train.peak_tflops", "data.eval_windows",
                "train.min_lr_ratio", "train.momentum", "train.seed", "parallel.persist_threshold",
                "parallel.offload_threads", "lora.rank")


def preset_names() -> list[str]:
    names = set()
    for d in CONFIG_DIRS:
        if d.is_dir():
            names.update(p.stem for p in d.glob("*.toml"))
    return sorted(names)


def _resolve_source(source: str) -> Path:
    p = Path(source)
    if p.suffix == ".toml" and p.is_file():
        return p
    for d in CONFIG_DIRS:
        if (d / f"{source}.toml").is_file():
            return d / f"{source}.toml"
    raise ConfigError(f"config {source!r} is neither a TOML file nor a preset (presets: {', '.join(preset_names())})")


def _convert(key: str, value: Any, typ: Any) -> Any:
    """Turn a TOML value or a command-line string into the field's type, or fail naming the key."""
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
                return True
            if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if typ is int:
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, str):
                f = float(value)  # accepts 1e5 as well as 100000
                if not f.is_integer():
                    raise ValueError
                return int(f)
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if typ is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if typ is str:
            if not isinstance(value, str):
                raise ValueError
            return value
        if typ is dict:
            if isinstance(value, str):
                import json
                value = json.loads(value)
            if not isinstance(value, dict):
                raise ValueError
            return dict(value)
    except (ValueError, TypeError):
        pass
    raise ConfigError(f"{key} = {value!r} is not a valid {typ.__name__}")


def apply_overrides(cfg: Config, flat: dict[str, Any]) -> None:
    """Set `section.key` values (strings from the command line, or TOML values) on `cfg`, converted to each
    field's type; an unknown key or a value of the wrong type raises ConfigError naming it."""
    for key, value in flat.items():
        section, _, name = key.partition(".")
        if section not in SECTIONS or not name:
            raise ConfigError(f"unknown config key {key!r} (sections: {', '.join(SECTIONS)})")
        obj = getattr(cfg, section)
        hints = get_type_hints(type(obj))
        if name not in hints:
            known = ", ".join(f.name for f in fields(obj))
            raise ConfigError(f"unknown config key {key!r} (known in [{section}]: {known})")
        setattr(obj, name, _convert(key, value, hints[name]))


def _flatten(d: dict, where: str) -> dict[str, Any]:
    flat = {}
    for section, body in d.items():
        if section not in SECTIONS or not isinstance(body, dict):
            raise ConfigError(f"unknown config section [{section}] in {where} (sections: {', '.join(SECTIONS)})")
        for k, v in body.items():
            flat[f"{section}.{k}"] = v
    return flat


def load_config(source: str | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Defaults <- preset or TOML file (`source`; None means the embedded default) <- dotted overrides."""
    cfg = Config()
    path = _resolve_source(source or "default")
    try:
        with open(path, "rb") as f:
            apply_overrides(cfg, _flatten(tomllib.load(f), str(path)))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: {e}") from None
    apply_overrides(cfg, overrides or {})
    return cfg


def config_from_dict(d: dict) -> Config:
    cfg = Config()
    apply_overrides(cfg, _flatten(d, "saved config"))
    return cfg


ROPE_KEYS = {"default": (), "linear": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
UNIT_INTERVAL = ("train.beta1", "train.beta2", "train.momentum", "lora.dropout")  # in [0, 1)


def validate(cfg: Config, world_size: int = 1) -> None:
    """Fail before any work with a message naming the key and the value."""
    def get(key):
        s, n = key.split(".")
        return getattr(getattr(cfg, s), n)

    for section in SECTIONS:  # nan compares false with everything, so the range checks below would pass it
        obj = getattr(cfg, section)
        for f in fields(obj):
            value = getattr(obj, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{section}.{f.name} = {value!r} must be a finite number")
    for key in UNIT_INTERVAL:
        if not 0 <= get(key) < 1:
            raise ConfigError(f"{key} = {get(key)!r} must be in [0, 1)")
    scaling = cfg.model.rope_scaling
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in ROPE_KEYS:
            raise ConfigError(f"model.rope_scaling type {kind!r} is not supported ({', '.join(ROPE_KEYS)})")
        missing = [k for k in ROPE_KEYS[kind] if k not in scaling]
        if missing:
            raise ConfigError(f"model.rope_scaling of type {kind!r} lacks {', '.join(missing)} (it has "
                              f"{', '.join(sorted(scaling)) or 'nothing'})")

    for key, allowed in CHOICES.items():
        if get(key) not in allowed:
            raise ConfigError(f"{key} = {get(key)!r} is not one of {', '.join(allowed)}")
    for key in POSITIVE:
        if not get(key) > 0:
            raise ConfigError(f"{key} = {get(key)!r} must be positive")
    for key in NON_NEGATIVE:
        if get(key) < 0:
            raise ConfigError(f"{key} = {get(key)!r} must not be negative")
    m, t, p = cfg.model, cfg.train, cfg.parallel
    if m.head_dim == 0 and m.hidden_size % m.num_heads:
        raise ConfigError(f"model.hidden_size = {m.hidden_size} is not divisible by model.num_heads = {m.num_heads}")
    if m.num_heads % m.kv_heads:
        raise ConfigError(f"model.num_heads = {m.num_heads} is not divisible by model.num_kv_heads = {m.num_kv_heads}")
    if m.arch == "gpt2" and (m.num_kv_heads not in (0, m.num_heads) or m.qkv_bias or m.rope_scaling or m.sliding_window):
        raise ConfigError("model.arch = 'gpt2' has no grouped-query attention, separate qkv_bias, rope_scaling or "
                          "sliding_window")
    if m.arch == "llama" and m.head_size % 2:
        raise ConfigError(f"model head size {m.head_size} must be even for rotary embeddings")
    if t.seq_len > m.max_seq_len:
        raise ConfigError(f"train.seq_len = {t.seq_len} exceeds model.max_seq_len = {m.max_seq_len}")
    # The sample after training may run to max_seq_len: past the window too.
    longest = max(t.seq_len, m.max_seq_len if t.sample_tokens else 0)
    if m.sliding_window and longest > m.sliding_window and t.attention == "flash":
        raise ConfigError(f"train.attention = 'flash' takes no attention mask, which model.sliding_window = "
                          f"{m.sliding_window} below {'train.seq_len' if longest == t.seq_len else 'model.max_seq_len (the sample)'} "
                          f"= {longest} needs (use auto, efficient or math)")
    if m.num_experts:
        raise ConfigError(f"model.num_experts = {m.num_experts} is not supported yet by the runtime "
                          "(mixture-of-experts is on the roadmap; `shardlm plan` models it)")
    if cfg.lora.rank:
        lora_targets(m.arch, cfg.lora.targets)
    elif cfg.lora.quantize != "none":
        raise ConfigError(f"lora.quantize = {cfg.lora.quantize!r} quantizes a frozen base under adapters: set lora.rank")
    if t.min_lr_ratio > 1:
        raise ConfigError(f"train.min_lr_ratio = {t.min_lr_ratio} must be at most 1")
    if p.tp_async and not (p.sp and t.compile):
        raise ConfigError("parallel.tp_async = True fuses the sequence-parallel collectives with their matmuls when the "
                          f"blocks compile: it needs parallel.sp = True and train.compile = True (they are {p.sp} and "
                          f"{t.compile})")
    if p.tp_async and t.device == "cpu":
        raise ConfigError("parallel.tp_async = True needs CUDA GPUs (train.device is 'cpu'): the fused kernels move "
                          "chunks through symmetric memory")
    if p.tp_async and p.pp > 1:
        raise ConfigError("parallel.tp_async = True is not yet validated with pipeline stages (parallel.pp = "
                          f"{p.pp}): both take symmetric memory, whose rendezvous must come in the same order on "
                          "every rank; use parallel.pp = 1 or parallel.tp_async = False")
    if p.offload_activations and t.recompute != "full":
        raise ConfigError("parallel.offload_activations = True offloads what full recomputation keeps of a block (its "
                          f"input): it needs train.recompute = 'full' (it is {t.recompute!r})")
    if p.delayed_update and t.precision == "fp16":
        raise ConfigError("parallel.delayed_update = True with train.precision = 'fp16': a step skipped for an "
                          "overflow is only known once the update that was to overlap has run; use bf16")
    if p.tp_async and p.cp > 1:
        raise ConfigError(f"parallel.tp_async = True is not yet validated with context parallelism (parallel.cp = "
                          f"{p.cp}): use parallel.cp = 1 or parallel.tp_async = False")
    # Strategies that are validated but not built yet are refused, never silently ignored.
    if p.ep != 1:
        raise ConfigError(f"parallel.ep = {p.ep!r} is not supported yet by this version of shardlm (only 1); the "
                          "strategy is on the roadmap")
    check_layout(m, p, t.seq_len, t.micro_batch_size, t.global_batch_size, world_size)


# Ring attention's queries a pass over a chunk of keys (parallel/ring_attention.py): their fp32 scores, and a few
# tensors of that size, are what it holds beyond the chunks (the planner counts them).
RING_QUERY_ROWS = 1024


def exchanged_kv_heads(q: int, kv: int, cp: int) -> int:
    """The key/value heads a rank's attention holds before context parallelism's exchange, of `kv` for `q` query
    heads: as they are where cp divides them; else each repeated r = cp / gcd(kv, cp) times where a query
    group's heads divide by r (key/value head j // r still serves the same queries), else once per query head."""
    if kv % cp == 0:
        return kv
    r = cp // math.gcd(kv, cp)
    return kv * r if (q // kv) % r == 0 else q


# The Hugging Face modules (their names below the layer) a block's linears fuse, for `lora.targets`.
LORA_MODULES = {
    "llama": {"attn.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "attn.out": ("self_attn.o_proj",),
              "mlp.up": ("mlp.gate_proj", "mlp.up_proj"), "mlp.down": ("mlp.down_proj",)},
    "gpt2": {"attn.qkv": ("attn.c_attn",), "attn.out": ("attn.c_proj",), "mlp.up": ("mlp.c_fc",),
             "mlp.down": ("mlp.c_proj",)},
}


def lora_targets(arch: str, targets: str) -> set[str]:
    """The module names (LORA_MODULES') that `lora.targets` selects: each comma-separated name matches a
    module whose name it is or ends with (PEFT's rule: c_proj is both of GPT-2's), "all-linear" every one."""
    known = [n for names in LORA_MODULES[arch].values() for n in names]
    wanted = [t.strip() for t in targets.split(",") if t.strip()]
    if wanted == ["all-linear"]:
        return set(known)
    chosen = set()
    for t in wanted:
        hits = {n for n in known if n == t or n.endswith("." + t)}
        if not hits:
            raise ConfigError(f"lora.targets names {t!r}, which is no {arch} module (modules: "
                              f"{', '.join(n.rsplit('.', 1)[1] for n in known)}, or all-linear)")
        chosen |= hits
    if not chosen:
        raise ConfigError("lora.targets is empty: name the modules to adapt, or all-linear")
    return chosen


# ---- the one check of a layout, shared by the runtime (`validate`) and the planner (plan/layout.py) ------

@dataclass(frozen=True)
class Naming:
    """How a layout check names what it refuses: by config key (`parallel.tp = 3`), or by the planner's
    flags (`--tp 3`)."""
    flags: bool = False
    CONFIG_KEYS = {"global_batch": "train.global_batch_size", "micro_batch": "train.micro_batch_size",
                   "seq": "train.seq_len"}
    FLAGS = {"zero_stage": "zero"}

    def key(self, name: str) -> str:
        if self.flags:
            return "--" + self.FLAGS.get(name, name).replace("_", "-")
        return self.CONFIG_KEYS.get(name, f"parallel.{name}")

    def show(self, name: str, value) -> str:
        if self.flags:
            return self.key(name) if value is True else f"{self.key(name)} {value}"
        return f"{self.key(name)} = {value!r}"


def check_layout(m: ModelConfig, p: ParallelConfig, seq: int, micro_batch: int, global_batch: int,
                 world: int | None = None, naming: Naming = Naming()) -> None:
    """A layout against the model, the batch and (when given) the world size; raises ConfigError naming the
    values. Every rank runs it before any collective, and the planner before it estimates."""
    key, show = naming.key, naming.show
    for name in ("dp", "tp", "pp", "cp", "ep", "virtual_stages"):
        if getattr(p, name) < 1:
            raise ConfigError(f"{show(name, getattr(p, name))} must be at least 1")
    if p.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"{show('zero_stage', p.zero_stage)} is not one of 0, 1, 2, 3")
    for name, allowed in (("offload", ("none", "optimizer", "params")), ("pp_schedule", CHOICES["parallel.pp_schedule"]),
                          ("cp_comm", CHOICES["parallel.cp_comm"])):
        if getattr(p, name) not in allowed:
            raise ConfigError(f"{show(name, getattr(p, name))} is not one of {', '.join(allowed)}")
    if world is not None and p.world != world:
        axes = [a for a in ("dp", "tp", "pp", "cp") if a != "cp" or p.cp != 1]
        got = " x ".join(f"{key(a)} ({getattr(p, a)})" for a in axes)
        hint = ("" if naming.flags or world != 1 else
                f": start {p.world} processes, e.g. `torchrun --nproc-per-node {p.world} -m shardlm train ...`, "
                "or set the layout for one (--parallel.dp 1 --parallel.tp 1; checkpoints resume under any layout)")
        raise ConfigError(f"{got} = {p.world} != {'--gpus' if naming.flags else 'world size'} {world}{hint}")
    if m.num_heads % p.tp:
        raise ConfigError(f"{show('tp', p.tp)} does not divide the {m.num_heads} attention heads")
    if m.ffn_size % p.tp:
        raise ConfigError(f"{show('tp', p.tp)} does not divide the MLP's {m.ffn_size} hidden features")
    if p.cp_comm == "a2a" and (m.num_heads // p.tp) % p.cp:
        raise ConfigError(f"{show('cp', p.cp)} must divide the {m.num_heads // p.tp} attention heads each tensor-parallel "
                          f"rank holds: Ulysses' context parallelism splits them over its ranks around attention "
                          f"(ring attention, {show('cp_comm', 'p2p')}, does not)")
    if seq % p.cp:
        raise ConfigError(f"{show('seq', seq)} must divide by {show('cp', p.cp)}")
    if p.sp and p.tp == 1:
        raise ConfigError(f"{show('sp', True)} (sequence parallelism) needs {key('tp')} > 1")
    if p.sp and seq % (p.tp * p.cp):
        cp = f" x {key('cp')} ({p.cp})" if p.cp > 1 else ""
        raise ConfigError(f"{show('seq', seq)} must divide by {show('tp', p.tp)}{cp} for sequence parallelism")
    if p.pp > m.num_layers:
        raise ConfigError(f"{show('pp', p.pp)} exceeds the model's {m.num_layers} layers")
    stages = p.pp * p.virtual_stages
    if stages > m.num_layers:
        raise ConfigError(f"{show('pp', p.pp)} x {show('virtual_stages', p.virtual_stages)} = {stages} stages exceed "
                          f"the model's {m.num_layers} layers")
    if p.pp_layers:
        try:
            counts = [int(c) for c in p.pp_layers.split(",")]
        except ValueError:
            counts = []
        if len(counts) != stages or min(counts, default=0) < 1 or sum(counts) != m.num_layers:
            raise ConfigError(f"{show('pp_layers', p.pp_layers)} must give {stages} positive layer counts, one per "
                              f"stage, summing to the model's {m.num_layers} layers")
    if p.virtual_stages > 1 and p.pp_schedule != "interleaved":
        raise ConfigError(f"{show('virtual_stages', p.virtual_stages)} needs {show('pp_schedule', 'interleaved')}")
    if p.pp > 1:
        try:
            check_schedule(p.pp_schedule, p.pp, p.virtual_stages, global_batch // (micro_batch * p.dp))
        except ScheduleError as e:
            raise ConfigError(str(e)) from None
    if p.zero_stage >= 2 and p.pp > 1:
        raise ConfigError(f"{show('zero_stage', p.zero_stage)} with {show('pp', p.pp)} is not supported: ZeRO-2 would "
                          "reduce-scatter every micro-batch's gradients (m times ZeRO-1's traffic) and ZeRO-3 gather "
                          f"the parameters for every micro-batch of every stage; use {show('zero_stage', 1)}")
    if p.offload != "none" and p.zero_stage < 1:
        raise ConfigError(f"{show('offload', p.offload)} needs {key('zero_stage')} >= 1 (it is {p.zero_stage})")
    if p.offload_dir and p.offload == "none":
        raise ConfigError(f"{show('offload_dir', p.offload_dir)} needs {key('offload')} optimizer or params")
    if p.delayed_update and not (p.zero_stage == 2 and p.offload == "optimizer" and not p.offload_dir):
        raise ConfigError(f"{show('delayed_update', True)} is ZeRO-Offload's: it needs {show('zero_stage', 2)} with "
                          f"{show('offload', 'optimizer')} (and no {key('offload_dir')})")
    if p.overlap_update and not (p.zero_stage in (1, 2) and p.offload == "optimizer" and not p.offload_dir
                                 and not p.delayed_update and p.dp * p.cp == 1 and p.pp == 1):
        raise ConfigError(f"{show('overlap_update', True)} runs one rank's offloaded update beside the next forward: it "
                          f"needs {key('zero_stage')} 1 or 2 with {show('offload', 'optimizer')}, {key('dp')} = "
                          f"{key('cp')} = 1 (with more replicas the updated shards' all-gathers overlap forward already), "
                          f"{key('pp')} = 1 (a "
                          f"pipeline's schedule waits for all of it), no {key('offload_dir')} and no "
                          f"{key('delayed_update')}")
    if p.delayed_update and (p.tp > 1 or p.pp > 1):
        raise ConfigError(f"{show('delayed_update', True)} runs the update beside the next step, which tensor and "
                          f"pipeline parallelism would need collectives in; it needs {key('tp')} = {key('pp')} = 1")
    if p.offload == "params" and p.zero_stage < 3:
        raise ConfigError(f"{show('offload', p.offload)} needs {show('zero_stage', 3)} (it is {p.zero_stage})")
    if p.dp_mode == "classic" and p.zero_stage:
        raise ConfigError(f"{show('dp_mode', 'classic')} keeps everything on one rank; it cannot be combined "
                          f"with {show('zero_stage', p.zero_stage)}")
    if p.reduce_algo == "copy_engine" and p.dp_mode == "classic":
        raise ConfigError(f"{show('reduce_algo', 'copy_engine')} is implemented for DDP and ZeRO, not for "
                          f"{show('dp_mode', 'classic')}")
    if p.ep > 1 and not m.num_experts:
        raise ConfigError(f"{show('ep', p.ep)} needs a mixture-of-experts model (model.num_experts)")
    if m.num_experts and (m.num_experts % p.ep or (p.dp * p.cp) % p.ep):
        raise ConfigError(f"{show('ep', p.ep)} must divide the {m.num_experts} experts and {key('dp')} x {key('cp')} "
                          f"({p.dp * p.cp}): expert parallelism is carved out of data and context parallelism")
    if m.num_experts and not 1 <= m.top_k <= m.num_experts:
        raise ConfigError(f"model.top_k = {m.top_k} must be between 1 and the {m.num_experts} experts")
    if min(seq, micro_batch, global_batch) < 1:
        raise ConfigError(f"{key('seq')}, {key('micro_batch')} and {key('global_batch')} must be positive")
    if global_batch % (micro_batch * p.dp):
        raise ConfigError(f"{show('global_batch', global_batch)} is not divisible by {key('micro_batch')} "
                          f"({micro_batch}) x {key('dp')} ({p.dp})")


def parse_overrides(args: list[str]) -> dict[str, str]:
    """`--section.key value` and `--section.key=value` pairs into a flat dict."""
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        a = args[i]
        if not a.startswith("--") or "." not in a.split("=", 1)[0]:
            raise ConfigError(f"unexpected argument {a!r}: overrides look like --section.key value")
        key = a[2:]
        if "=" in key:
            key, value = key.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"{key} is missing a value")
            value = args[i + 1]
            i += 2
        out[key] = value
    return out


def dump_toml(d: dict) -> str:
    """A minimal TOML writer for our flat two-level config (tomllib only reads)."""
    def val(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k} = {val(x)}" for k, x in v.items()) + "}"
        raise TypeError(f"cannot write {type(v).__name__} to TOML")

    lines = []
    for section, body in d.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {val(v)}" for k, v in body.items()]
        lines.append("")
    return "\n".join(lines)
