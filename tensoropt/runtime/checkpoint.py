"""Sharded, atomic checkpoints of model and optimizer for elastic runs.

Each rank writes its own shards with ``torch.distributed.checkpoint`` (DCP): a checkpoint saved by
2 FSDP2 ranks loads into 1 DDP rank or a plain model, because DCP reshards by parameter name on
load. Atomicity: every rank writes into ``.step-N.partial``; only after all ranks finished does rank 0
rename it to ``step-N`` and then point ``latest.json`` at it (each rename is atomic). A crash at
any moment therefore leaves ``latest.json`` naming a complete checkpoint, or none.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from torch import nn

from ..graph.cache import write_json_atomic

LATEST = "latest.json"
SCHEMA_VERSION = 1
KEEP = 2                                    # complete checkpoints kept (the newest ones)
CRASH_ENV = "TENSOROPT_CRASH_IN_CHECKPOINT"  # fault injection for tests: die mid-save at this step


def _dist():
    import torch.distributed as dist
    return dist if dist.is_initialized() else None


def _barrier() -> None:
    if dist := _dist():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if (dist := _dist()) else 0


def _latest(directory: Path) -> tuple[int, Path] | None:
    """(step, path) of the newest complete checkpoint in ``directory``, as ``latest.json`` names it."""
    try:
        data = json.loads((Path(directory) / LATEST).read_text())
    except (OSError, ValueError):
        return None
    path = Path(directory) / data["path"]
    return (int(data["step"]), path) if path.is_dir() else None


def latest_step(directory: Path) -> int:
    """The step of the newest complete checkpoint in ``directory`` (0: none)."""
    latest = _latest(directory)
    return latest[0] if latest else 0


def _state(model: nn.Module, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _in_model_order(state: dict, model: nn.Module) -> dict:
    """What DCP reads and writes: ``state`` with fused projections held in another feature order by this run
    (``feature_order``) as chunks in the model's own order, so checkpoints reshard onto any plan."""
    from .feature_order import feature_orders, in_model_order_chunks
    orders = feature_orders(model)
    return {key: in_model_order_chunks(value, orders) for key, value in state.items()} if orders else state


def save(directory: Path, step: int, model: nn.Module, optimizer) -> None:
    """Write the state after ``step`` as ``directory/step-N`` and make it the latest (all ranks call)."""
    import torch.distributed.checkpoint as dcp
    directory = Path(directory)
    partial, final = directory / f".step-{step:08d}.partial", directory / f"step-{step:08d}"
    if _rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    _barrier()
    dcp.save(_in_model_order(_state(model, optimizer), model), checkpoint_id=str(partial))
    if os.environ.get(CRASH_ENV) == str(step):
        os._exit(17)                                                   # a worker dies after writing its shards
    _barrier()
    if _rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        write_json_atomic(directory / LATEST, {"schema_version": SCHEMA_VERSION, "step": step, "path": final.name})
        for old in sorted(directory.glob("step-*"))[:-KEEP]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()


def load(directory: Path, model: nn.Module, optimizer) -> int:
    """Load the latest checkpoint into the (already parallelized) model and optimizer; returns its
    step, 0 when there is none. The target's own state dict is the template: DCP fills each rank's
    shards from whatever layout saved them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict
    latest = _latest(directory)
    if latest is None:
        return 0
    step, path = latest
    state = _state(model, optimizer)
    dcp.load(_in_model_order(state, model), checkpoint_id=str(path))     # fills ``state``'s tensors in place
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return step
