"""A GPT-style training script that measures itself: step times and peak tensor memory per rank.

Run by ``benchmarks/cost_model_accuracy.py`` under ``tensoropt launch --plan``; alone it trains in one
process. Model sizes are arguments so that the benchmark captures (and predicts) exactly the model
that runs. Each rank writes ``OUT/rank<r>.json`` (``--out``, or ``$TENSOROPT_PROBE_OUT``: the benchmark
passes it in the environment so that the script's arguments, and with them the launcher's cached
capture, stay the same from run to run).

The optimizer is AdamW with ``fused=True`` (one kernel per step, which torch has on the CPU too): the
cost model prices the step as one fused pass over the model states; ``--adam loop`` runs torch's
per-parameter default instead, to see what that costs.

Timing: ``--warmup`` steps first (allocation, first-touch of pages, lazy FSDP2 buffers), then the
median of ``--steps`` timed steps. Memory: one more step under torch's ``MemTracker`` (a
TorchDispatchMode that follows every tensor storage's bytes by weak reference; per device, with
FSDP2's storage resizes), so it counts live tensor bytes (weights, gradients, optimizer state,
activations, temporaries, communication buffers) and not the allocator's or the interpreter's
own memory, which is what the cost model's tensor terms predict. The tracker is also active
while ``tensoropt.parallelize`` wraps the model and during the warm-up steps, so buffers made once
(DDP's gradient buckets, built at wrap time and rebuilt in the second step; FSDP2's unsharded
parameters) are counted too. Tracked steps are not timed: the tracker's Python hook on every op
slows them down.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import time
from pathlib import Path

import torch

import tensoropt
from tensoropt.models.transformer import DecoderLM, TransformerConfig
from tensoropt.runtime import CAPTURE_ENV

OUT_ENV = "TENSOROPT_PROBE_OUT"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (their median is reported)")
    parser.add_argument("--adam", choices=("fused", "loop"), default="fused", help="AdamW implementation")
    parser.add_argument("--out", default=os.environ.get(OUT_ENV), help=f"directory for rank<r>.json (${OUT_ENV})")
    return parser.parse_args(argv)


def build_model(args: argparse.Namespace) -> DecoderLM:
    """GPT block (LayerNorm, eager attention with explicit softmax, GELU MLP of 4x hidden), tied
    embeddings, no dropout: the shape of examples/train_gpt.py at benchmark sizes."""
    torch.manual_seed(0)
    cfg = TransformerConfig(hidden_size=args.hidden, num_layers=args.layers, num_attention_heads=args.heads,
                            ffn_hidden_size=4 * args.hidden, seq_length=args.seq_len, vocab_size=args.vocab)
    return DecoderLM(cfg)


def synthetic_batch(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """One global batch of next-token pairs (the same every step: the data does not change the cost)."""
    tokens = torch.randint(0, args.vocab, (args.global_batch, args.seq_len + 1),
                           generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def optimizer_factory(kind: str):
    """AdamW over the parameters tensoropt.parallelize hands over (after DDP / FSDP2 wrapping)."""
    return lambda params: torch.optim.AdamW(params, lr=1e-4, fused=kind == "fused")


def memory_tracker():
    """torch's MemTracker, or None in capture mode (the launcher's capture runs on fake tensors)."""
    if os.environ.get(CAPTURE_ENV):
        return None
    from torch.distributed._tools.mem_tracker import MemTracker
    return MemTracker()


@contextlib.contextmanager
def tracking(tracker, root):
    """Track memory while ``root`` (the model as the engine wrapped it) trains. MemTracker keeps
    per-module statistics of one forward of the root module and refuses a second one, which every
    step and every micro-batch makes; the probe uses only the peak, so those statistics are cleared
    before each root forward (a global hook registered before the tracker's own, so it runs first)."""
    from torch.nn.modules.module import register_module_forward_pre_hook

    def clear(module, _inputs) -> None:
        if module is root:
            tracker.reset_mod_stats()
    handle = register_module_forward_pre_hook(clear)
    try:
        with tracker:
            yield
    finally:
        handle.remove()


def tracked_peak(tracker, run, batch) -> dict:
    """Peak live tensor bytes on the CPU during one training step, with MemTracker's breakdown at
    that peak (Parameter, Buffer, Gradient, Activation, Temp, Optstate, Other)."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY
    tracker.track_external(run.model, run.optimizer)
    with tracking(tracker, run.model):
        run.train_step(batch)
    snapshot = tracker.get_tracker_snapshot("peak").get(torch.device("cpu"), {})
    breakdown = {getattr(k, "value", k): int(v) for k, v in snapshot.items() if k != _TOTAL_KEY}
    return {"peak_memory_bytes": int(snapshot.get(_TOTAL_KEY, 0)), "memory_breakdown_bytes": breakdown}


def timed_steps(run, batch, steps: int) -> tuple[list[float], list[float]]:
    """(wall seconds, process CPU seconds) of each step. A step
    ends with the loss's all-reduce over the data-parallel ranks, so every rank's clock covers the
    whole step. CPU time well below wall time in a one-worker run means the worker waited for a core
    (a busy machine): the wall time then overstates the step."""
    wall, cpu = [], []
    for _ in range(steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        run.train_step(batch)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return wall, cpu


def main() -> None:
    args = parse_args()
    model = build_model(args)
    inputs, targets = synthetic_batch(args)
    batch = (inputs, targets)
    tracker = memory_tracker()
    if tracker is not None:
        tracker.track_external(model)
    with tracker if tracker is not None else contextlib.nullcontext():     # buffers made once are made here
        model, optimizer, run = tensoropt.parallelize(model, optimizer_factory(args.adam),
                                                      example_inputs=(inputs[:1], targets[:1]),
                                                      global_batch=args.global_batch)
    with tracking(tracker, run.model):
        for _ in range(args.warmup):
            run.train_step(batch)
    wall, cpu = timed_steps(run, batch, args.steps)
    memory = tracked_peak(tracker, run, batch)
    result = {"rank": run.rank, "world_size": run.world_size, "plan": run.plan and run.plan.summary(),
              "engine": run.engine, "adam": args.adam, "step_times_s": wall, "step_cpu_times_s": cpu,
              "median_step_s": statistics.median(wall), "median_step_cpu_s": statistics.median(cpu),
              "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
              "threads": torch.get_num_threads(), **memory}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"rank{run.rank}.json").write_text(json.dumps(result, indent=1) + "\n")
    else:
        print(json.dumps(result))
    run.close()


if __name__ == "__main__":
    main()
