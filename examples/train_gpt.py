"""A GPT-style training script on synthetic data: runs alone (one process) or under
``tensoropt launch examples/train_gpt.py --device cpu --gpus 2 -- --steps 5``.

The TensorOpt lines are ``tensoropt.parallelize`` (it hands the launcher the model to plan, and in the
workers applies the chosen plan) and ``run.train_step`` (one step, driven the way the plan's engine
needs). The data is deterministic, so a launched run's losses can be compared with this script run by hand.
"""

import argparse
import json
import time

import numpy as np
import torch

import tensoropt
from tensoropt.models.transformer import DecoderLM, TransformerConfig


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--out", default=None, help="write the per-step losses (JSON) here")
    parser.add_argument("--save-params", default=None, help="write the final parameters here (.npy, flattened)")
    parser.add_argument("--pause-s", type=float, default=0.0, help="sleep after each step (to watch or interrupt)")
    args = parser.parse_args()

    torch.manual_seed(0)
    cfg = TransformerConfig(hidden_size=64, num_layers=args.layers, num_attention_heads=4, ffn_hidden_size=256,
                            seq_length=args.seq_len, vocab_size=128)
    model = DecoderLM(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (args.steps, args.global_batch, args.seq_len + 1),
                           generator=torch.Generator().manual_seed(1))
    inputs, targets = tokens[..., :-1], tokens[..., 1:]                 # predict the next token
    example = (inputs[0, :1], targets[0, :1])                          # one sample, for the planner
    model, optimizer, run = tensoropt.parallelize(model, lambda p: torch.optim.AdamW(p, lr=1e-3),
                                                  example_inputs=example, global_batch=args.global_batch)
    losses = []
    for step in range(run.start_step, args.steps):                    # a resumed run starts at its checkpoint
        losses.append(run.train_step((inputs[step], targets[step])))   # the model returns the loss
        if run.rank == 0:
            print(f"step {step} loss {losses[-1]:.6f}", flush=True)
        time.sleep(args.pause_s)
    if args.save_params:
        params = run.full_state_dict()                                 # gathered on every rank
        if run.rank == 0:
            np.save(args.save_params, torch.cat([params[k].detach().flatten() for k in sorted(params)]).numpy())
    if run.rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "plan": run.plan and run.plan["summary"], "engine": run.engine}, f)
    run.close()


if __name__ == "__main__":
    main()
