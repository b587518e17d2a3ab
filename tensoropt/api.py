"""The library's front door: ``capture`` a model (cached) and ``fold`` it."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from .graph.bf16_meta import with_bf16_weights
from .graph.cache import CAPTURE_VERSION, GraphCache, fingerprint
from .graph.capture import trace_module
from .graph.fold import FoldedGraph, fold
from .graph.ir import OpGraph
from .graph.precision import active_autocast, engines_autocast, weights_in_bf16
from .models import ModelSource, example_shape, in_dtype, module_identity, resolve_model
from .space.tp_check import check_tensor_parallel, with_tp_checks
from .space.vocab import check_vocab_modules, with_vocab_check

# the weights' dtype a precision captures a --model in (``runtime.engines.precision.parameter_dtype``: bf16-mixed keeps
# float32 master weights and computes under autocast)
WEIGHT_DTYPES = {"bf16-mixed": "float32", "bf16-true": "bfloat16", "32-true": "float32"}


@dataclass(frozen=True)
class Captured:
    """A captured graph and how it was obtained."""

    graph: OpGraph
    capture_seconds: float      # this call: tracing, or loading from the cache
    trace_seconds: float        # what tracing took when the graph was first captured
    cached: bool


def _identity(source: ModelSource, batch_size: int | None, seq_len: int | None) -> dict:
    return {"capture_version": CAPTURE_VERSION, "torch": torch.__version__,
            "source": source.identity(batch_size, seq_len)}


def capture(model: str | nn.Module, example_inputs: tuple | Mapping | None = None, *,
            batch_size: int | None = None, seq_len: int | None = None, name: str | None = None,
            cache: bool = True, cache_dir: Path | None = None, dtype: str | None = None,
            precision: str | None = None) -> Captured:
    """Capture a model into an ``OpGraph`` on the meta device, from the cache when possible.

    ``model`` is a ``--model`` string (preset, JSON config, ``file.py:function``) or an
    ``nn.Module`` with ``example_inputs`` (a tuple of positional or a dict of keyword arguments).
    ``dtype`` (``float32``...) captures a ``--model`` in that precision instead of its own (bf16 for the
    built-in and Hugging Face models). For a module, ``seq_len`` states its sequence length (default: read
    from ``example_inputs``, see ``models.example_shape``); the graph records it, and head counts then
    limit tensor parallelism. Called under ``torch.autocast``, or with a forward that enters one, the ops carry
    the dtypes autocast computes in (``graph.precision``). A ``--model`` string names a model to train: its
    forward must return the loss (``graph.loss``), else a one-line ``CaptureError``.
    ``precision`` (``bf16-mixed``, ``bf16-true``, ``32-true``; a ``--model`` only, instead of ``dtype``) captures it
    as ``tensoropt launch`` captures a script in that precision: weights cast to the precision's (float32 for
    bf16-mixed), and for bf16-mixed traced under a bf16 autocast, once with those float32 weights (DDP, pipeline
    stages) and once with bf16 weights (FSDP2, DeepSpeed: ``graph.precision.with_bf16_weights``); the graph's
    ``precision`` metadata names it, and ``tensoropt.plan`` prices in it by default.
    """
    start = time.perf_counter()
    if precision is not None and (isinstance(model, nn.Module) or dtype is not None):
        raise TypeError("capture(precision=...) takes a --model string and no dtype: capture a module under the "
                        "torch.autocast its training runs under")
    if isinstance(model, nn.Module):
        if example_inputs is None:
            raise TypeError("capture(module) needs example_inputs")
        label = name or type(model).__name__
        batch, seq = example_shape(example_inputs)
        identity = {"capture_version": CAPTURE_VERSION, "torch": torch.__version__,
                    "source": {"kind": "module", **module_identity(model, example_inputs),
                               "batch_size": batch, "seq_len": seq_len or seq}}
        build = lambda: (model, example_inputs)   # noqa: E731
    else:
        source = resolve_model(model)
        label = name or source.name
        weights = WEIGHT_DTYPES[precision] if precision else dtype
        identity = _identity(source, batch_size, seq_len) | ({"dtype": dtype} if dtype else {}) | (
            {"precision": precision} if precision else {})
        build = lambda: in_dtype(*source.build(batch_size, seq_len), weights)   # noqa: E731

    if (autocast := active_autocast()) is not None:     # captured in the autocast's dtype (``graph.precision``)
        identity = identity | {"autocast": str(autocast)}
    key = fingerprint(identity)
    store = GraphCache(cache_dir) if cache else None
    if store is not None and (graph := store.load(key)) is not None:
        return Captured(graph, time.perf_counter() - start, float(graph.meta("trace_seconds", "0")), True)

    module, inputs = build()
    src = identity["source"]
    meta = {"source": label, "torch": torch.__version__, "batch_size": str(src.get("batch_size") or ""),
            "seq_len": str(src.get("seq_len") or "")} | ({"precision": precision} if precision else {})

    def traced():
        # a model named on the command line is one to train: its forward must return the loss (``graph.loss``)
        with engines_autocast(precision):
            graph = trace_module(module, inputs, label, require_loss=not isinstance(model, nn.Module))
        return replace(graph, metadata=tuple(sorted((dict(graph.metadata) | meta).items())))
    graph = traced()
    checks = check_tensor_parallel(module, inputs, graph), check_vocab_modules(module, graph)
    graph = with_vocab_check(with_tp_checks(graph, checks[0]), checks[1])
    if precision == "bf16-mixed":                       # FSDP2 and DeepSpeed compute with bf16 weights
        with weights_in_bf16(module):
            bf16 = traced()
        graph = with_bf16_weights(graph, with_vocab_check(with_tp_checks(bf16, checks[0]), checks[1]))
    seconds = time.perf_counter() - start
    graph = replace(graph, fingerprint=key,
                    metadata=tuple(sorted((dict(graph.metadata) | {"trace_seconds": f"{seconds:.6f}"}).items())))
    if store is not None:
        store.store(key, graph)
    return Captured(graph, seconds, seconds, False)


__all__ = ["Captured", "FoldedGraph", "OpGraph", "capture", "fold"]
