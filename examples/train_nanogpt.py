"""A nanoGPT-style model trained under autocast: runs alone or under
``tensoropt launch examples/train_nanogpt.py --device cpu --gpus 2 -- --steps 5``.

The model has the shape of Karpathy's nanoGPT ``model.py`` (github.com/karpathy/nanoGPT): one fused
``c_attn`` projection whose output is ``.split(n_embd)`` into q, k and v, a tied ``lm_head``, and training
under ``torch.autocast(device_type, dtype=torch.bfloat16)`` with float32 parameters. Two things differ
from nanoGPT, both because of TensorOpt's contract:

- ``forward(idx, targets)`` returns the loss alone. nanoGPT returns ``(logits, loss)``; TensorOpt refuses
  that at capture, in one line, before any worker starts (``--return-logits`` shows the message).
- the step is ``run.train_step(batch)`` inside the autocast (nanoGPT: ``with ctx: logits, loss = model(X, Y)``).
  The launcher's capture runs the script up to that first step and captures the model there, under the
  same autocast (a CUDA autocast is captured as a CPU one of the same dtype), so the plan is priced with
  bf16 compute and activations and float32 weights, gradients and AdamW states (4 + 4 + 8 bytes).
"""

import argparse
import contextlib
import json
import math

import torch
import torch.nn.functional as F
from torch import nn

import tensoropt


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, bias: bool) -> None:
        super().__init__()
        self.n_embd, self.n_head = n_embd, n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)     # q, k and v in one product
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, bias: bool) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd, bias=bias), nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, bias)
        self.mlp = nn.Sequential()
        self.mlp.c_fc, self.mlp.gelu = nn.Linear(n_embd, 4 * n_embd, bias=bias), nn.GELU()
        self.mlp.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int,
                 bias: bool = True, return_logits: bool = False) -> None:
        super().__init__()
        self.return_logits = return_logits
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd), wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList(Block(n_embd, n_head, bias) for _ in range(n_layer)), ln_f=nn.LayerNorm(n_embd, bias=bias)))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight                  # tied
        self.apply(self._init_weights)
        for name, p in self.named_parameters():                            # scaled residual projections (GPT-2)
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor):
        pos = torch.arange(idx.shape[1], dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return (logits, loss) if self.return_logits else loss              # TensorOpt: the loss alone


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--embd", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                        help="the autocast dtype (float32: no autocast)")
    parser.add_argument("--return-logits", action="store_true", help="return (logits, loss) as nanoGPT does")
    parser.add_argument("--out", default=None, help="write the per-step losses (JSON) here")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = GPT(args.vocab, args.block_size, args.layers, args.heads, args.embd, return_logits=args.return_logits)
    tokens = torch.randint(0, args.vocab, (args.steps, args.global_batch, args.block_size + 1),
                           generator=torch.Generator().manual_seed(1))
    x, y = tokens[..., :-1], tokens[..., 1:]
    model, optimizer, run = tensoropt.parallelize(model, lambda p: torch.optim.AdamW(p, lr=1e-3),
                                                  example_inputs=(x[0, :1], y[0, :1]), global_batch=args.global_batch)
    # nanoGPT: autocast on the device it trains on (cuda:N in GPU workers, the CPU in CPU workers)
    amp = (contextlib.nullcontext() if args.dtype == "float32"
           else torch.autocast(device_type=run.device.type, dtype=getattr(torch, args.dtype)))
    losses = []
    for step in range(run.start_step, args.steps):
        with amp:
            losses.append(run.train_step((x[step], y[step])))
        if run.rank == 0:
            print(f"step {step} loss {losses[-1]:.4f}", flush=True)
    if run.rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "plan": run.plan and run.plan.summary(), "engine": run.engine}, f)
    run.close()


if __name__ == "__main__":
    main()
