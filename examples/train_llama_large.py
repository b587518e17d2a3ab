"""LLaMA-2 70B, trained on synthetic tokens: a model no host can hold once per worker, built the way large
models are built, on the meta device.

    tensoropt launch examples/train_llama_large.py --device cuda --gpus 8 --nnodes 8 --dry-run  # plan 64 GPUs
    tensoropt launch examples/train_llama_large.py --gpus 8 --nnodes 8 --node-rank R --master-addr HOST -- --steps 10
    tensoropt launch examples/train_llama_large.py --device cpu --gpus 2 -- --layers 4 --hidden 64 --heads 4 \\
        --kv-heads 2 --ffn 128 --vocab 128 --seq-len 32 --global-batch 8 --steps 3       # the same code, tiny

``tensoropt.meta_init()`` builds the parameters on the meta device (nothing allocated; buffers such as the
rotary tables are computed for real, they are small). ``tensoropt.parallelize`` shards the meta model as
the plan says and then gives each worker storage for its own shard only, on its GPU, initialised to the
values ``--no-meta`` gives: ``--no-meta`` builds the model for real on the host instead (its constructor
applies ``init_weights``), which only small models survive (every worker would hold all 138 GB of a 70B
model in bf16).
"""

import argparse
import contextlib
import json
import time

import torch

import tensoropt
from tensoropt.models.transformer import DecoderLM, TransformerConfig, init_weights


def config(args) -> TransformerConfig:
    """LLaMA-2 70B by default (Touvron et al. 2023: 80 layers, hidden 8192, 64 heads in 8 key/value groups,
    SwiGLU MLP of 28672, vocabulary 32000, 4096 tokens)."""
    return TransformerConfig(hidden_size=args.hidden, num_layers=args.layers, num_attention_heads=args.heads,
                             num_key_value_heads=args.kv_heads, ffn_hidden_size=args.ffn, seq_length=args.seq_len,
                             vocab_size=args.vocab, norm="rmsnorm", activation="swiglu", position="rope", bias=False,
                             tie_embeddings=False, attention="flash")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=28672)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--no-meta", action="store_true", help="build the model for real on the host (small ones)")
    parser.add_argument("--out", default=None, help="write the per-step losses (JSON) here")
    args = parser.parse_args()

    torch.manual_seed(0)
    cfg = config(args)
    with contextlib.nullcontext() if args.no_meta else tensoropt.meta_init():
        model = DecoderLM(cfg).to(getattr(torch, args.dtype))

    def tokens(step: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(1000 + step)
        return torch.randint(0, cfg.vocab_size, (args.global_batch, args.seq_len + 1), generator=generator)

    example = tokens(0)[:1]
    model, optimizer, run = tensoropt.parallelize(model, lambda p: torch.optim.AdamW(p, lr=1e-4),
                                                  example_inputs=(example[:, :-1], example[:, 1:]),
                                                  global_batch=args.global_batch, init_fn=init_weights)
    losses, step_times = [], []
    for step in range(run.start_step, args.steps):
        batch = tokens(step)
        start = time.perf_counter()
        losses.append(run.train_step((batch[:, :-1], batch[:, 1:])))      # returns when the step is done
        step_times.append(time.perf_counter() - start)
        if run.rank == 0:
            print(f"step {step} loss {losses[-1]:.6f}", flush=True)
    if run.rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "plan": run.plan and run.plan.summary(), "engine": run.engine,
                       "step_times_s": step_times} | run.device_report(), f)
    run.close()


if __name__ == "__main__":
    main()
