"""Decoder-only transformer language models: GPT (Megatron-style), LLaMA (GQA, SwiGLU, RoPE,
RMSNorm) and mixture-of-experts GPT (Switch / GShard top-1 routing with a fixed capacity).

Plain PyTorch modules, written so that a forward on meta tensors has static shapes: the MoE
dispatch is the dense einsum formulation of GShard (Lepikhin et al., 2020), not a data-dependent
gather, so the captured graph is the same whatever the router decides.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from ..errors import ModelSpecError
from .sequence import current_shard


@dataclass(frozen=True)
class TransformerConfig:
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    ffn_hidden_size: int
    seq_length: int
    vocab_size: int
    num_key_value_heads: int | None = None   # GQA groups; None = multi-head attention
    norm: str = "layernorm"                  # layernorm | rmsnorm
    activation: str = "gelu"                 # gelu | swiglu
    position: str = "learned"                # learned | rope
    bias: bool = True
    tie_embeddings: bool = True
    dropout: float = 0.0
    attention: str = "eager"                 # eager (explicit softmax, Megatron) | flash (fused SDPA)
    num_experts: int = 0                     # > 0: mixture-of-experts MLP every `moe_every` layers
    moe_every: int = 2
    capacity_factor: float = 1.0
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    attention_head_dim: int | None = None    # default hidden_size / num_attention_heads

    def __post_init__(self) -> None:
        problems = []
        for name in ("hidden_size", "num_layers", "num_attention_heads", "ffn_hidden_size",
                     "seq_length", "vocab_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                problems.append(f"{name} must be a positive integer (got {getattr(self, name)!r})")
        if not problems and self.attention_head_dim is None and self.hidden_size % self.num_attention_heads:
            problems.append(f"hidden_size {self.hidden_size} must be divisible by "
                            f"num_attention_heads {self.num_attention_heads}")
        kv = self.kv_heads if not problems else 1
        if not problems and (kv <= 0 or self.num_attention_heads % kv):
            problems.append(f"num_attention_heads {self.num_attention_heads} must be a multiple of "
                            f"num_key_value_heads {kv}")
        for name, allowed in (("norm", ("layernorm", "rmsnorm")), ("activation", ("gelu", "swiglu")),
                              ("position", ("learned", "rope")), ("attention", ("eager", "flash"))):
            if getattr(self, name) not in allowed:
                problems.append(f"{name} must be one of {', '.join(allowed)} (got {getattr(self, name)!r})")
        if self.num_experts < 0 or self.moe_every < 1:
            problems.append("num_experts must be >= 0 and moe_every >= 1")
        if problems:
            raise ModelSpecError("invalid transformer config: " + "; ".join(problems))

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.hidden_size // self.num_attention_heads

    def tensor_parallel_local(self, tp: int) -> TransformerConfig | None:
        """The shapes one of ``tp`` tensor-parallel ranks computes (Megatron layout): heads, key/value
        heads and MLP features divided by tp, the vocabulary padded and divided, head size kept;
        None if tp does not divide the heads or features."""
        if tp == 1:
            return self
        if self.num_attention_heads % tp or self.kv_heads % tp or self.ffn_hidden_size % tp:
            return None
        return replace(self, num_attention_heads=self.num_attention_heads // tp,
                       num_key_value_heads=self.kv_heads // tp, ffn_hidden_size=self.ffn_hidden_size // tp,
                       vocab_size=-(-self.vocab_size // tp), attention_head_dim=self.head_dim)

    def is_moe_layer(self, index: int) -> bool:
        """MoE replaces the MLP of every ``moe_every``-th layer, the last of each group
        (layers 1, 3, 5, ... for moe_every=2, as in GShard and DeepSpeed-MoE)."""
        return self.num_experts > 0 and index % self.moe_every == self.moe_every - 1

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def make_norm(cfg: TransformerConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """Self-attention with a fused QKV projection and optional GQA.

    The QKV weight's rows are grouped as Megatron-LM lays them out: for each key/value head, its
    ``heads / kv_heads`` query heads, then its key and its value. A tensor-parallel rank that holds a
    contiguous slice of the rows (``ColwiseParallel``) then holds whole groups, and ``forward`` takes
    the number of heads from the tensor, so the same code runs on all heads or on one rank's share.
    Under GQA the query heads of a group sit between keys and values, so gathering them costs one copy.
    """

    def __init__(self, cfg: TransformerConfig, causal: bool = True) -> None:
        super().__init__()
        self.cfg, self.causal = cfg, causal
        d = cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, (cfg.num_attention_heads + 2 * cfg.kv_heads) * d, bias=cfg.bias)
        self.proj = nn.Linear(cfg.num_attention_heads * d, cfg.hidden_size, bias=cfg.bias)
        self.attn_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        cfg, (b, s, _) = self.cfg, x.shape
        per_group, d = cfg.num_attention_heads // cfg.kv_heads, cfg.head_dim
        qkv = self.qkv(x).view(b, s, -1, per_group + 2, d)           # (b, s, kv groups here, ..., d)
        q = qkv[..., :per_group, :].reshape(b, s, -1, d).transpose(1, 2)
        k, v = qkv[..., per_group, :].transpose(1, 2), qkv[..., per_group + 1, :].transpose(1, 2)
        heads, kv = q.shape[1], k.shape[1]
        if rope is not None:
            cos, sin = rope
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if (shard := current_shard()) is not None:           # context parallelism: this rank's queries, every key
            k, v = shard.gather(k, 2), shard.gather(v, 2)
            with shard.saving():                             # its backward keeps the rank's share of K and V
                y = self._attend_gathered(q, k, v, mask, shard.chunks, shard.lower_right)
            return self.proj(y.transpose(1, 2).reshape(b, s, -1))
        if cfg.attention == "flash":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=kv != heads,
                                               dropout_p=cfg.dropout if self.training else 0.0)
        else:
            if kv != heads:
                k, v = k.repeat_interleave(heads // kv, dim=1), v.repeat_interleave(heads // kv, dim=1)
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
            if mask is not None:
                scores = scores.masked_fill(mask, float("-inf"))
            y = self.attn_dropout(scores.softmax(dim=-1)) @ v
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))

    def _attend_gathered(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                         chunks: tuple[tuple[int, int], ...], lower_right: tuple = ()) -> torch.Tensor:
        """Attention of this rank's queries (its ``chunks`` of the sequence, in order) to the whole sequence's keys
        and values, which are read as gathered (kv heads, never repeated per query head: what the backward keeps
        of them is then the gathered tensors, which the shard's ``saving`` keeps as the rank's share).

        Flash: per chunk, SDPA of its queries against the keys up to its end under a bottom-right causal mask
        (``causal_lower_right``: the flash and memory-efficient kernels take it without a mask tensor and skip the
        masked blocks, as Transformer Engine's all-gather CP computes its two chunks). Eager: the explicit softmax of
        ``forward`` on the causal mask's rows of the queries' positions (``mask``, True: masked; one tensor for
        every layer), each key/value head's query heads (adjacent, see the class doc) taken as one block of rows."""
        b, heads, s, d = q.shape
        kv = k.shape[1]
        if self.cfg.attention == "flash":
            dropout, outs, offset = self.cfg.dropout if self.training else 0.0, [], 0
            for i, (start, stop) in enumerate(chunks):
                rows = q[:, :, offset:offset + stop - start]
                bias = lower_right[i] if lower_right else causal_lower_right(stop - start, stop)
                outs.append(F.scaled_dot_product_attention(rows, k[:, :, :stop], v[:, :, :stop], attn_mask=bias,
                                                           dropout_p=dropout, enable_gqa=kv != heads))
                offset += stop - start
            return torch.cat(outs, dim=2)
        rows = q.reshape(b, kv, heads // kv * s, d)                      # (b, kv, group x s, d)
        scores = ((rows @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))).view(b, kv, heads // kv, s, -1)
        probs = self.attn_dropout(scores.masked_fill(mask, float("-inf")).softmax(dim=-1))
        return (probs.view(b, kv, heads // kv * s, -1) @ v).view(b, heads, s, d)


class MLP(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.swiglu = cfg.activation == "swiglu"
        if self.swiglu:
            self.gate = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=cfg.bias)
        self.up = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=cfg.bias)
        self.down = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.gate(x)) * self.up(x) if self.swiglu else F.gelu(self.up(x))
        return self.down(h)


class MoE(nn.Module):
    """Top-1 mixture of experts with capacity C = ceil(capacity_factor * tokens / experts).

    Tokens beyond an expert's capacity are dropped (they pass through the residual), as in the
    Switch Transformer (Fedus et al., 2021). Expert weights are stacked so that one batched
    product runs all experts; sharding the expert dimension is expert parallelism.
    """

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        e, h, f = cfg.num_experts, cfg.hidden_size, cfg.ffn_hidden_size
        self.cfg = cfg
        self.router = nn.Linear(h, e, bias=False)
        self.w_in = nn.Parameter(torch.empty(e, h, f))
        self.w_out = nn.Parameter(torch.empty(e, f, h))
        self.b_in = nn.Parameter(torch.empty(e, 1, f)) if cfg.bias else None
        self.b_out = nn.Parameter(torch.empty(e, 1, h)) if cfg.bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Experts N(0, 0.02), biases zero (the router is an ``nn.Linear`` and resets itself)."""
        for w in (self.w_in, self.w_out):
            nn.init.normal_(w, std=0.02)
        for b in (self.b_in, self.b_out):
            if b is not None:
                nn.init.zeros_(b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        e = self.cfg.num_experts
        tokens = x.reshape(b * s, h)
        capacity = math.ceil(self.cfg.capacity_factor * b * s / e)
        probs = self.router(tokens).float().softmax(dim=-1)                  # (T, E)
        gate, expert = probs.max(dim=-1)                                     # top-1
        chosen = F.one_hot(expert, e)                                        # (T, E)
        position = (chosen.cumsum(dim=0) - 1) * chosen                       # slot in its expert
        kept = chosen * (position < capacity)
        dispatch = F.one_hot(position.clamp(0, capacity - 1), capacity) * kept.unsqueeze(-1)
        dispatch = dispatch.to(x.dtype)                                      # (T, E, C)
        expert_in = torch.einsum("tec,th->ech", dispatch, tokens)            # (E, C, H)
        hidden = expert_in @ self.w_in + (self.b_in if self.b_in is not None else 0)
        out = F.gelu(hidden) @ self.w_out + (self.b_out if self.b_out is not None else 0)
        combine = dispatch * gate.to(x.dtype).view(-1, 1, 1)
        return torch.einsum("tec,ech->th", combine, out).reshape(b, s, h)


class Block(nn.Module):
    """Pre-norm transformer layer: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: TransformerConfig, moe: bool) -> None:
        super().__init__()
        self.norm1, self.norm2 = make_norm(cfg), make_norm(cfg)
        self.attn = Attention(cfg)
        self.mlp = MoE(cfg) if moe else MLP(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x, mask=None, rope=None):
        x = x + self.dropout(self.attn(self.norm1(x), mask, rope))
        return x + self.dropout(self.mlp(self.norm2(x)))


def rope_tables(cfg: TransformerConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin tables of rotary embeddings (Su et al., 2021), shape (seq, head_dim)."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = torch.outer(torch.arange(cfg.seq_length, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def init_weights(module: nn.Module) -> None:
    """GPT-2's initialisation of one module: N(0, 0.02) weights, zero biases; and the decoder's own
    buffers (causal mask, rotary tables). ``DecoderLM`` applies it when built; a model built on the meta
    device passes it as ``tensoropt.parallelize(..., init_fn=init_weights)`` (free on the meta device)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
    if isinstance(module, DecoderLM):
        module.reset_buffers()


class DecoderLM(nn.Module):
    """Token embedding, ``num_layers`` blocks, final norm, LM head and cross-entropy loss."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos_embed = nn.Embedding(cfg.seq_length, cfg.hidden_size) if cfg.position == "learned" else None
        self.dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(Block(cfg, cfg.is_moe_layer(i)) for i in range(cfg.num_layers))
        self.norm = make_norm(cfg)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        s = cfg.seq_length
        self.register_buffer("causal_mask", torch.empty(s, s, dtype=torch.bool), persistent=False)
        if cfg.position == "rope":
            self.register_buffer("rope_cos", torch.empty(s, cfg.head_dim), persistent=False)
            self.register_buffer("rope_sin", torch.empty(s, cfg.head_dim), persistent=False)
        self.apply(init_weights)

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Compute the causal mask and rotary tables (non-persistent: never in a checkpoint)."""
        s = self.cfg.seq_length
        self.causal_mask.copy_(torch.ones(s, s, dtype=torch.bool, device=self.causal_mask.device).triu(1))
        if self.cfg.position == "rope":
            cos, sin = rope_tables(self.cfg)
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def context_parallel_refusal(self) -> str:
        """Why this model cannot run context-parallel ("": it can; ``models.sequence``): token-routed layers
        (``MoE``) fill each expert's capacity from the tokens a rank holds, which a sequence split changes."""
        return "its token-routed (MoE) layers size their capacity by the tokens a rank holds" \
            if self.cfg.num_experts else ""

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        s = input_ids.shape[1]
        x = self.embed(input_ids)
        if (shard := current_shard()) is not None:            # context parallelism: this rank's positions
            shard.check(s)
            positions = shard.positions(input_ids.device)
            if self.pos_embed is not None:
                x = x + self.pos_embed.weight[positions]
            mask = self.causal_mask[positions, :shard.length] if self.cfg.attention == "eager" else None
            rope = None if self.cfg.position != "rope" else (
                self.rope_cos[positions].to(x.dtype), self.rope_sin[positions].to(x.dtype))
            return self._layers_and_loss(self.dropout(x), mask, rope, labels)
        if self.pos_embed is not None:
            x = x + self.pos_embed.weight[:s]
        mask = self.causal_mask[:s, :s] if self.cfg.attention == "eager" else None
        rope = None
        if self.cfg.position == "rope":
            rope = (self.rope_cos[:s].to(x.dtype), self.rope_sin[:s].to(x.dtype))
        return self._layers_and_loss(self.dropout(x), mask, rope, labels)

    def _layers_and_loss(self, x: torch.Tensor, mask, rope, labels: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, mask, rope)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))
