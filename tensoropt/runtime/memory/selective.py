"""Selective recomputation of a block copy: every activation autograd saves is kept, except those of
the attention core, which are recomputed in the backward (Korthikanti et al. 2022, sec. 5).

The core is what the cost model drops (``space.block._attention_core``): the ops from a product of two
activations (Q K^T) up to, not including, the next product (P V): scores, scale, mask, softmax, dropout.
It is found while the block runs, by data flow at the ATen level: tensors computed from the block's
inputs are activations (parameters, buffers and their views are not); a matrix product (``mm``, ``bmm``...)
of two activations that are not core starts the core, any other op that reads a core tensor is core,
and a product that reads one (P V) is not. A ``TorchDispatchMode`` records the core's ops on a tape, each
random one with the RNG state it drew from. A ``saved_tensors_hooks`` pair stores every tensor autograd
saves as it is, except those whose storage a core op made: for these it stores only where they lie in
that storage. The first of them the backward needs replays the tape, in place of the forward's (the
same kernels on the same inputs: bitwise the same values, so the gradients are exact), and the replayed
tensors are dropped once the last of them is unpacked. The dispatch mode, a Python call per ATen op, runs in a
copy's first forward only: that forward also learns where in the sequence of saved tensors the core's are and the
ones it reads, and every later forward runs under the saved-tensor hooks alone (``runtime.memory.selective_replay``).

Why not torch's selective activation checkpointing (``create_selective_checkpoint_contexts``): it
caches the output of every op its policy saves, including ones autograd never keeps (the output
projection's and the second MLP product's outputs), so a block would hold more than the plan prices,
or else recompute those products. Here a block holds exactly what it holds without recomputation
minus the core's saved tensors, and recomputes exactly the core's forward, as the plan prices it.

A model with fused attention (SDPA) has no product of two activations to start a core: selective
recomputation keeps everything there, as it is priced (the same as none). A copy learns it from its first forward
with gradients (no core op on its tape) and from then on runs as a plain copy, with neither the dispatch mode (a
Python call per op, tens of microseconds each on a GPU) nor the hooks. The core is found by data flow, not values,
so the same code finds the same core in every forward; a forward whose code takes another path (an attention
implementation chosen per call) would keep its core there, never drop more than priced. The hooks are the innermost
pair while the block runs, so an outer ``saved_tensors_hooks`` (e.g. ``save_on_cpu``) does not see the block's saved
tensors, except that a sequence-parallel copy's pair composes with them (``runtime.parallel.sequence_parallel``: its
gathered inputs reach this pack as their shares).
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from .selective_replay import (
    Input,
    LearnedCore,
    Pack,
    Place,
    Replaying,
    cuda_devices,
    generator_states,
    learn,
    replay,
    rng_state,
    signature,
    storage_key,
    tensors,
)

_aten = torch.ops.aten
# products and the positions of their two matrix operands
_PRODUCTS = {_aten.mm: (0, 1), _aten.bmm: (0, 1), _aten.matmul: (0, 1), _aten.dot: (0, 1), _aten.mv: (0, 1),
             _aten.addmm: (1, 2), _aten.baddbmm: (1, 2), _aten.addbmm: (1, 2)}


def _keys(tree) -> list[StorageWeakRef]:
    """The storages of the tensors in ``tree`` (those that have one)."""
    return [k for k in map(storage_key, tensors(tree)) if k is not None]


def _written(func, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The arguments an op writes into (in-place and ``out=`` variants)."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            out += tensors(value)
    return out


class AttentionCore(Replaying):
    """The attention core of one forward of one block copy: found and taped while it runs (``CoreMode``),
    its saved tensors replaced by places (``pack``), replayed when the backward first needs one (``unpack``)."""

    def __init__(self, learning: bool = False) -> None:
        super().__init__()
        self.activations: set[StorageWeakRef] = set()
        self.made: dict[StorageWeakRef, tuple[int, int]] = {}     # core storage -> (entry, slot) that made it
        self.tape: list[tuple] = []                                 # (op, args, kwargs, RNG state or None)
        self.saved: set[tuple[int, int]] = set()                    # (entry, slot) of the storages packed
        # the first forward of a copy also records what ``selective_replay.learn`` needs: ops run before each tape
        # entry, and every pack
        self.learning, self.ops = learning, 0
        self.tape_ops: list[int] = []
        self.packs: list[Pack] = []

    def mark_inputs(self, tree) -> None:
        self.activations.update(_keys(tree))

    def is_core(self, func, args: tuple, kwargs: dict) -> bool:
        """The rule of the module doc, decided from an op's inputs (so before it runs)."""
        if (operands := _PRODUCTS.get(func.overloadpacket)) is not None:
            keys = [storage_key(args[i]) if i < len(args) and isinstance(args[i], torch.Tensor) else None
                    for i in operands]
            return all(k is not None and k in self.activations and k not in self.made for k in keys)
        if not any(k in self.made for k in _keys((args, kwargs))):
            return False
        # an op writing into a tensor that is not core stays outside (its replay would write into it again)
        return all(k in self.made for k in _keys(_written(func, args, kwargs)))

    def run(self, func, args: tuple, kwargs: dict):
        self.ops += 1
        core = self.is_core(func, args, kwargs)
        rng = None
        if core and torch.Tag.nondeterministic_seeded in func.tags:
            rng = rng_state(tensors((args, kwargs)))
        out = func(*args, **kwargs)
        outputs = tensors(out)
        if not core:
            if any(k in self.activations for k in _keys((args, kwargs))):
                self.activations.update(_keys(outputs))
            return out
        new = [(slot, s) for slot, s in enumerate(map(storage_key, outputs)) if s is not None and s not in self.made]
        if new or func._schema.is_mutable:       # views of core tensors need no replay: places find them
            entry = len(self.tape)
            self.tape.append((func, *tree_map(self._place, (args, kwargs)), rng))
            self.tape_ops.append(self.ops)
            for slot, s in new:
                self.made[s] = (entry, slot)
        return out

    def _place(self, x):
        if not isinstance(x, torch.Tensor):
            return x
        key = storage_key(x)
        if key is not None and (made := self.made.get(key)) is not None:
            return Place(*made, x)
        return Input(x)

    def pack(self, t: torch.Tensor):
        key = storage_key(t)
        made = self.made.get(key) if key is not None else None
        place = Place(*made, t) if made is not None else None
        if self.learning:
            self.packs.append(Pack(self.ops, signature(t), place, generator_states()))
        if place is None:     # kept as autograd keeps it; a tensor with a history detached (it may be the
            return t if t.grad_fn is None else t.detach()     # saving node's output: no reference cycle)
        self.pending += 1
        self.saved.add(made)
        return place

    def _replay(self) -> list[list[torch.Tensor | None]]:
        return replay(self.tape, self.saved, lambda x: x.read() if isinstance(x, Input) else x,
                      lambda entry: self.tape[entry][3], cuda_devices(self.tape))


