"""A Hugging Face LLaMA (built from a config, nothing downloaded) trained on synthetic data; runs
alone or under ``tensoropt launch examples/train_llama_hf.py --device cpu --gpus 2 -- --steps 5``."""

import argparse
import json
import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402

import tensoropt  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--out", default=None, help="write the per-step losses (JSON) here")
    args = parser.parse_args()

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      max_position_embeddings=args.seq_len, use_cache=False)
    model = transformers.LlamaForCausalLM(config)
    tokens = torch.randint(0, config.vocab_size, (args.steps, args.global_batch, args.seq_len),
                           generator=torch.Generator().manual_seed(1))
    example = {"input_ids": tokens[0, :1], "labels": tokens[0, :1]}   # HF shifts the labels itself
    model, optimizer, run = tensoropt.parallelize(model, lambda p: torch.optim.AdamW(p, lr=1e-3),
                                                  example_inputs=example, global_batch=args.global_batch)
    losses = []
    for step in range(args.steps):
        losses.append(run.train_step({"input_ids": tokens[step], "labels": tokens[step]}))
        if run.rank == 0:
            print(f"step {step} loss {losses[-1]:.6f}", flush=True)
    if run.rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "plan": run.plan and run.plan.summary(), "engine": run.engine}, f)
    run.close()


if __name__ == "__main__":
    main()
