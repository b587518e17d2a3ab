"""The attention core's tape replayed in the backward, and a block copy's later forwards run without finding the core
again (``runtime.memory.selective``).

A copy's first forward finds its core with a ``TorchDispatchMode`` (a Python call per ATen op) and learns, besides
its tape, where in the sequence of tensors autograd saves during the forward (the saved-tensor hooks' ``pack`` calls,
the same sequence in every forward of the same code on the same shapes) each core tensor is packed and each tensor
the core reads from outside it (Q, K, the mask) is; and, for a random op of the core (attention dropout), the pack
that comes last before it, which must find the generator where the op drew from (checked on that forward). Every
later forward then runs the copy plainly under a saved-tensor hook pair alone (``CorePlan``): a Python call per
saved tensor, none per op. It drops the core's tensors by their position, keeps the outside ones it will read, and
takes the generator's state at the recorded pack; the backward replays the tape on those. A copy whose core reads
something autograd never saves, or that draws random numbers twice, is not learned: it keeps the dispatch mode in
every forward, as before.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves, tree_map

from ...errors import TensorOptError


def storage_key(t: torch.Tensor) -> StorageWeakRef | None:
    """The storage a tensor's values lie in (a tensor subclass's, e.g. a DTensor's: its local tensor's)."""
    if type(t) is not torch.Tensor and is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return storage_key(getattr(t, names[0])) if names else None
    try:
        return StorageWeakRef(t.untyped_storage())
    except (RuntimeError, NotImplementedError):     # a tensor without storage: neither activation nor core
        return None


class Place:
    """Where a tensor lies in a storage a core op made: output ``slot`` of tape entry ``entry``."""

    __slots__ = ("entry", "slot", "size", "stride", "offset", "dtype")

    def __init__(self, entry: int, slot: int, t: torch.Tensor) -> None:
        self.entry, self.slot = entry, slot
        self.size, self.stride, self.offset, self.dtype = t.size(), t.stride(), t.storage_offset(), t.dtype

    def find(self, outputs: list[list[torch.Tensor | None]]) -> torch.Tensor:
        base = outputs[self.entry][self.slot]
        if base.dtype != self.dtype:
            base = base.view(self.dtype)
        if (base.size(), base.stride(), base.storage_offset()) == (self.size, self.stride, self.offset):
            return base
        return base.as_strided(self.size, self.stride, self.offset)


class Input:
    """A tensor the core reads that no core op made (Q, K, the mask), as the forward read it."""

    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor, self.version = t, t._version

    def read(self) -> torch.Tensor:
        return unchanged(self.tensor, self.version)


def unchanged(tensor: torch.Tensor, version: int) -> torch.Tensor:
    """``tensor``, which the core read at ``version``; refused where it was changed in place since."""
    if tensor._version != version:
        raise TensorOptError("selective recomputation: a tensor the attention core read was changed in place "
                             "after the forward; plan this block with full recomputation instead")
    return tensor


@dataclass(frozen=True)
class Bound:
    """An input of a learned tape: the tensor saved at pack ``index`` of the forward being replayed."""

    index: int


def replay(tape: list[tuple], saved: set[tuple[int, int]], value_of, rng_of,
           cuda_devices: list[int]) -> list[list[torch.Tensor | None]]:
    """The tape run again (``value_of(x)``: an input's tensor, ``rng_of(entry)``: the generator state a random entry
    drew from, or None; ``cuda_devices``: the GPUs whose generators it sets, restored after); of its outputs only what
    the backward unpacks (``saved``) is kept, each other one dropped after its last reader, as the forward would have
    (the working set the plan prices, no more)."""
    last_read: dict[tuple[int, int], int] = {}
    for i, (_, args, kwargs, _) in enumerate(tape):
        last_read.update(((x.entry, x.slot), i) for x in tree_leaves((args, kwargs)) if isinstance(x, Place))
    outputs: list[list[torch.Tensor | None]] = []

    def value(x):
        return x.find(outputs) if isinstance(x, Place) else value_of(x)
    # the taped ops are those autocast already chose: replayed as they are, whatever autocast is on now
    with torch.random.fork_rng(devices=cuda_devices), torch.no_grad(), no_autocast():
        for i, (func, args, kwargs, _) in enumerate(tape):
            if (rng := rng_of(i)) is not None:
                set_rng_state(rng)
            outputs.append(tensors(func(*tree_map(value, args), **tree_map(value, kwargs))))
            for e, slots in enumerate(outputs):
                for slot in range(len(slots)):
                    if (e, slot) not in saved and last_read.get((e, slot), -1) <= i:
                        slots[slot] = None
    return outputs


@dataclass(frozen=True)
class CorePlan:
    """What a copy's later forwards need to drop and replay its core without the dispatch mode (module doc)."""

    tape: tuple[tuple, ...]                 # the core's ops, inputs as ``Bound``
    saved: frozenset[tuple[int, int]]       # (entry, slot) of the storages packed
    packs: int                              # tensors autograd saves in one forward
    dropped: dict[int, Place]               # pack index -> where the core tensor it packs lies
    bound: dict[int, tuple[int, ...]]       # pack index -> shape of an input the core reads
    rng_pack: int | None                    # the pack that finds the generator where the random entry draws from
    rng_entry: int | None
    rng_device: torch.device | None


