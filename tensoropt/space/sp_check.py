"""Can a block's stream run on a share of the sequence? (Sequence parallelism, Korthikanti et al. 2022, sec. 4.2.2.)

Under sequence parallelism every op outside the tensor-parallel branches that the carried stream reaches runs on
the rank's ``1/tp`` of the sequence (dim 1 of a batch-first tensor, ``runtime.parallel.sequence_parallel``). That gives
the whole block's result only when each of those ops treats every position on its own: pointwise ops (residual
adds, scales, activations), norms over the hidden features, dropout, reductions that keep (batch, sequence), dtype
casts. Anything else there (a softmax, attention or convolution outside a branch, a cumulative sum, a
concatenation, an op moving the sequence dimension) mixes positions, so the planner never offers the block
sequence parallelism; the same holds where the stream is not batch-first (its dim 1 is not the sequence).

Branches whose column -> row shape was refused (``space.block``'s ``refused``) are not branches here: their ops
count as the stream's, so e.g. an attention the runtime cannot shard refuses sequence parallelism too (the
runtime would otherwise run it on a share of the sequence).
"""

from __future__ import annotations

from pathlib import Path

from ..graph.ir import Op
from .pointwise_table import POINTWISE

# a block's entry in the capture checks (``space.tp_meta.TP_CHECKS_META``): the runtime's run of its first copy
# sequence-parallel on fake tensors (``runtime.parallel.layout_probe``), {"max_tp": m} | {"refused": why}; no branch is
# named so
SP_CHECK_KEY = "<sequence parallelism>"

# reductions that, when they keep (batch, sequence), reduce over features only
PER_TOKEN_REDUCTIONS = {"sum", "mean", "amax", "amin", "var", "var_mean", "std", "norm", "linalg_vector_norm",
                        "max", "min", "logsumexp", "prod"}
SAME_SHAPE_COPIES = {"_to_copy", "clone", "copy_"}


def sequence_refusal(ops: tuple[Op, ...], in_branch: set[int], seq_len: int | None) -> str:
    """Why the stream of a block template (sources coded local/prev) cannot be split along dim 1; "" if it can."""
    if not seq_len:
        return "the captured graph does not record the sequence length"
    carried = {(r.index, r.slot) for op in ops for r in op.sources if r.kind == "prev"}
    if not carried:
        return "the block carries no stream from the previous copy"
    for j, slot in sorted(carried):
        shape = ops[j].outputs[slot].shape
        if len(shape) < 2 or shape[1] != seq_len:
            return (f"its carried input {list(shape)} is not batch-first with the sequence ({seq_len}) in dim 1")
    reached = _downstream_of_stream(ops)
    for i in sorted(reached - in_branch):
        if why := _not_per_token(ops[i], seq_len):
            return f"{ops[i].module_path or 'the block'} runs {ops[i].target} outside its tensor-parallel branches, " \
                   f"which {why}"
    return ""


def _downstream_of_stream(ops: tuple[Op, ...]) -> set[int]:
    """Ops the carried stream reaches (through any op, branches included: their outputs are stream again)."""
    reached: set[int] = set()
    for op in ops:
        if any(r.kind == "prev" or (r.kind == "local" and r.index in reached) for r in op.sources):
            reached.add(op.index)
    return reached


def _not_per_token(op: Op, seq_len: int) -> str:
    """Why ``op`` may mix sequence positions (or not see the sequence in dim 1); "" if it treats each on its own."""
    name = op.target.split(".")[1] if op.target.count(".") >= 2 else op.target
    tensors = [m for m in op.outputs if len(m.shape) > 0]
    if any(len(m.shape) < 2 or m.shape[1] != seq_len for m in tensors):
        return "does not keep the sequence in dim 1"
    if op.kind in ("norm", "dropout", "factory"):
        return ""
    if op.kind == "reduction":
        inputs = [m for m, r in zip(op.inputs, op.sources) if r.kind in ("local", "prev")]
        if name in PER_TOKEN_REDUCTIONS and all(m.shape[:2] == t.shape[:2] for m in inputs for t in tensors):
            return ""
        return "reduces across positions"
    if op.kind == "copy":
        return "" if name in SAME_SHAPE_COPIES and all(m.shape == tensors[0].shape for m in op.inputs) else \
            "moves values between positions"
    if op.kind == "elementwise" and _pointwise(op.target):
        return ""
    return "may mix positions (not a pointwise op, norm, dropout or per-token reduction)"


def _pointwise(target: str) -> bool:
    """Whether ATen tags the overload ``pointwise`` (its output element i depends on input elements i only): read from
    ``pointwise_table``, ATen's tags written out, so that planning a captured graph needs no torch."""
    return target in POINTWISE


def tagged_pointwise() -> frozenset[str]:
    """The aten and prims overloads the installed torch tags ``pointwise`` (what ``pointwise_table`` holds).

    Only the prims that ``torch._prims`` itself defines count: other modules register more in that namespace when
    they are imported (inductor's ``prims.fma``), so the registry's contents depend on what a process imported
    before; a capture never records those."""
    import torch
    import torch._prims

    own_prims = set(torch._prims.__all__)
    names = set()
    for full in torch._C._dispatch_get_all_op_names():
        namespace, _, rest = full.partition("::")
        if namespace not in ("aten", "prims"):
            continue
        name, _, overload = rest.partition(".")
        if namespace == "prims" and name not in own_prims:
            continue
        try:
            op = getattr(getattr(getattr(torch.ops, namespace), name), overload or "default")
        except (AttributeError, RuntimeError):
            continue
        if torch.Tag.pointwise in op.tags:
            names.add(f"{namespace}.{name}.{overload or 'default'}")
    return frozenset(names)


def write_pointwise_table() -> None:
    """Rewrite ``pointwise_table.py`` from the installed torch (``python -m tensoropt.space.sp_check``)."""
    import torch

    path = Path(__file__).with_name("pointwise_table.py")
    names = "\n".join(f"    {n!r}," for n in sorted(tagged_pointwise()))
    path.write_text(f'''"""ATen's pointwise overloads, as torch {torch.__version__} tags them (``torch.Tag.pointwise``):
written by ``python -m tensoropt.space.sp_check`` (do not edit); tests/test_space.py compares it with the installed
torch."""

TORCH_VERSION = {torch.__version__!r}
POINTWISE = frozenset({{
{names}
}})
''')


__all__ = ["SP_CHECK_KEY", "sequence_refusal", "tagged_pointwise", "write_pointwise_table"]


if __name__ == "__main__":
    write_pointwise_table()
