"""Shape arithmetic: what a model's configuration implies, for the runtime and the planner alike (one source
of truth for parameter counts). `ModelShapes` and `LoRAShapes` are mixed into the dataclasses of schema.py
and read their fields: derived sizes, parameters by group, FLOPs per token (the 6 N + attention count of
torchtitan's and Megatron's MFU), a KV cache's bytes per position; and the block linears LoRA can adapt,
by their Hugging Face names. No torch.
"""
from __future__ import annotations

import math

from .errors import ConfigError


class ModelShapes:
    """ModelConfig's derived shapes. Everything that counts parameters or FLOPs goes through these."""

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

    @property
    def moe_ffn_size(self) -> int:
        """A routed expert's hidden features."""
        return self.moe_ffn_hidden_size or self.ffn_size

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i's MLP is a mixture of experts: after the dense first layers, every moe_every-th."""
        return bool(self.num_experts) and i >= self.moe_first_dense and (i + 1) % self.moe_every == 0

    def moe_layers(self) -> int:
        """How many layers are mixtures of experts (is_moe_layer's, counted without visiting each layer: the
        planner asks thousands of times a search)."""
        if not self.num_experts or self.num_layers <= self.moe_first_dense:
            return 0
        return (self.num_layers // self.moe_every) - (self.moe_first_dense // self.moe_every)

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
        dense = qkv + attn_out + norms + mlp
        # A MoE layer: the router, the shared expert and its gate (Qwen2-MoE) and num_experts SwiGLU experts, of
        # which a token runs top_k.
        n_moe = self.moe_layers()
        routed, shared = 3 * h * self.moe_ffn_size, self.shared_expert_ffn_hidden_size
        moe_fixed = qkv + attn_out + norms + h * self.num_experts + (3 * h * shared + h if shared else 0)
        experts = n_moe * self.num_experts * routed
        layers = (self.num_layers - n_moe) * dense + n_moe * moe_fixed + experts
        active = layers - n_moe * (self.num_experts - min(self.num_experts, self.top_k)) * routed
        embed = v * h
        pos = self.max_seq_len * h if self.arch == "gpt2" else 0
        final_norm = 2 * h if self.arch == "gpt2" else h
        head = 0 if self.tie_embeddings else v * h

        def per_layer(total):  # exact where every layer is alike; the mean where dense and MoE layers mix
            return total // self.num_layers if total % self.num_layers == 0 else total / self.num_layers
        return {"embedding": embed, "position": pos, "layers": layers,
                "per_layer": per_layer(layers), "final_norm": final_norm, "lm_head": head,
                # what one token's forward multiplies by: top_k of the experts
                "active_layers": active, "active_per_layer": per_layer(active),
                "expert_per_layer": per_layer(experts)}

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's name and shape as the runtime's Decoder allocates them, in its order, without torch:
        what the planner matches train.freeze's patterns against (a test holds the two equal)."""
        h, q, kv, f, v = self.hidden_size, self.num_heads * self.head_size, self.kv_heads * self.head_size, self.ffn_size, self.vocab_size
        gpt2, out = self.arch == "gpt2", {"embed.weight": (v, h)}
        if gpt2:
            out["pos_embed.weight"] = (self.max_seq_len, h)

        def linear(name, outs, ins, bias=self.has_bias):
            out[f"{name}.weight"] = (outs, ins)
            if bias:
                out[f"{name}.bias"] = (outs,)

        def norm(name):  # LayerNorm's bias in GPT-2, RMSNorm's weight alone in the Llama family
            out[f"{name}.weight"] = (h,)
            if gpt2:
                out[f"{name}.bias"] = (h,)
        for i in range(self.num_layers):
            p = f"layers.{i}"
            norm(f"{p}.attn_norm")
            linear(f"{p}.attn.qkv", q + 2 * kv, h, self.has_bias or self.qkv_bias)
            linear(f"{p}.attn.out", h, q)
            norm(f"{p}.mlp_norm")
            if self.is_moe_layer(i):
                e, fe, shared = self.num_experts, self.moe_ffn_size, self.shared_expert_ffn_hidden_size
                out[f"{p}.mlp.router.weight"] = (e, h)
                out[f"{p}.mlp.experts.up.weight"] = (e, 2 * fe, h)
                out[f"{p}.mlp.experts.down.weight"] = (e, h, fe)
                if shared:
                    linear(f"{p}.mlp.shared.up", 2 * shared, h, False)
                    linear(f"{p}.mlp.shared.down", h, shared, False)
                    linear(f"{p}.mlp.shared_gate", 1, h, False)
            else:
                linear(f"{p}.mlp.up", f if gpt2 else 2 * f, h)
                linear(f"{p}.mlp.down", h, f)
        norm("norm")
        if not self.tie_embeddings:
            out["lm_head.weight"] = (v, h)
        return out

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
        matmul = c["active_layers"] + c["final_norm"] + self.vocab_size * self.hidden_size
        return 6 * matmul + 12 * self.num_layers * self.num_heads * self.head_size * seq_len


class LoRAShapes:
    """LoRAConfig's arithmetic: its adapters' parameters and the FLOPs of fine-tuning with them, for a model `m`
    (a ModelConfig, annotated by the mixin that gives it its shapes: schema.py imports this module)."""

    def adapter_count(self, m: ModelShapes) -> int:
        """Parameters of all the model's adapters (A: rank x in, B: its rows x rank per adapted module)."""
        chosen = lora_targets(m.arch, self.targets)
        inputs = {"attn.out": m.num_heads * m.head_size, "mlp.down": m.ffn_size}
        per_path = {}
        for path, modules in LORA_MODULES[m.arch].items():
            parts = fused_parts(m, path)
            rows = list(parts) if len(modules) == len(parts) else [sum(parts)]
            per_path[path] = sum(self.rank * (inputs.get(path, m.hidden_size) + r)
                                 for n, r in zip(modules, rows) if n in chosen)
        return sum(per_path[path] for layer in range(m.num_layers) for path in block_linears(m, layer))

    def flops_per_token(self, m: ModelShapes, seq: int) -> int:
        """Training FLOPs per token of LoRA fine-tuning: what is computed, not full training's 6 x N. The
        frozen matmul parameters N (ModelConfig.flops_per_token's: every block linear and the head) cost 2 N
        forward and 2 N in the backward through their inputs, with no weight gradient; the adapters all
        three, 6 x theirs; attention its forward and backward, 12 x layers x heads x head_dim x seq. A
        recomputed forward is not counted (the MFU convention), nor NF4's dequantisation (no matmul)."""
        attention = 12 * m.num_layers * m.num_heads * m.head_size * seq
        matmul = (m.flops_per_token(seq) - attention) // 6
        return 4 * matmul + 6 * self.adapter_count(m) + attention


# Buckets of gradients taken and given back by one process (train.free_grads): about a block of a 1B model, so
# that backward holds little more than the blocks it has reached while the update stays a few launches a step.
FREE_GRAD_BUCKET_MB = 128

NF4_BLOCK = 64  # weights per absmax scale in QLoRA's NF4 (the paper's and torchao's)
NF4_BYTES_PER_WEIGHT = 0.5 + 1 / NF4_BLOCK + 4 / (NF4_BLOCK * 256)  # codes, int8 scales, their fp32 scales


def fused_parts(m: ModelShapes, path: str) -> tuple[int, ...]:
    """The full sizes of the fused components of a block linear's output (ColumnParallelLinear's parts)."""
    hd, f, h = m.head_size, m.ffn_size, m.hidden_size
    if path == "attn.qkv":
        return (m.num_heads * hd, m.kv_heads * hd, m.kv_heads * hd)
    if path == "mlp.up":
        return (f, f) if m.arch != "gpt2" else (f,)
    return (h,)


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

# The Hugging Face names of a mixture of experts' own linears (Mixtral's experts w1, w2, w3 and its router gate;
# Qwen2-MoE's experts, shared expert and its gate), which PEFT configs for those models list and which take no
# adapters here yet.
MOE_LORA_NAMES = {"w1", "w2", "w3", "gate", "experts", "block_sparse_moe", "shared_expert", "shared_expert_gate"}


def block_linears(m, layer: int) -> list[str]:
    """The paths of LORA_MODULES that block `layer` has (`m` a ModelConfig): a mixture-of-experts layer's MLP
    is its router and experts, which take no adapters (attention's linears do)."""
    return [p for p in LORA_MODULES[m.arch] if not (p.startswith("mlp.") and m.is_moe_layer(layer))]


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
            # all-linear among other names, or spelt all_linear: the list of names ended "or all-linear", as if
            # that were what was missing.
            alone = t.lower().replace("_", "-") in ("all-linear", "all")
            raise ConfigError(f"lora.targets names {t!r}, which is no {arch} module (modules: "
                              f"{', '.join(n.rsplit('.', 1)[1] for n in known)}, or all-linear)"
                              + ("; every module is lora.targets = 'all-linear', alone" if alone else ""))
        chosen |= hits
    if not chosen:
        raise ConfigError("lora.targets is empty: name the modules to adapt, or all-linear")
    return chosen
