"""``--checkpoint-dir``: what the workers are told, and whether the directory has room, checked before training.

A checkpoint holds the model states once whatever the plan shards: the weights the optimizer steps and its states
(``cost.states.checkpoint_bytes``, bytes per parameter in the plan's precision on its engine), plus DCP's overhead:
``HEADER_BYTES`` per item it writes (torch.save's zip record of each, and its entry in ``.metadata``), an item being
each rank's shard of a weight and of AdamW's two moments (at most one per device) and each weight's AdamW step.
On examples/train_gpt.py (210,304 parameters in 52 tensors, bf16-mixed, FSDP2 over 2 workers) that is 3,269,120
bytes for 3,241,052 on disk (tests/test_checkpoint_faults.py holds it within 5%). While
one is written the newest ``--keep-checkpoints`` stay, so the directory must take ``keep + 1`` of them, less those
it already holds (a resumed run replaces them one by one): too little free space is a one-line error before any
worker starts. A disk that fills during the run anyway is the workers' one-line error
(``runtime.checkpoint.sharded``)."""

from __future__ import annotations

import shutil
from pathlib import Path

from tensoropt.cost.states import checkpoint_bytes
from tensoropt.errors import TensorOptError
from tensoropt.graph.ir import OpGraph
from tensoropt.runtime import CHECKPOINT_DIR_ENV, CHECKPOINT_EVERY_ENV, CHECKPOINT_KEEP_ENV
from tensoropt.runtime.checkpoint.files import HEADER_BYTES, KEEP, complete_count
from tensoropt.space.plan import Plan

SHARDED_PER_PARAMETER = 3              # the weight and AdamW's exp_avg and exp_avg_sq: one item per shard


def checkpoint_env(checkpoint_dir: Path, every: int, keep: int = KEEP) -> dict:
    """What tells the workers' runtime where to checkpoint, how often, how many to keep, and to resume from."""
    return {CHECKPOINT_DIR_ENV: str(checkpoint_dir.resolve()), CHECKPOINT_EVERY_ENV: str(every),
            CHECKPOINT_KEEP_ENV: str(keep)}


def size(plan: Plan, graph: OpGraph) -> int:
    """The bytes of one checkpoint of ``graph``'s model trained with ``plan`` (its precision and engine)."""
    per_parameter = checkpoint_bytes(plan.dtype, plan.master_weights, plan.precision, plan.zero, plan.grad_dtype)
    items = len(graph.params) * (SHARDED_PER_PARAMETER * plan.devices + 1)        # + AdamW's step, replicated
    return graph.num_parameters * per_parameter + items * HEADER_BYTES


def _existing(path: Path) -> Path:
    """``path`` or its nearest folder above that exists (the checkpoint folder is made by the workers)."""
    path = path.resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_room(directory: Path, plan: Plan, graph: OpGraph, keep: int, every: int) -> str:
    """The line a launch says about its checkpoints, once the directory has room for them; else a one-line
    ``TensorOptError`` naming the directory, the bytes needed and free, and what to change."""
    each = size(plan, graph)
    held = min(complete_count(directory), keep)
    needed = each * (keep + 1 - held)
    free = shutil.disk_usage(_existing(Path(directory))).free
    kept = f"the newest {keep} kept" if keep > 1 else "only the newest kept"
    if free < needed:
        fewer = " or keep fewer (--keep-checkpoints)" if keep > 1 else ""
        raise TensorOptError(
            f"--checkpoint-dir {directory}: {free:,} bytes free, the checkpoints need {needed:,} ({each:,} bytes "
            f"each, {kept} and one more while it is written" + (f", {held} there already" if held else "") +
            f"): free space there, point --checkpoint-dir at a larger disk{fewer}")
    return (f"checkpoints: every {every} steps into {directory}, {each / 2**20:,.1f} MiB ({each:,} bytes) each, "
            f"{kept}; {free / 2**30:,.1f} GiB free there")


__all__ = ["check_room", "checkpoint_env", "size"]