class CoreMode(TorchDispatchMode):
    """Runs every op of the block and shows it to its ``AttentionCore``."""

    def __init__(self, core: AttentionCore) -> None:
        super().__init__()
        self.core = core

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.core.run(func, args, kwargs or {})


NO_CORE = "_tensoropt_no_attention_core"     # set on a copy whose first forward found no core
LEARNED = "_tensoropt_attention_core_plan"    # a copy's CorePlan, or False where it could not be learned


def selective_checkpoint(module: torch.nn.Module, *args, **kwargs):
    """Run ``module`` keeping all it saves for backward but its attention core (see module doc); the
    ``checkpoint_fn`` of a ``checkpoint_wrapper``, so the block's parameter names stay what they are under
    full recomputation. A copy whose first forward found no core runs plainly from then on, one whose core it
    learned under saved-tensor hooks alone (module doc)."""
    owner = getattr(module, "__self__", module)       # DeepSpeed's engine hands over the copy's bound forward
    if not torch.is_grad_enabled() or getattr(owner, NO_CORE, False):
        return module(*args, **kwargs)
    plan = getattr(owner, LEARNED, None)
    if plan:
        learned = LearnedCore(plan)
        with torch.autograd.graph.saved_tensors_hooks(learned.pack, learned.unpack):
            out = module(*args, **kwargs)
        learned.check()
        return out
    core = AttentionCore(learning=plan is None)
    core.mark_inputs((args, kwargs))
    try:
        with torch.autograd.graph.saved_tensors_hooks(core.pack, core.unpack), CoreMode(core):
            out = module(*args, **kwargs)
    finally:
        core.activations, core.made = set(), {}      # packing is over; the tape and places stay
    if not core.tape:
        setattr(owner, NO_CORE, True)
    elif core.learning:
        setattr(owner, LEARNED, learn(core.tape, core.tape_ops, core.packs, core.saved) or False)
    core.packs = []
    return out


def selective_wrapper(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` wrapped for selective recomputation."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    return checkpoint_wrapper(module, checkpoint_fn=selective_checkpoint)
