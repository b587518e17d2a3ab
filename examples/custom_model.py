"""A user model for ``tensoropt inspect --model examples/custom_model.py:build``.

TensorOpt calls ``build`` with the meta device as the default device, so nothing is allocated.
The identical mixer layers have arbitrary attribute names (no ``layers.0``, ``layers.1``):
folding finds them from the graph's structure, and it keeps the wider projection apart because
its shapes differ.
"""

import torch
import torch.nn.functional as F
from torch import nn


class MixerLayer(nn.Module):
    """Token mixing over the sequence, then channel mixing (MLP-Mixer, Tolstikhin et al. 2021)."""

    def __init__(self, seq_len: int, dim: int) -> None:
        super().__init__()
        self.norm_tokens = nn.LayerNorm(dim)
        self.token_mlp = nn.Sequential(nn.Linear(seq_len, 2 * seq_len), nn.GELU(), nn.Linear(2 * seq_len, seq_len))
        self.norm_channels = nn.LayerNorm(dim)
        self.channel_mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.token_mlp(self.norm_tokens(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mlp(self.norm_channels(x))


class Classifier(nn.Module):
    def __init__(self, seq_len: int = 196, dim: int = 512, classes: int = 1000) -> None:
        super().__init__()
        self.embed = nn.Linear(768, dim)
        # arbitrary names: folding must not rely on them
        self.alpha, self.beta, self.gamma, self.delta = (MixerLayer(seq_len, dim) for _ in range(4))
        self.widen = nn.Linear(dim, 2 * dim)           # different shapes: must not fold with the above
        self.epsilon, self.zeta, self.eta = (MixerLayer(seq_len, 2 * dim) for _ in range(3))
        self.head = nn.Linear(2 * dim, classes)

    def forward(self, patches: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(patches)
        for layer in (self.alpha, self.beta, self.gamma, self.delta):
            x = layer(x)
        x = self.widen(x)
        for layer in (self.epsilon, self.zeta, self.eta):
            x = layer(x)
        return F.cross_entropy(self.head(x.mean(dim=1)), labels)


def build(batch_size: int = 8):
    """Return (model, example_inputs): 196 patches of 16x16x3 pixels per image."""
    model = Classifier()
    inputs = (torch.randn(batch_size, 196, 768), torch.zeros(batch_size, dtype=torch.long))
    return model, inputs
