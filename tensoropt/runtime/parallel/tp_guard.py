"""Before training: does each sharded block compute what the whole block computes? A one-line error if not.

The planner only offers tensor parallelism over branches whose data flow it understands and whose code ran on
one rank's share of features at capture (``space.fused``, ``space.tp_check``), but neither sees values: a
fused projection read in an order the analysis got wrong would train, silently, to other losses. So before
the model is sharded, the first copy of every block the plan shards is run twice on the same small input, on
a real full-size copy of that block with arbitrary (seeded, identical on every rank) weights: once whole and
once sharded exactly as the model will be (``tensor_parallel.shard_copy``). The outputs must agree to float32
rounding. The block's inputs are those the model's forward hands it, found by a forward on fake tensors up to
that block; floating-point inputs are filled with random numbers, integer ones with zeros and masks with
True, which is enough to tell a correct layout (equal up to rounding) from a wrong one (different everywhere).
It costs one block copy in float32 for a moment, before the model itself is given memory.

A block the plan runs sequence-parallel is also run that way (``sequence_parallel``: its stream split along the
sequence, entered and left whole): code outside the branches that mixes positions, which the planner's analysis
(``space.sp_check``) should have refused, gives other outputs there, or fails inside DTensor, and stops the run.
Failures that need no values (DTensor refusing an op, autograd refusing an in-place op) are found earlier, at
capture, where the launcher runs every layout it may offer on fake tensors (``layout_probe``) and offers none
that fails; what is left here is values.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy as copying
from collections.abc import Iterator, Mapping

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_map

from ...errors import TensorOptError
from ...space.run_plan import Branches
from .tp_styles import shard_copy

RELATIVE_TOLERANCE = 1e-4        # float32 rounding of a reordered sum is ~1e-7; a wrong layout is ~1
SEED = 0
_CHECKING = contextvars.ContextVar("tp_guard_checking", default=True)


@contextlib.contextmanager
def unchecked() -> Iterator[None]:
    """Within, ``check_sharded_blocks`` checks nothing: for the memory simulation (``memory_check``), whose fake
    tensors and fake process group have no values to compare; the real run of the same plan checks."""
    token = _CHECKING.set(False)
    try:
        yield
    finally:
        _CHECKING.reset(token)


def check_sharded_blocks(model: nn.Module, example_inputs, first_copies: dict[str, tuple[str, Branches]],
                         tp_mesh, device: torch.device, sp_layouts: dict[str, Branches] | None = None) -> None:
    """Raise a one-line error naming the block and branches whose sharded output differs from the whole one.
    ``first_copies``: {block: (module name of its first copy, the branches the plan shards in it)};
    ``sp_layouts``: {block: all its branches} of the blocks the plan runs sequence-parallel, checked that way too."""
    if not _CHECKING.get():
        return
    sp_layouts = sp_layouts or {}
    from ...space.tp_check import first_copy_inputs
    inputs = example_inputs if isinstance(example_inputs, (tuple, Mapping)) else (example_inputs,)
    found = first_copy_inputs(model, inputs, {name for name, _ in first_copies.values()},
                              FakeTensorMode(allow_non_fake_inputs=True), device)
    for block, (name, branches) in first_copies.items():
        if name not in found:
            raise TensorOptError(f"the model's forward never calls {name}, the first copy of block {block!r} the plan "
                                 "shards: the plan was made for another model")
        args, kwargs = _real(found[name], device)
        whole = _probe(model.get_submodule(name), device)
        if block in sp_layouts:
            _check_sequence_parallel(whole, name, branches, sp_layouts[block], tp_mesh, args, kwargs)
        if not branches or _sharded_difference(whole, branches, tp_mesh, args, kwargs) <= RELATIVE_TOLERANCE:
            continue
        wrong = [b for b in branches if _sharded_difference(whole, (b,), tp_mesh, args, kwargs) > RELATIVE_TOLERANCE]
        names = ", ".join(f"{b.branch} ({'+'.join(b.column)} -> {'+'.join(b.row)})" for b in wrong or branches)
        raise TensorOptError(
            f"tensor parallelism over {tp_mesh.size()} devices changes what {name} computes: the sharded layout of "
            f"{names} does not match how the model's code reads its projections (checked on a test input before "
            "training); plan this model with --tp 1")


def _check_sequence_parallel(whole: nn.Module, name: str, branches: Branches, layout: Branches, tp_mesh,
                             args: tuple, kwargs: dict) -> None:
    """The copy run sequence-parallel (its stream split along dim 1, ``sequence_parallel``) must compute what the
    whole one does: a block whose code outside the branches mixes positions, or reads the stream with anything
    but per-token ops, fails here (or raises inside DTensor, which says the same)."""
    why = ""
    try:
        difference = _sharded_difference(whole, branches, tp_mesh, args, kwargs, layout)
    except TensorOptError:
        raise
    except Exception as exc:     # the model's code failing on a sequence share is the finding
        difference, why = float("inf"), f" ({type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]})"
    if difference > RELATIVE_TOLERANCE:
        raise TensorOptError(
            f"sequence parallelism over {tp_mesh.size()} devices changes what {name} computes{why}: its ops outside "
            "the tensor-parallel branches do not run on a share of the sequence (checked on a test input before "
            "training); plan this model without sequence parallelism")


def _sharded_difference(whole: nn.Module, branches: Branches, tp_mesh, args: tuple, kwargs: dict,
                        sp_layout: Branches | None = None) -> float:
    """The relative difference between ``whole``'s output and that of a copy with ``branches`` sharded (and run
    sequence-parallel, entered and left with the whole sequence, with ``sp_layout``)."""
    sharded = copying.deepcopy(whole)
    shard_copy(sharded, branches, tp_mesh, sp_layout, "the sequence-parallel probe")
    with torch.no_grad():
        return _difference(sharded(*args, **kwargs), whole(*args, **kwargs))


def _probe(module: nn.Module, device: torch.device) -> nn.Module:
    """A real float32 copy of ``module`` in eval mode (no dropout) with seeded weights: its parameters, and
    buffers that have no values yet, are random; buffers with values keep them (masks, rotary tables)."""
    generator = torch.Generator().manual_seed(SEED)
    probe = copying.deepcopy(module)

    def fill(t: torch.Tensor) -> torch.Tensor:
        if not t.is_meta and not isinstance(t, nn.Parameter):
            return t.to(device)
        return _random_like(t, generator, scale=t.shape[-1] ** -0.5 if t.dim() > 1 else 1.0).to(device)
    probe._apply(fill)
    return probe.float().eval()


def _random_like(t: torch.Tensor, generator: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    if t.dtype == torch.bool:
        return torch.ones(t.shape, dtype=torch.bool)
    if not (t.is_floating_point() or t.is_complex()):
        return torch.zeros(t.shape, dtype=t.dtype)
    dtype = t.dtype if t.is_complex() else torch.float32
    return torch.randn(t.shape, generator=generator, dtype=dtype) * scale


def _real(inputs: tuple, device: torch.device) -> tuple:
    """Real tensors, seeded, in place of the fake ones a block was called with."""
    generator = torch.Generator().manual_seed(SEED + 1)
    return tree_map(lambda x: _random_like(x, generator).to(device) if isinstance(x, torch.Tensor) else x, inputs)


def _difference(got, want) -> float:
    """The largest relative difference between two outputs' floating-point tensors (inf if they do not match up)."""
    got_leaves, got_spec = tree_flatten(got)
    want_leaves, want_spec = tree_flatten(want)
    if got_spec != want_spec:
        return float("inf")
    worst = 0.0
    for a, b in zip(got_leaves, want_leaves):
        if not isinstance(b, torch.Tensor) or not b.is_floating_point():
            continue
        a = a.full_tensor() if hasattr(a, "full_tensor") else a
        if a.shape != b.shape:
            return float("inf")
        worst = max(worst, float((a - b).norm() / b.norm().clamp_min(1e-12)))
    return worst


__all__ = ["check_sharded_blocks", "unchecked"]
