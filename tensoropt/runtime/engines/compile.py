"""Compiled blocks (``tensoropt launch --compile``, plan.json ``"compile": true``): every copy of the plan's
repeated blocks (each transformer layer, say) runs under ``torch.compile``; the ops outside them (embedding,
final norm, head, loss) stay eager, and the cost model prices them so (``cost.model.ModelCost.loose``).

Compiling per block rather than the whole model is torchtitan's choice, for the same reasons: the copies are
one code object with parameters of one shape, so dynamo traces and inductor compiles the block once and every
other copy reuses that graph (dynamo treats a module's parameters as graph inputs, not constants:
``torch._dynamo.config.inline_inbuilt_nn_modules``), and the embedding and head, which break graphs in many
user models, stay out of the compiled region.

Order (``torch_engine.apply``; ``pipeline.stages.apply_pipeline`` the same within each stage module this rank holds, the
copies named as in the whole model), as torchtitan applies it: tensor parallelism and recomputation first, so the
compiled region holds the checkpointed block (``torch.utils.checkpoint`` is traced as one higher-order op);
then compilation, which wraps each copy in an ``OptimizedModule``; data parallelism last, so that DDP's
gradient hooks and FSDP2's all-gathers and reduce-scatters (its module hooks, on the wrapper) run eagerly
around the compiled block, as they are priced. The wrapper puts ``_orig_mod.`` into parameter names;
``names.script_name`` takes it out again wherever values move between the script's model and the run.

``fullgraph=True``: a block that dynamo cannot trace whole fails at its first forward instead of running
partly eager under a price that assumed it compiled (what is planned is what runs).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from ...space.plan import Plan
from ..blocks import block_modules, replace_module


def compiled_modules(model: nn.Module, plan: Plan) -> list[str]:
    """The block copies of ``model`` that ``plan`` runs compiled: all of them, or none."""
    return block_modules(model, plan) if plan.compile else []


def apply_compile(model: nn.Module, plan: Plan, names: list[str] | None = None) -> int:
    """Wrap every block copy of ``plan`` in ``model`` with ``torch.compile`` (module doc), or only ``names``
    (a pipeline stage's copies, named as in the whole model); the copies compiled. Nothing compiles until a
    copy's first forward."""
    names = compiled_modules(model, plan) if names is None else names
    for name in names:
        replace_module(model, name, lambda module: torch.compile(module, fullgraph=True))
    return len(names)


def compile_report(model: object) -> dict:
    """What compiled in this process: ``compiled_block_copies`` (modules wrapped by ``apply_compile``) and
    ``dynamo_graphs``, the graphs dynamo captured, a recompilation included: one per distinct block when every
    copy reuses the first copy's graph. Both 0 for an eager run, which never imports dynamo (its import takes
    seconds; ``torch.compile`` imports it)."""
    dynamo = sys.modules.get("torch._dynamo.utils")
    graphs = dynamo.counters["stats"].get("unique_graphs", 0) if dynamo is not None else 0
    modules = model.modules() if isinstance(model, nn.Module) else ()
    return {"compiled_block_copies": sum(hasattr(m, "_orig_mod") and hasattr(m, "dynamo_ctx") for m in modules),
            "dynamo_graphs": int(graphs)}


__all__ = ["apply_compile", "compile_report", "compiled_modules"]
