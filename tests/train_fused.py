"""A training script over model code shaped like users' fused projections, for the tensor-parallel tests; runs
alone or under ``tensoropt launch tests/train_fused.py --device cpu --gpus 2 -- --attention chunk``.

``--attention``: how the fused QKV projection ``c_attn`` (nanoGPT's name) is read:
  ``chunk``: ``[q | k | v]`` taken by ``chunk(3)`` (sizes from the tensor: shardable by segments);
  ``split``: ``[q | k | v]`` taken by ``split(n_embd)`` as nanoGPT does (sizes hard-coded: never sharded);
  ``interleaved``: per head ``[q_h k_h v_h]``, viewed as (heads, 3, head_dim) (Megatron's layout).
``--mlp``: ``plain`` (up, GELU, down) or ``gate-up`` (one fused ``gate_up_proj`` split by ``chunk(2)``, SwiGLU,
as Phi-3 does). Float32, dropout 0: every plan must reproduce the losses of this script run alone.
"""

import argparse
import contextlib
import json

import torch
import torch.nn.functional as F
from torch import nn

import tensoropt


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, layout: str) -> None:
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.n_embd, self.head_dim, self.layout = hidden, hidden // heads, layout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.c_attn(x)
        if self.layout == "interleaved":
            q, k, v = qkv.view(b, s, -1, 3, self.head_dim).unbind(dim=3)
        else:
            q, k, v = qkv.chunk(3, dim=-1) if self.layout == "chunk" else qkv.split(self.n_embd, dim=-1)
            q, k, v = (t.reshape(b, s, -1, self.head_dim) for t in (q, k, v))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, kind: str) -> None:
        super().__init__()
        self.kind = kind
        if kind == "gate-up":
            self.gate_up_proj, self.down_proj = nn.Linear(hidden, 8 * hidden, bias=False), nn.Linear(4 * hidden, hidden)
        else:
            self.c_fc, self.c_proj = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "gate-up":
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, attention: str, mlp: str) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(hidden), Attention(hidden, heads, attention)
        self.ln_2, self.mlp = nn.LayerNorm(hidden), MLP(hidden, mlp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq_len: int, hidden: int, heads: int, layers: int, attention: str,
                 mlp: str) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, hidden), nn.Embedding(seq_len, hidden)
        self.h = nn.ModuleList(Block(hidden, heads, attention, mlp) for _ in range(layers))
        self.ln_f, self.lm_head = nn.LayerNorm(hidden), nn.Linear(hidden, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return F.cross_entropy(self.lm_head(self.ln_f(x)).flatten(0, 1), targets.flatten())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--attention", choices=["chunk", "split", "interleaved"], default="chunk")
    parser.add_argument("--mlp", choices=["plain", "gate-up"], default="plain")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--meta", action="store_true", help="build on the meta device")
    parser.add_argument("--out", default=None, help="write the per-step losses (JSON) here")
    parser.add_argument("--save-params", default=None, help="write the final parameters here (.pt, on rank 0)")
    args = parser.parse_args()

    torch.manual_seed(0)
    with tensoropt.meta_init() if args.meta else contextlib.nullcontext():
        model = GPT(96, args.seq_len, 32, 4, args.layers, args.attention, args.mlp)
    tokens = torch.randint(0, 96, (args.steps, args.global_batch, args.seq_len + 1),
                           generator=torch.Generator().manual_seed(1))
    inputs, targets = tokens[..., :-1], tokens[..., 1:]
    model, _, run = tensoropt.parallelize(model, lambda p: torch.optim.AdamW(p, lr=1e-2),
                                          example_inputs=(inputs[0, :1], targets[0, :1]),
                                          global_batch=args.global_batch)
    losses = [run.train_step((inputs[step], targets[step])) for step in range(run.start_step, args.steps)]
    if args.save_params:
        params = {k: v.detach().cpu() for k, v in run.full_state_dict().items()}
        if run.rank == 0:
            torch.save(params, args.save_params)
    if run.rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "plan": run.plan and run.plan.summary(), "engine": run.engine}, f)
    run.close()


if __name__ == "__main__":
    main()
