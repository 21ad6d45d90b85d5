"""One decoder-only transformer for GPT-2 (Radford et al. 2019) and the Llama family (Touvron et al. 2023;
Qwen2 and Mistral are Llama with qkv biases or a sliding window), written for one device: parallel
strategies transform it (parallel/), replacing its linears and embeddings by sharded ones. The layout
follows nanoGPT's one-screen model; the numerics follow Hugging Face transformers' implementations, which
the tests compare against.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import IGNORE, ModelConfig
from . import gemv
from .activation_offload import ActivationOffload
from .attention import SDPA, WHOLE, WholeSequence
from .kv_cache import KVCache
from .loss import linear_cross_entropy, trained_count
from .meta_init import Embedding
from .moe import MoE
from .recompute import run_block, set_block_recompute
from .rope import rope_inv_freq, rotate_half
from .weight_grad import Linear


def scaled_std(std: float, num_layers: int) -> float:
    """GPT-2's init for projections that write into the residual stream: std / sqrt(2 L)."""
    return std / math.sqrt(2 * num_layers)


def linear(in_features: int, out_features: int, bias: bool, init_std: float) -> Linear:
    """A linear layer that carries its initialisation's standard deviation (read by init_parameter)."""
    layer = Linear(in_features, out_features, bias=bias)
    layer.init_std = init_std
    return layer


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        # The heads this module computes: all of them here; a tensor-parallel rank's share once sharded.
        self.n_heads, self.n_kv = cfg.num_heads, cfg.kv_heads
        self.head_dim = cfg.head_size
        # q, k and v in one matmul (rows [q; k; v]).
        self.qkv = linear(cfg.hidden_size, (cfg.num_heads + 2 * cfg.kv_heads) * self.head_dim,
                          cfg.has_bias or cfg.qkv_bias, cfg.init_std)
        self.out = linear(cfg.num_heads * self.head_dim, cfg.hidden_size, cfg.has_bias,
                          scaled_std(cfg.init_std, cfg.num_layers))
        self.core = SDPA()  # softmax(q k^T / sqrt(d) + mask) v: replaced by context parallelism's (attention.py)

    def project(self, x, rope=None):
        """q, k and v of x ([b, heads, t, head_dim]), rotated by `rope` (cos, sin) where given."""
        qkv = self.qkv(x)
        b, t = qkv.shape[:2]  # the whole sequence, also where x holds a slice of it (sequence parallelism)
        q, k, v = qkv.split([self.n_heads * self.head_dim, self.n_kv * self.head_dim, self.n_kv * self.head_dim],
                            dim=-1)
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        # A copy of v, not a view into qkv: attention saves v for its backward, and a view would keep all of
        # qkv alive beside the rotated q and k it also saves.
        v = v.contiguous()
        if rope is not None:
            cos, sin = rope
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
        return q, k, v

    def forward(self, x, rope=None, cache: KVCache | None = None, mask=None):
        """`mask`: the sliding window's boolean mask (Decoder.window_mask); None: causal attention."""
        q, k, v = self.project(x, rope)
        b, t = q.shape[0], q.shape[2]
        causal, core = mask is None, self.core
        if cache is not None:
            core = self.core.local  # the cache holds whole sequences, on every rank alike
            past = cache.pos
            k, v = cache.update(self.layer, k, v)
            if past and mask is None:  # new queries see every cached key plus the causal part of their own block
                causal = False
                if t > 1:
                    mask = torch.ones(t, k.shape[2], dtype=torch.bool, device=x.device).tril(diagonal=past)
        y = core(q, k, v, causal, mask)
        return self.out(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gated = cfg.arch != "gpt2"
        f = cfg.ffn_size
        # SwiGLU (Shazeer 2020) fuses gate and up into one matmul (rows [gate; up]).
        self.up = linear(cfg.hidden_size, 2 * f if self.gated else f, cfg.has_bias, cfg.init_std)
        self.down = linear(f, cfg.hidden_size, cfg.has_bias, scaled_std(cfg.init_std, cfg.num_layers))

    def forward(self, x):
        h = self.up(x)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")  # GPT-2's gelu_new
        return self.down(h)


class RMSNorm(nn.Module):
    """Zhang & Sennrich 2019; computed in fp32 and cast back, as HF Llama does."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class LMOutput(nn.Module):
    """The output head and the loss: logits h W^T, or the mean next-token cross-entropy in fp32, by default
    through the fused chunked kernel (loss.py) that never forms all logits. It holds no parameters (the
    head's weight, lm_head's or the tied embedding's, is passed in): tensor parallelism replaces it by its
    vocab-parallel version."""

    def forward(self, h, weight, targets=None, chunk: int = 2048, compiled: bool = False):
        if targets is None:
            return gemv.linear(h, weight)
        if not chunk:
            logits = F.linear(h, weight)
            return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1),
                                   reduction="sum", ignore_index=IGNORE) / trained_count(targets)
        return linear_cross_entropy(h, weight, targets, chunk, compiled)


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.arch == "gpt2":
        return nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
    return RMSNorm(cfg.hidden_size, cfg.norm_eps)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg, layer)
        self.mlp_norm = make_norm(cfg)
        self.mlp = MoE(cfg, layer) if cfg.is_moe_layer(layer) else MLP(cfg)  # dense, or experts (moe.py)

    def forward(self, x, rope=None, cache=None, mask=None):
        return self.mlp_half(self.attn_half(x, rope, cache, mask))

    def attn_half(self, x, rope=None, cache=None, mask=None):
        return x + self.attn(self.attn_norm(x), rope, cache, mask)

    def mlp_half(self, x):
        return x + self.mlp(self.mlp_norm(x))

    def compile_in_halves(self, **options) -> None:
        """Compile attention and MLP as two graphs instead of one. A compiled graph hands autograd all of
        its parameters' gradients together when its backward ends, so the MLP's gradients then arrive
        before the attention's backward runs instead of after it: for the block whose backward comes
        last, data parallelism can reduce them while that backward runs rather than after it."""
        self.attn_half = torch.compile(self.attn_half, **options)
        self.mlp_half = torch.compile(self.mlp_half, **options)


@dataclass
class DecoderParts:
    """The decoder's parts in the order forward runs them: what data-parallel engines and parallel strategies
    ask for (ZeRO-3's units, where forward first reads each weight), instead of parsing parameter names."""
    embeddings: list[nn.Module]    # token (and position) embeddings
    layers: list[nn.Module]        # the transformer blocks
    final_norm: nn.Module
    head: nn.Module | None         # the output projection; None when it is tied to the token embedding


class Decoder(nn.Module):
    """The model, or a slice of it: the layers `layers` (all by default), with the embeddings where `first`
    and the final norm, head and loss where `last`. A slice keeps the whole model's parameter names
    (`layers.17.attn.qkv.weight`), so pipeline stages checkpoint and load by name like the whole model.
    Where the head is tied to the embedding, a last slice that is not also first holds its own copy."""

    def __init__(self, cfg: ModelConfig, layers=None, first: bool = True, last: bool = True):
        super().__init__()
        self.cfg, self.first, self.last = cfg, first, last
        tied_head = last and cfg.tie_embeddings
        self.embed = Embedding(cfg.vocab_size, cfg.hidden_size) if first or tied_head else None
        self.pos_embed = Embedding(cfg.max_seq_len, cfg.hidden_size) if first and cfg.arch == "gpt2" else None
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in (range(cfg.num_layers) if layers is None else layers)})
        self.norm = make_norm(cfg) if last else None
        self.lm_head = linear(cfg.hidden_size, cfg.vocab_size, False, cfg.init_std) if last and not tied_head else None
        self.output = LMOutput() if last else None
        self.recompute = "none"
        self.activation_offload: ActivationOffload | None = None
        self.loss_chunk = 2048  # tokens per chunk of the fused head + cross-entropy; 0 forms all logits
        self.doc_eos = None  # the end-of-text id of packed examples that must not attend to each other
        self.compile_loss = False
        self.attention = "auto"
        self.sequence: WholeSequence = WHOLE  # where this rank's tokens lie: a slice under context parallelism
        self._rope_cache: dict = {}
        self._mask_cache: tuple = (None, None)  # (key, mask): training repeats one shape every step

    def parts(self) -> DecoderParts:
        embeddings = [m for m in (self.embed, self.pos_embed) if m is not None] if self.first else []
        return DecoderParts(embeddings, list(self.layers.values()), self.norm, self.lm_head)

    def blocks(self, indices=None) -> list[Block]:
        """The blocks of the given global layer indices (all of this slice's by default), in order."""
        return list(self.layers.values()) if indices is None else [self.layers[str(i)] for i in indices]

    # ---- construction -------------------------------------------------------------------------
    def set_recompute(self, mode: str, offload_to: torch.device | None = None) -> None:
        """none | selective | full | full-skip-down | full-skip-out-down (recompute.py); with `offload_to`, a
        device, under full each block's input waits in host memory for its backward."""
        self.recompute = mode
        self.activation_offload = ActivationOffload(offload_to) if offload_to is not None and mode == "full" else None
        for core in self.modules():
            if isinstance(core, SDPA):
                core.recompute = mode == "selective"
            if isinstance(core, MoE):  # selective recomputes attention's core only
                core.recomputed = mode not in ("none", "selective")
        for block in self.blocks():
            set_block_recompute(block, mode)

    def set_attention(self, backend: str) -> None:
        """auto lets PyTorch pick the SDPA kernel; flash | cudnn | efficient | math allow only that one, so
        an unsupported case fails loudly instead of silently running the slow math kernel. The flags are
        process-wide (torch.backends.cuda), as SDPA's backend selection is."""
        self.attention = backend
        for core in self.modules():
            if isinstance(core, SDPA):
                core.expand_kv = backend in ("cudnn", "efficient")
        if backend == "auto":
            return
        import torch.backends.cuda as tbc
        tbc.enable_flash_sdp(backend == "flash")
        tbc.enable_cudnn_sdp(backend == "cudnn")
        tbc.enable_mem_efficient_sdp(backend == "efficient")
        tbc.enable_math_sdp(backend == "math")

    def init_weights(self, seed: int = 0) -> None:
        """Initialise every materialised parameter (`init_parameter`); those still on the meta device are
        left for whoever materialises them (the data-parallel engine, in its own buffers)."""
        for name, p in self.named_parameters():
            if p.device.type != "meta":
                self.init_parameter(name, p, seed)
        self._rope_cache.clear()

    @torch.no_grad()
    def init_parameter(self, name: str, out: torch.Tensor, seed: int = 0) -> None:
        """Parameter `name`'s initial values into `out`, from its own generator seeded by (seed, name), so
        its values do not depend on which other parameters a rank materialises or on the device order. A
        sharded parameter (its module's `shardings`, parallel/tensor.py) draws the full tensor and keeps
        its own slice, so any layout starts from the same weights. They do depend on the device type:
        CUDA's generator draws other numbers than the CPU's for one seed. Values are drawn in fp32 and
        rounded to `out`'s dtype, so a 16-bit model materialised as such holds the weights an fp32 one
        cast down would (without the fp32 copy: a 13B model's is 52 GB)."""
        mod_name, _, attr = name.rpartition(".")
        owner = self.get_submodule(mod_name) if mod_name else self
        if attr == "bias" or getattr(owner, "zero_init", False):  # a linear's or a norm's bias
            out.zero_()
        elif isinstance(owner, (RMSNorm, nn.LayerNorm)):
            out.fill_(1.0)
        else:
            spec = getattr(owner, "shardings", {}).get(attr)
            std = getattr(owner, "init_std", self.cfg.init_std)
            g = torch.Generator(device=out.device)
            g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
            full = torch.empty(spec.full_shape(out.shape) if spec else out.shape, dtype=torch.float32,
                               device=out.device)
            full.normal_(0.0, std, generator=g)
            out.copy_(spec.local(full) if spec else full)

    # ---- forward ------------------------------------------------------------------------------
    def rope(self, start: int, length: int, device, dtype):
        key = (device, dtype)
        cached = self._rope_cache.get(key)
        if cached is None or cached[0].shape[0] < start + length:
            n = max(self.cfg.max_seq_len, start + length)
            inv_freq = rope_inv_freq(self.cfg, device)
            freqs = torch.outer(torch.arange(n, device=device, dtype=torch.float32), inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            cached = (emb.cos().to(dtype), emb.sin().to(dtype))
            self._rope_cache[key] = cached
        return cached[0][start:start + length], cached[1][start:start + length]

    def window_mask(self, start: int, length: int, device):
        """Sliding-window attention as SDPA's boolean mask for the queries at positions start..start+length-1
        over the keys 0..start+length-1: query i sees key j where i - window < j <= i, the window counting
        the query itself (Mistral; HF's sliding_window_overlay). None where no query's window excludes a
        key: plain causal attention then keeps the fastest kernels (flash takes no mask)."""
        window = self.cfg.sliding_window
        if not window or start + length <= window:
            return None
        key = (device, start, length, window)
        if self._mask_cache[0] != key:
            i = torch.arange(start, start + length, device=device)[:, None]
            j = torch.arange(start + length, device=device)
            self._mask_cache = (key, (j <= i) & (j > i - window))
        return self._mask_cache[1]

    def documents(self, ids: torch.Tensor) -> torch.Tensor | None:
        """Which packed example each position of `ids` belongs to ([b, t]; an end-of-text token closes its
        example), where examples are packed into windows (`doc_eos`, set from the data); else None."""
        if self.doc_eos is None:
            return None
        ids = self.sequence.whole(ids)  # the examples span the whole sequence, whatever slice this rank holds
        ends = (ids == self.doc_eos).int()
        return ends.cumsum(1) - ends

    def hidden_states(self, x, cache: KVCache | None = None, layers=None, embed: bool | None = None,
                      length: int | None = None, documents: torch.Tensor | None = None):
        """The blocks `layers` (this slice's by default) over `x`: token ids where `embed` (the first slice's
        default), else the previous blocks' hidden states. `length`: the whole sequence's, where x holds a
        slice of it (sequence parallelism between pipeline stages). `documents` (`documents(ids)`): packed
        examples, each attending only to itself, its positions counted from its own start."""
        start = cache.pos if cache is not None else 0
        embed = self.first if embed is None else embed
        t = length or x.shape[1]
        device = x.device
        # This rank holds tokens first .. first + t - 1 of a sequence of `whole` (a slice of it under context
        # parallelism) and attention sees all of them: masks span the whole, positions the slice. A KV cache
        # holds whole sequences.
        sequence = self.sequence if cache is None else WHOLE
        first, whole = sequence.span(start, t)
        order = sequence.order(whole, device)  # None: this rank's tokens run on from `first`
        if documents is not None:
            positions, mask = self._packed(documents)
            positions = sequence.local(positions)
        else:
            positions = torch.arange(first, first + t, device=device) if order is None else start + order
            mask = self.window_mask(start, whole, device)
        if embed:
            x = self.embed(x)
            if self.pos_embed is not None:
                x = x + self.pos_embed(positions)
        rope = None
        if self.cfg.arch != "gpt2":
            if documents is not None:  # each position's own angle: [b, 1, t, head_dim]
                cos, sin = self.rope(start, whole, device, x.dtype)
                cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
            elif order is not None:
                cos, sin = self.rope(start, whole, device, x.dtype)
                cos, sin = cos[order], sin[order]
            else:
                cos, sin = self.rope(first, t, device, x.dtype)
            rope = (cos, sin)
        for block in self.blocks(layers):
            x = run_block(self, block, x, rope, cache, mask)
        if cache is not None:
            cache.pos += t
        return x

    def _packed(self, documents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The positions (restarting at each example) and the block-diagonal causal mask ([b, 1, t, t]) of
        packed examples: Llama 3's document masking."""
        t, device = documents.shape[1], documents.device
        i = torch.arange(t, device=device)
        starts = documents.diff(dim=1, prepend=documents[:, :1] - 1) != 0
        positions = i - torch.where(starts, i, 0).cummax(1).values
        mask = (documents[:, :, None] == documents[:, None, :]) & (i[None, :] <= i[:, None])
        window = self.window_mask(0, t, device)
        return positions, (mask if window is None else mask & window).unsqueeze(1)

    @property
    def head_weight(self):
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def cache_heads(self) -> int:
        """The key/value heads a KV cache holds per layer for this module's attention."""
        return self.blocks()[0].attn.n_kv

    def forward(self, ids, targets=None, cache: KVCache | None = None, last_only: bool = False):
        """Logits (of the last position only, with `last_only`), or with `targets` the mean next-token
        cross-entropy in fp32 (never forming all logits)."""
        documents = self.documents(ids) if cache is None else None
        return self.head(self.hidden_states(ids, cache, documents=documents), targets, last_only)

    def head(self, h, targets=None, last_only: bool = False):
        """The final norm, the output head and (with `targets`) the loss, over the last blocks' output."""
        h = self.norm(h)
        if last_only:
            h = h[:, -1:]
        return self.output(h, self.head_weight, targets, self.loss_chunk, self.compile_loss)


def build_model(cfg: ModelConfig, device="cpu", dtype=torch.float32, seed: int = 0, init: bool = True) -> Decoder:
    """Construct on the meta device, then materialise on `device`."""
    with torch.device("meta"):
        model = Decoder(cfg).to(dtype)
    model.to_empty(device=device)
    if init:
        model.init_weights(seed)
    return model
