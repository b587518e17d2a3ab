"""BERT for pre-training (Devlin et al., 2019): post-norm encoder, masked-LM and next-sentence
heads, with the decoder tied to the word embedding. Layout follows the public checkpoints so that
parameter counts match them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .transformer import MLP, Attention, TransformerConfig


class BertLayer(nn.Module):
    """Post-norm layer: norm(x + attn(x)), then norm(x + mlp(x))."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.attn = Attention(cfg, causal=False)
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp = MLP(cfg)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm1(x + self.dropout(self.attn(x)))
        return self.norm2(x + self.dropout(self.mlp(x)))


class BertForPreTraining(nn.Module):
    TYPE_VOCAB = 2

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.cfg = cfg
        self.word_embed = nn.Embedding(cfg.vocab_size, h)
        self.pos_embed = nn.Embedding(cfg.seq_length, h)
        self.type_embed = nn.Embedding(self.TYPE_VOCAB, h)
        self.embed_norm = nn.LayerNorm(h, eps=cfg.norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_layers))
        self.pooler = nn.Linear(h, h)
        self.mlm_transform = nn.Linear(h, h)
        self.mlm_norm = nn.LayerNorm(h, eps=cfg.norm_eps)
        self.mlm_bias = nn.Parameter(torch.zeros(cfg.vocab_size))
        self.nsp_head = nn.Linear(h, 2)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, labels: torch.Tensor,
                next_sentence_label: torch.Tensor) -> torch.Tensor:
        s = input_ids.shape[1]
        x = self.word_embed(input_ids) + self.pos_embed.weight[:s] + self.type_embed(token_type_ids)
        x = self.dropout(self.embed_norm(x))
        for layer in self.layers:
            x = layer(x)
        pooled = torch.tanh(self.pooler(x[:, 0]))
        h = self.mlm_norm(F.gelu(self.mlm_transform(x)))
        logits = F.linear(h, self.word_embed.weight, self.mlm_bias)
        mlm = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))
        nsp = F.cross_entropy(self.nsp_head(pooled).float(), next_sentence_label)
        return mlm + nsp
