"""A tiny GPT built on the meta device, for the pipeline tests; runs alone or under ``tensoropt launch
tests/train_stages.py --device cpu --gpus 8 --plan plan.json``. Besides the per-step losses, rank 0 writes
what it holds: the local shape of each of its parameters (a DTensor's shard on this rank), so a test can
see which stages it runs and how tensor and data parallelism split them, and which parameters are replicated
DTensors (the norms of a sequence-parallel copy)."""

import argparse
import functools
import json

import torch

import tensoropt
from tensoropt.models.transformer import DecoderLM, TransformerConfig, init_weights


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    cfg = TransformerConfig(hidden_size=32, num_layers=4, num_attention_heads=4, ffn_hidden_size=64, seq_length=16,
                            vocab_size=64)
    with tensoropt.meta_init():
        model = DecoderLM(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (args.steps, 8, cfg.seq_length + 1),
                           generator=torch.Generator().manual_seed(1))
    inputs, targets = tokens[..., :-1], tokens[..., 1:]
    adamw = functools.partial(torch.optim.AdamW, lr=1e-3)
    model, _, run = tensoropt.parallelize(model, adamw, example_inputs=(inputs[0, :1], targets[0, :1]), global_batch=8,
                                          init_fn=init_weights)
    losses = [run.train_step((inputs[step], targets[step])) for step in range(args.steps)]
    shapes = {name: list(p.to_local().shape if hasattr(p, "to_local") else p.shape)
              for name, p in model.named_parameters()}
    replicated = sorted(name for name, p in model.named_parameters()
                        if all(type(s).__name__ == "Replicate" for s in getattr(p, "placements", ("plain",))))
    mesh_dims = {name: p.device_mesh.ndim if hasattr(p, "device_mesh") else 0 for name, p in model.named_parameters()}
    if run.rank == 0:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "plan": run.plan and run.plan.summary(), "engine": run.engine,
                       "local_shapes": shapes, "replicated": replicated, "mesh_dims": mesh_dims}, f)
    run.close()


if __name__ == "__main__":
    main()
