"""The schema: a run's configuration as typed sections (model, data, train, parallel, lora), each a
dataclass whose fields are the keys and whose defaults are the defaults. The layout follows torchtitan's job
config (dataclasses + TOML + `--section.key value` flags); load.py reads it, checks.py refuses what cannot
run, and the shape arithmetic the planner shares comes from shapes.py's mixins.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from .shapes import LoRAShapes, ModelShapes


# A target that is not trained on (F.cross_entropy's ignore_index): a prompt token or padding of
# instruction data (data/instruct.py); the losses (model/loss.py, parallel/cross_entropy.py) skip it.
IGNORE = -100


@dataclass
class ModelConfig(ModelShapes):
    """The decoder's architecture; its derived sizes and its parameter, FLOP and KV-cache counts are
    ModelShapes' (shapes.py)."""
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
    num_experts: int = 0           # a sparse mixture-of-experts MLP (model/moe.py) with this many experts; 0: dense
    top_k: int = 2                 # experts each token is routed to
    moe_ffn_hidden_size: int = 0   # each routed expert's hidden features; 0 means ffn_hidden_size's
    shared_expert_ffn_hidden_size: int = 0  # Qwen2-MoE's always-on expert behind a sigmoid gate; 0: none
    moe_every: int = 1             # layer i is MoE where i >= moe_first_dense and (i + 1) % moe_every == 0 (Qwen2-MoE's rule)
    moe_first_dense: int = 0       # the first layers keep the dense MLP (DeepSeek's first_k_dense_replace)
    router_scoring: str = "softmax"  # softmax (Mixtral, Qwen2-MoE) | sigmoid (DeepSeek-V3)
    router_renormalize: bool = True  # the top-k scores divided by their sum (Mixtral; Qwen2-MoE's norm_topk_prob)
    capacity_factor: float = 0.0   # Switch/GShard capacity per expert per sequence, ceil(f x seq x top_k / experts); 0: dropless
    router_bias_update_rate: float = 0.0  # DeepSeek-V3's auxiliary-loss-free balance: the selection bias's step; 0: off
    init_std: float = 0.02


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
    # fp32 | bf16: the optimizer's master weights and moments (bf16: HF's pure-bf16 training, each update rounded
    # to bf16, the parameters their own masters where the optimizer is not sharded; needs precision bf16)
    optimizer_dtype: str = "fp32"
    # one process: the gradients' memory given back after each step and taken again bucket by bucket as backward
    # reaches them (torch's zero_grad(set_to_none=True)); false keeps one buffer for the run (one optimizer launch)
    free_grads: bool = True
    # none | selective (attention core) | full (each block from its input) | full-skip-down (full, but the
    # recomputed forward skips the MLP's down projection: no more memory) | full-skip-out-down (also the
    # attention's output projection, keeping each block's mid-residual): model/recompute.py
    recompute: str = "none"
    compile: bool = False          # torch.compile each block
    loss_chunk_tokens: int = 2048  # fused head + cross-entropy over chunks of this many tokens; 0: plain
    attention: str = "auto"        # SDPA backend: auto | flash | cudnn | efficient | math
    device: str = "auto"           # auto | cpu | cuda
    log_every: int = 10
    gc_every: int = 50             # steps between Python's garbage collections, every rank at once; 0: Python's own
    eval_every: int = 0            # 0 disables periodic eval
    eval_batches: int = 4          # eval scores the first eval_batches x micro_batch_size held-out windows
    save_every: int = 0            # 0 saves only at the end
    keep_checkpoints: int = 2
    checkpoint_format: str = "sharded"  # sharded: every rank writes what it owns | full: gathered onto rank 0
    checkpoint_buffer_mb: int = 256  # a sharded save's staging per rank: files of half, one written while one is staged
    checkpoint_async: bool = False  # sharded saves written by a thread while training goes on (a shard-sized host copy)
    peak_tflops: float = 0.0       # 0 looks the device up; used for MFU
    sample_tokens: int = 0         # print a sample of this many tokens after training
    sample_prompt: str = ""
    tensorboard: bool = True
    init_from: str = ""            # an HF checkpoint directory: its config.json the model section, its weights the start
    freeze: str = ""               # module patterns held fixed, e.g. "experts,router", "embed", "layers.0" (parallel/freeze.py)
    moe_aux_loss_coef: float = 0.01  # Switch's load-balancing loss per MoE layer (1 at a balanced load), times this
    moe_z_loss_coef: float = 0.0   # ST-MoE's router z-loss (mean squared logsumexp of the router logits), times this


@dataclass
class LoRAConfig(LoRAShapes):
    """Low-rank adapters (parallel/lora.py): the base weights frozen, rank-`rank` A and B trained."""
    rank: int = 0                  # 0: off, every weight trained
    alpha: float = 16.0            # the update is scaled by alpha / rank (alpha / sqrt(rank) with rslora)
    dropout: float = 0.0           # on the adapters' input
    targets: str = "all-linear"    # Hugging Face module names (q_proj,v_proj / c_attn, ...), or every block linear
    rslora: bool = False           # rank-stabilised scaling (Kalajdzievski 2023)
    quantize: str = "none"         # none | nf4: QLoRA's 4-bit base (parallel/qlora.py, through torchao)


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
    ep_dispatch: str = "auto"      # auto | padded | exact: how rows reach the experts' ranks (parallel/expert.py)
    # the most rows a rank's experts take in one pass of the exact dispatch, in balanced loads (its own token copies);
    # past it they run in checkpointed chunks of that many (parallel/expert_chunks.py); 0: one pass, however many
    ep_load_budget: float = 2.0
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

    def ep_padded(self, dropless: bool = True) -> bool:
        """Whether expert parallelism sends its rows in fixed-size blocks (parallel/expert.py): asked for, or
        "auto" at ep 2; dropless routing only (`dropless`: model.capacity_factor is 0, or not training)."""
        return self.ep > 1 and dropless and (self.ep_dispatch == "padded" or (self.ep_dispatch == "auto" and self.ep == 2))

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


_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\t": "\t"}


# Writing lives beside the schema, for Config.to_toml; reading, which converts and checks types, is load.py's.
def dump_toml(d: dict) -> str:
    """A minimal TOML writer for our flat two-level config (tomllib only reads)."""
    def val(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):  # TOML's basic strings take no control character but tab: \r, ESC, DEL escaped
            return '"' + "".join(_ESCAPES.get(c, f"\\u{ord(c):04x}" if c < " " or c == "\x7f" else c)
                                 for c in v) + '"'
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(val(x) for x in v) + "]"
        if isinstance(v, dict):  # TOML has no null: a key set to None (an HF config.json's "unset") is left out,
            # as loading leaves it out of the config too
            return "{" + ", ".join(f"{key(k)} = {val(x)}" for k, x in v.items() if x is not None) + "}"
        raise TypeError(f"cannot write {type(v).__name__} to TOML")

    def key(k):  # bare where TOML allows, else quoted ("a b", "x.y" read back as one key)
        return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else val(str(k))

    lines = []
    for section, body in d.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {val(v)}" for k, v in body.items()]
        lines.append("")
    return "\n".join(lines)