@dataclass
class Pack:
    """One ``pack`` call of the learning forward: when it came (ops run so far), what it packed, where a core tensor
    lies, and the generators' states then (the CPU's, and the current GPU's where CUDA runs)."""

    ops: int
    key: tuple
    place: Place | None
    rng: dict


def generator_states() -> dict:
    """{device: state} of the generators a random op of the core may draw from."""
    states = {torch.device("cpu"): torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        device = torch.device("cuda", torch.cuda.current_device())
        states[device] = torch.cuda.get_rng_state(device)
    return states


def signature(t: torch.Tensor) -> tuple:
    """What identifies a tensor between the core's reads and autograd's saves: its object, else storage and view."""
    return (storage_key(t), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype) \
        if type(t) is torch.Tensor else (id(t),)


def learn(tape: list[tuple], tape_ops: list[int], packs: list[Pack], saved: set[tuple[int, int]]) -> CorePlan | None:
    """A ``CorePlan`` from the learning forward's tape (each entry's op count), its packs and the places packed; None
    where a later forward could not replay the core from its saves alone (module doc)."""
    where = {}
    for index, pack in enumerate(packs):
        where.setdefault(pack.key, index)
    bound: dict[int, tuple[int, ...]] = {}

    def bind(x):
        if not isinstance(x, Input):
            return x
        index = where.get(signature(x.tensor))
        if index is None:
            raise LookupError
        bound[index] = tuple(x.tensor.shape)
        return Bound(index)
    try:
        template = tuple((func, *tree_map(bind, (args, kwargs)), None) for func, args, kwargs, _ in tape)
    except LookupError:
        return None
    random = [i for i, entry in enumerate(tape) if entry[3] is not None]
    rng_pack = rng_entry = rng_device = None
    if random:
        if len(random) > 1:
            return None
        rng_entry = random[0]
        before = [i for i, pack in enumerate(packs) if pack.ops < tape_ops[rng_entry]]
        drawn = tape[rng_entry][3]
        states = packs[before[-1]].rng if before else {}
        if drawn[0] not in states or not _same(states[drawn[0]], drawn[1]):
            return None
        rng_pack, rng_device = before[-1], drawn[0]
    dropped = {i: pack.place for i, pack in enumerate(packs) if pack.place is not None}
    return CorePlan(template, frozenset(saved), len(packs), dropped, bound, rng_pack, rng_entry, rng_device)


class Replaying:
    """The backward's side of a copy's saved-tensor hooks: the first place unpacked replays the core (``_replay``),
    the others are found in that replay, and the replayed tensors go once the last place is unpacked."""

    def __init__(self) -> None:
        self.replayed: list[list[torch.Tensor | None]] | None = None
        self.pending = 0                    # places packed and not yet unpacked

    def unpack(self, packed) -> torch.Tensor:
        if not isinstance(packed, Place):
            return packed
        if self.replayed is None:
            self.replayed = self._replay()
        out = packed.find(self.replayed)
        self.pending -= 1
        if self.pending <= 0:               # every place is unpacked: the replayed tensors go
            self.replayed, self.pending = None, 0
        return out

    def _replay(self) -> list[list[torch.Tensor | None]]:
        raise NotImplementedError


class LearnedCore(Replaying):
    """One later forward of a learned copy: its saved-tensor hooks (``pack``, ``unpack``) and what its backward's
    replay needs (module doc)."""

    def __init__(self, plan: CorePlan) -> None:
        super().__init__()
        self.plan, self.count = plan, 0
        self.bound: dict[int, tuple[torch.Tensor, int]] = {}
        self.rng: tuple | None = None

    def pack(self, t: torch.Tensor):
        plan, index = self.plan, self.count
        self.count += 1
        if index == plan.rng_pack:
            self.rng = rng_state_of(plan.rng_device)
        place = plan.dropped.get(index)
        if place is not None:
            if t.size() != place.size:
                raise _another_path(index)
            self.pending += 1
            return place
        if index in plan.bound:
            if tuple(t.shape) != plan.bound[index]:
                raise _another_path(index)
            self.bound[index] = (t, t._version)
        return t if t.grad_fn is None else t.detach()

    def _replay(self) -> list[list[torch.Tensor | None]]:
        device = self.plan.rng_device
        replayed = replay(list(self.plan.tape), set(self.plan.saved), self._value,
                          lambda entry: self.rng if entry == self.plan.rng_entry else None,
                          [device.index or 0] if device is not None and device.type == "cuda" else [])
        self.bound = {}                     # the inputs read: autograd keeps its own references to them
        return replayed

    def _value(self, x):
        if not isinstance(x, Bound):
            return x
        return unchanged(*self.bound[x.index])

    def check(self) -> None:
        """After the forward: it saved what the learning forward saved."""
        if self.count != self.plan.packs:
            raise _another_path(self.count)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two generator states are equal; compared outside any fake tensor mode (the memory simulation runs the
    step under one, and generator states are real tensors)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    with unset_fake_temporarily():
        return torch.equal(a, b)


def _another_path(index: int) -> TensorOptError:
    return TensorOptError(f"selective recomputation: a block copy's forward saved tensors other than its first "
                          f"forward did (at the {index + 1}th): its code takes another path now; plan this block "
                          "with full recomputation instead")


def tensors(tree) -> list[torch.Tensor]:
    return [x for x in tree_leaves(tree) if isinstance(x, torch.Tensor)]


def rng_state(tensors_: list[torch.Tensor]) -> tuple:
    return rng_state_of(next((t.device for t in tensors_ if t.device.type == "cuda"), torch.device("cpu")))


def rng_state_of(device: torch.device) -> tuple:
    if device.type == "cuda":
        return device, torch.cuda.get_rng_state(device)
    return device, torch.get_rng_state()


def set_rng_state(state: tuple) -> None:
    device, values = state
    if device.type == "cuda":
        torch.cuda.set_rng_state(values, device)
    else:
        torch.set_rng_state(values)


def no_autocast() -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    for device_type in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
        stack.enter_context(torch.autocast(device_type, enabled=False))
    return stack


def cuda_devices(tape) -> list[int]:
    """The GPUs whose generators a tape's random entries drew from."""
    return sorted({rng[0].index or 0 for *_, rng in tape if rng is not None and rng[0].type == "cuda"})


__all__ = ["Bound", "CorePlan", "Input", "LearnedCore", "Pack", "Place", "Replaying", "cuda_devices",
           "generator_states", "learn", "replay", "rng_state", "set_rng_state", "signature", "storage_key", "tensors",
           "unchanged"]
