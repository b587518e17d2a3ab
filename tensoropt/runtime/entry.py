"""``tensoropt.parallelize`` and what it applies (the package ``tensoropt.runtime`` names it; see its doc)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..errors import TensorOptError
from ..search.engines import CHECKPOINTS, choose_engine
from ..space.run_plan import RunPlan
from . import (
    CAPTURE_ENV,
    CAPTURE_FRESH_ENV,
    CHECKPOINT_DIR_ENV,
    CHECKPOINT_EVERY_ENV,
    CHECKPOINT_KEEP_ENV,
    PLAN_ENV,
    capture_args,
)
from .device import worker_device
from .engines.param_groups import build_optimizer
from .engines.precision import autocast_forward, cast_model
from .engines.precision_names import of_plan
from .memory.check import SIMULATE_ENV, measuring, simulate_mode
from .memory.materialize import InitFn, Materializer, has_meta_tensors, meta_init
from .run import Run, exit_on_checkpoint_error, exit_on_out_of_memory, plain_stepper


class _Captured(SystemExit):
    """Ends a capture-mode run after the graph is written (exit status 0)."""


def parallelize(model: nn.Module, optimizer_fn: Callable[[object], torch.optim.Optimizer] | None = None, *,
                example_inputs: tuple | Mapping | torch.Tensor | None = None, global_batch: int | None = None,
                init_fn: InitFn | None = None) -> tuple[nn.Module, object, Run]:
    """Return (model, optimizer, Run) for the plan this process runs under (see module doc).

    ``init_fn(module)`` initialises a model built on the meta device as ``model.apply(init_fn)`` would on the
    model built for real (after every module's ``reset_parameters()``, see ``materialize``); models built for
    real need none.
    """
    if global_batch is not None and (isinstance(global_batch, bool) or not isinstance(global_batch, int)
                                     or global_batch < 1):
        raise TensorOptError(f"tensoropt.parallelize(global_batch={global_batch!r}): give the samples per iteration, "
                             "a positive integer")
    if os.environ.get(CAPTURE_ENV):
        return _capture_mode(model, optimizer_fn, example_inputs, global_batch)
    if os.environ.get(SIMULATE_ENV):                 # launch --dry-run --check-memory: rank 0's step, fake
        simulate_mode(model, optimizer_fn, example_inputs)
    materializer = Materializer(model, init_fn) if has_meta_tensors(model) else None
    plan_path = os.environ.get(PLAN_ENV)
    if not plan_path:
        return _alone(model, optimizer_fn, global_batch, materializer)
    run_plan = RunPlan.read(plan_path)
    # never run a plan as something else than what was planned: the engine it names must apply all of it
    engine = choose_engine(run_plan.plan, run_plan.engine or None)
    device = worker_device(run_plan)
    with exit_on_out_of_memory(0, int(os.environ.get("RANK", "0"))):     # as in a step: the launcher re-plans
        if engine == "deepspeed":
            if run_plan.plan.ep > 1:          # one line before DeepSpeed starts (runtime.parallel.expert_parallel)
                from .parallel.expert_parallel import check_plan
                check_plan(run_plan.plan, engine, model)
            from .engines.deepspeed_engine import apply
            model, optimizer, run = apply(model, optimizer_fn, run_plan, device, materializer)
        else:
            from .engines.torch_engine import apply
            model, optimizer, run = apply(model, optimizer_fn, run_plan, device, materializer, example_inputs)
    run.model, run.optimizer, run.device = model, optimizer, device
    measuring(run, run.rank)                        # TENSOROPT_MEMORY_OUT: peak tensor memory of a step
    return model, optimizer, _resume(run, engine)


def _alone(model: nn.Module, optimizer_fn, global_batch: int | None, materializer: Materializer | None):
    """The script run by hand: the model as the script made it, trained where its parameters are; a
    meta-built one materialised whole on this process's device."""
    precision = of_plan(None)                   # TENSOROPT_PRECISION: the reference run in a precision
    cast_model(model, precision)
    if materializer is not None:
        materializer.materialize(model, worker_device(None))
    first = next(iter(model.parameters()), None)
    autocast_forward(model, precision, first.device if first is not None else torch.device("cpu"))
    optimizer = build_optimizer(optimizer_fn, model.parameters())
    return model, optimizer, Run(global_batch=global_batch or 0, model=model, optimizer=optimizer,
                                 stepper=plain_stepper(model, optimizer) if optimizer else None,
                                 device=first.device if first is not None else torch.device("cpu"))


def _resume(run: Run, engine: str) -> Run:
    """Checkpoint every ``TENSOROPT_CHECKPOINT_EVERY`` steps into ``TENSOROPT_CHECKPOINT_DIR`` (set by a launch with
    ``--checkpoint-dir``), keeping the newest ``TENSOROPT_CHECKPOINT_KEEP``, and start from the newest whole
    checkpoint there (``checkpoint``); a checkpoint that cannot be loaded ends the worker in one line."""
    directory = os.environ.get(CHECKPOINT_DIR_ENV)
    if not directory:
        return run
    if engine not in CHECKPOINTS:
        raise TensorOptError(f"the {engine} engine does not checkpoint (checkpoints are written with "
                             f"{', '.join(CHECKPOINTS.values())} by the {', '.join(CHECKPOINTS)} engine): run "
                             f"--checkpoint-dir jobs with --engine {next(iter(CHECKPOINTS))}")
    from .checkpoint.sharded import KEEP, load
    run.checkpoint_dir, run.checkpoint_every = directory, int(os.environ.get(CHECKPOINT_EVERY_ENV, "0"))
    run.checkpoint_keep = int(os.environ.get(CHECKPOINT_KEEP_ENV, str(KEEP)))
    with exit_on_checkpoint_error(0, run.rank):
        run.start_step = run.step = load(Path(directory), run.model, run.optimizer)
    return run


def _capture_mode(model: nn.Module, optimizer_fn, example_inputs, global_batch) -> tuple[nn.Module, object, Run]:
    """Capture the model for the launcher (``TENSOROPT_CAPTURE_OUT``): written now, with the loss contract
    checked, and, when the script's first ``run.train_step`` runs under an autocast, captured again in that
    precision (``CaptureRun``); the script ends there, nothing trains."""
    if example_inputs is None or not global_batch:
        raise TensorOptError("tensoropt.parallelize needs example_inputs (one micro-batch) and global_batch for "
                             "the launcher to capture the model")
    from ..graph.precision import active_autocast
    inputs = example_inputs if isinstance(example_inputs, (tuple, Mapping)) else (example_inputs,)
    if active_autocast() is not None:             # parallelize itself runs under the script's autocast
        _write_capture(model, inputs, global_batch)
        raise _Captured(0)
    _write_capture(model, inputs, global_batch, of_plan(None))
    try:
        optimizer = optimizer_fn(model.parameters()) if optimizer_fn else None
    except Exception:                             # an optimizer that cannot be built on meta: the script never steps
        optimizer = None
    capture_args.mark_parallelized()              # later reads change the graph only through the first step
    return model, optimizer, CaptureRun(global_batch=global_batch, model=model, optimizer=optimizer,
                                        capture_inputs=inputs)


def _write_capture(model: nn.Module, inputs: tuple | Mapping, global_batch: int, precision: str | None = None) -> None:
    """Capture the model and write its graph; in ``precision`` (the launcher's ``TENSOROPT_PRECISION``) as the
    engines run it: cast to its weight dtype, and for bf16-mixed traced under a bf16 autocast (the graph's
    ``precision`` meta then tells the launcher the autocast is the engine's, not the script's). In bf16-mixed, or
    under the script's own bf16 autocast, the graph also carries the model traced with bf16 weights, as FSDP2
    and DeepSpeed compute (``graph.precision.with_bf16_weights``)."""
    from ..graph.bf16_meta import with_bf16_weights
    from ..graph.cache import default_cache_dir, write_json_atomic
    from ..graph.precision import active_autocast, weights_in_bf16
    from ..models import example_shape
    from ..space.tp_check import check_tensor_parallel, with_tp_checks
    from ..space.vocab import check_vocab_modules, with_vocab_check
    from .parallel.layout_probe import probe_layouts
    batch, seq = example_shape(inputs)
    meta = {"batch_size": str(batch or ""), "seq_len": str(seq or ""), "global_batch": str(global_batch),
            "sources": json.dumps(_user_sources())} | ({"precision": precision} if precision else {}) | (
        {"meta_built": "1"} if has_meta_tensors(model) else {})      # informational (runtime.pipeline.trace)
    cast_model(model, precision)
    graph = _traced(model, inputs, meta, precision)
    # verdicts of blocks seen before are read from the cache folder (graph.block_verdicts), unless the launch said
    # --no-cache: then every block runs again
    verdicts, sources = default_cache_dir() / "block-verdicts", [path for path, _, _ in json.loads(meta["sources"])]
    if os.environ.get(CAPTURE_FRESH_ENV):
        verdicts = None
    tp = check_tensor_parallel(model, inputs, graph, verdicts, sources)
    # and the runtime's own sharding of each layout it allows
    probed = probe_layouts(model, inputs, with_tp_checks(graph, tp), verdicts, sources)
    checks = probed, check_vocab_modules(model, graph)
    graph = with_vocab_check(with_tp_checks(graph, checks[0]), checks[1])
    if precision == "bf16-mixed" or (precision is None and active_autocast() == torch.bfloat16):
        with weights_in_bf16(model):        # as FSDP2 and DeepSpeed compute (graph.precision)
            bf16 = _traced(model, inputs, meta, precision)
        graph = with_bf16_weights(graph, with_vocab_check(with_tp_checks(bf16, checks[0]), checks[1]))
    write_json_atomic(Path(os.environ[CAPTURE_ENV]), graph.to_json())


def _traced(model: nn.Module, inputs: tuple | Mapping, meta: dict, precision: str | None):
    """The model's graph as the engines run it in ``precision``: bf16-mixed under a bf16 autocast (on GPUs,
    CUDA's: ``graph.precision.engines_autocast``)."""
    from ..graph.capture import trace_module
    from ..graph.precision import engines_autocast
    with engines_autocast(precision):
        return trace_module(model, inputs, type(model).__name__, meta, require_loss=True)


@dataclass
class CaptureRun(Run):
    """The ``Run`` a capture-mode ``parallelize`` returns. Its first ``train_step`` is where the script
    trains as it will in the workers: under an autocast there, the model is captured again in that
    precision. Every step, and any call that would report or save results, ends the capture (exit 0)."""

    capture_inputs: tuple | Mapping = ()

    def train_step(self, batch, local: bool = False, sync: bool = True) -> float:
        from ..graph.precision import active_autocast
        under_autocast = active_autocast() is not None
        capture_args.mark_first_step(under_autocast)
        if under_autocast:
            try:
                _write_capture(self.model, self.capture_inputs, self.global_batch)
            except BaseException:
                Path(os.environ[CAPTURE_ENV]).unlink(missing_ok=True)     # no graph in another precision
                raise
        raise _Captured(0)

    def full_state_dict(self) -> dict:
        raise _Captured(0)

    def device_report(self) -> dict:
        raise _Captured(0)

    def close(self) -> None:
        raise _Captured(0)


def _user_sources() -> list[list]:
    """[path, size, mtime_ns] of the script and every module it loaded from outside the Python
    installation: the launcher reuses a cached capture only while these are unchanged."""
    import sys
    installed = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    files = {os.path.realpath(sys.argv[0])} | {os.path.realpath(m.__file__) for m in list(sys.modules.values())
                                                if getattr(m, "__file__", None)}
    out = []
    for path in sorted(files):
        if any(path.startswith(prefix + os.sep) for prefix in installed) or not os.path.isfile(path):
            continue
        stat = os.stat(path)
        out.append([path, stat.st_size, stat.st_mtime_ns])
    return out


__all__ = ["meta_init", "parallelize"]
