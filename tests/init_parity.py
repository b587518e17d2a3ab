"""Initialisation parity: a small transformer of plain ``nn.Linear`` layers and two initialisations that the
old per-module materialisation got wrong, used by ``test_materialize`` (one process) and ``test_meta_launch``
(this file run as a script under ``tensoropt launch``).

- ``gpt2_init``: GPT-2's scheme as ``model.apply`` runs it: every linear and embedding N(0, 0.02), then the
  attention and MLP modules re-draw their child ``c_proj.weight`` with std 0.02 / sqrt(2 * layers).
- ``titan_init``: torchtitan's style, one ``init_weights()`` on the whole model called from the root only
  (depth-scaled truncated normals, and a buffer replaced by assignment).

As a script it builds both models (``--meta``: under ``tensoropt.meta_init()``; else for real, followed by
``model.apply(init_fn)``, the reference), calls ``tensoropt.parallelize`` on each with its ``init_fn`` and
saves, per rank, ``run.full_state_dict()`` and the buffers of each as ``OUT.<init>.<rank>.npz``: nothing trains.
"""

import argparse
import contextlib
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import tensoropt
from tensoropt.runtime.memory.materialize import script_name


class Attention(nn.Module):
    """Separate q/k/v projections (each read whole, so tensor parallelism splits them as they are)."""

    def __init__(self, hidden: int, heads: int, layers: int) -> None:
        super().__init__()
        self.head_dim, self.scaled_std = hidden // heads, 0.02 / math.sqrt(2 * layers)
        self.q, self.k, self.v = (nn.Linear(hidden, hidden) for _ in range(3))
        self.c_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, layers: int) -> None:
        super().__init__()
        self.scaled_std = 0.02 / math.sqrt(2 * layers)
        self.c_fc, self.c_proj = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, layers: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn, self.mlp = Attention(hidden, heads, layers), MLP(hidden, layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def sinusoids(seq: int, hidden: int) -> torch.Tensor:
    position = torch.arange(seq, dtype=torch.float32)[:, None]
    frequency = torch.exp(torch.arange(0, hidden, 2, dtype=torch.float32) * (-math.log(1e4) / hidden))
    return torch.cat([torch.sin(position * frequency), torch.cos(position * frequency)], dim=1)


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 128, hidden: int = 64, heads: int = 4, layers: int = 4, seq: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Block(hidden, heads, layers) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.register_buffer("positions", sinusoids(seq, hidden), persistent=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids) + self.positions[:input_ids.shape[1]]
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1))

    @torch.no_grad()
    def init_weights(self) -> None:
        """torchtitan's shape of initialisation: the whole model from the root, depth-scaled output layers."""
        hidden = self.embed.embedding_dim
        nn.init.normal_(self.embed.weight)
        for depth, layer in enumerate(self.layers, start=1):
            scaled = 0.02 / math.sqrt(2 * depth)
            for linear, std in ((layer.attn.q, 0.02), (layer.attn.k, 0.02), (layer.attn.v, 0.02),
                                (layer.mlp.c_fc, 0.02), (layer.attn.c_proj, scaled), (layer.mlp.c_proj, scaled)):
                nn.init.trunc_normal_(linear.weight, std=std)
                nn.init.zeros_(linear.bias)
            for norm in (layer.ln_1, layer.ln_2):
                norm.reset_parameters()
        self.norm.reset_parameters()
        bound = 3 * hidden ** -0.5
        nn.init.trunc_normal_(self.head.weight, std=hidden ** -0.5, a=-bound, b=bound)
        self.positions = sinusoids(*self.positions.shape).to(self.positions.device)


@torch.no_grad()
def gpt2_init(module: nn.Module) -> None:
    """GPT-2's per-module initialisation, the scaled output projections set by their parent module."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
    if isinstance(module, (Attention, MLP)):
        nn.init.normal_(module.c_proj.weight, std=module.scaled_std)


def titan_init(module: nn.Module) -> None:
    """A whole-model init, acting at the root only."""
    if isinstance(module, TinyLM):
        module.init_weights()


INITS = {"gpt2": gpt2_init, "titan": titan_init}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--meta", action="store_true", help="build on the meta device; parallelize initialises")
    parser.add_argument("--out", default="init_parity", help="prefix of the saved parameters (OUT.<init>.<rank>.npz)")
    args = parser.parse_args()
    tokens = torch.randint(0, 128, (4, 17), generator=torch.Generator().manual_seed(1))
    example = (tokens[:1, :-1], tokens[:1, 1:])
    runs = []
    for name, init_fn in INITS.items():
        torch.manual_seed(0)
        with tensoropt.meta_init() if args.meta else contextlib.nullcontext():
            model = TinyLM()
        if not args.meta:
            model.apply(init_fn)                  # the reference: built for real, then model.apply(init_fn)
        _, _, run = tensoropt.parallelize(model, example_inputs=example, global_batch=4, init_fn=init_fn)
        held = getattr(run.model, "module", run.model)              # DDP's or DeepSpeed's module, else the model
        state = run.full_state_dict() | {script_name(n): b for n, b in held.named_buffers()}
        np.savez(f"{args.out}.{name}.{run.rank}.npz", **{k: v.detach().float().cpu().numpy() for k, v in state.items()})
        runs.append(run)
    runs[-1].close()


if __name__ == "__main__":
    main()
