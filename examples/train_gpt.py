"""A GPT-style training script on synthetic data: runs alone (one process) or under
``tensoropt launch examples/train_gpt.py --device cpu --gpus 2 -- --steps 5``.

The TensorOpt lines are ``tensoropt.parallelize`` (it hands the launcher the model to plan, and in the
workers applies the chosen plan and puts the model on the worker's device) and ``run.train_step`` (one
step, driven the way the plan's engine needs; it moves the batch to the device). The data is
deterministic, so a launched run's losses can be compared with this script run by hand.

``--meta`` builds the model on the meta device (``tensoropt.meta_init()``: no memory for parameters); each
worker then gets storage for its own shard only, initialised as ``model.apply(init_weights)`` on the model
built for real: the same values under every plan as this script run alone, with ``--meta`` or without.

``--local-data`` hands each step only this rank's rows of the global batch (``run.local_rows()``, with
``local=True``: a script reading a dataset would load only those) and takes the loss as a tensor without reading it
back each step (``sync=False``), reading it where it logs (``--log-every``) and at the end.
"""

import argparse
import contextlib
import functools
import itertools
import json
import time

import numpy as np
import torch

import tensoropt
from tensoropt.models.transformer import DecoderLM, TransformerConfig, init_weights


def batches(vocab: int, global_batch: int, seq_len: int, generator: torch.Generator):
    """Each step's (tokens, next tokens to predict), deterministic."""
    while True:
        tokens = torch.randint(0, vocab, (global_batch, seq_len + 1), generator=generator)
        yield tokens[:, :-1], tokens[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--out", default=None, help="write the per-step losses (JSON) here")
    parser.add_argument("--save-params", default=None, help="write the final parameters here (.npy, flattened)")
    parser.add_argument("--pause-s", type=float, default=0.0, help="sleep after each step (to watch or interrupt)")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--meta", action="store_true", help="build on the meta device; workers materialise shards")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--foreach", action="store_true",
                        help="AdamW's foreach kernels, CUDA's default (the CPU's is one tensor at a time)")
    parser.add_argument("--local-data", action="store_true",
                        help="pass each step this rank's rows only, and read the loss back only when logging")
    parser.add_argument("--log-every", type=int, default=1, help="print the loss every N steps (rank 0)")
    args = parser.parse_args()

    torch.manual_seed(0)
    cfg = TransformerConfig(hidden_size=args.hidden, num_layers=args.layers, num_attention_heads=args.heads,
                            ffn_hidden_size=4 * args.hidden, seq_length=args.seq_len, vocab_size=args.vocab)
    with tensoropt.meta_init() if args.meta else contextlib.nullcontext():
        model = DecoderLM(cfg).to(getattr(torch, args.dtype))
    # each step's batch drawn when it comes (the tokens of drawing all steps' at once), so that the launcher's capture,
    # which ends at the first step, does not read --steps: a launch with other --steps reuses it
    stream = batches(cfg.vocab_size, args.global_batch, args.seq_len, torch.Generator().manual_seed(1))
    first = next(stream)
    example = (first[0][:1], first[1][:1])                             # one sample, for the planner
    adamw = functools.partial(torch.optim.AdamW, lr=1e-3, foreach=args.foreach or None)   # called on the parameters
    model, optimizer, run = tensoropt.parallelize(model, adamw, example_inputs=example, global_batch=args.global_batch,
                                                  init_fn=init_weights)   # used for tensors built on meta only
    rows = run.local_rows() if args.local_data else range(args.global_batch)   # this rank's rows, or all
    losses, step_times = [], []
    steps = range(run.start_step, args.steps)                          # a resumed run starts at its checkpoint
    for step, (inputs, targets) in zip(steps, itertools.islice(itertools.chain([first], stream), steps.start, None)):
        start = time.perf_counter()
        batch = (inputs[rows.start:rows.stop], targets[rows.start:rows.stop])
        # the model returns the loss; with --local-data it stays a tensor on the device until read
        losses.append(run.train_step(batch, local=args.local_data, sync=not args.local_data))
        step_times.append(time.perf_counter() - start)
        if run.rank == 0 and step % args.log_every == 0:
            print(f"step {step} loss {float(losses[-1]):.6f}", flush=True)
        time.sleep(args.pause_s)
    losses = [float(loss) for loss in losses]
    if args.save_params:
        params = run.full_state_dict()                                 # gathered on every rank
        if run.rank == 0:
            np.save(args.save_params, torch.cat([params[k].detach().float().cpu().flatten()
                                                 for k in sorted(params)]).numpy())
    if run.rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "plan": run.plan and run.plan.summary(), "engine": run.engine,
                       "step_times_s": step_times} | run.device_report(), f)
    run.close()


if __name__ == "__main__":
    main()
