"""A training script around one of the built-in model presets (``tensoropt inspect --list``), built on the
meta device: what ``benchmarks/launch_coverage.py`` gives ``tensoropt launch --dry-run`` to plan, so the
launcher learns the model from a script exactly as a user's launch does.

    tensoropt launch benchmarks/preset_train.py --device cuda --gpus 8 --nnodes 128 --dry-run -- \\
        --model gpt3-175b --global-batch 1536

It only plans: a preset at full size is never trained here (its first step ends the capture).
"""

import argparse

import torch

import tensoropt
from tensoropt.models import resolve_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="a preset name, e.g. gpt3-175b")
    parser.add_argument("--global-batch", type=int, required=True)
    parser.add_argument("--seq-len", type=int, default=None, help="default: the preset's")
    args = parser.parse_args()
    model, inputs = resolve_model(args.model).build(1, args.seq_len)      # every tensor on the meta device
    _, _, run = tensoropt.parallelize(model, lambda params: torch.optim.AdamW(params, lr=1e-4),
                                      example_inputs=inputs, global_batch=args.global_batch)
    run.train_step(inputs)


if __name__ == "__main__":
    main()
