"""Peak tensor memory of one training step, by category, counted the same way on real and fake tensors.

``StepMemory`` is a ``TorchDispatchMode``: every tensor an op returns has its storages counted while they
live (a weak reference per storage; ``UntypedStorage.resize_``, which FSDP2 uses to allocate and free its
gathered parameters, is followed too), so the live total is the bytes of tensors this process holds, what
``torch.cuda.max_memory_allocated`` counts on a GPU less the allocator's rounding. It is the same count on
a real CPU run (``TENSOROPT_MEMORY_OUT``, see ``memory_check``) and on the fake-tensor simulation of the step,
so the two can be compared exactly.

Categories are decided at the end of the step, for the storages live at the peak: parameters (the
model's parameters and buffers as this rank holds them, FSDP2's gathered copies included), gradients
(``.grad`` of the parameters, DDP's buckets that they view, FSDP2's sharded gradients), optimizer states,
activations (made in a forward and not one of the above: what autograd saved, and the forward's
temporaries) and temporaries (made in a backward or optimizer step: gradients before they are reduced,
recomputed activations, communication buffers). Storages made before tracking began count only once
``register`` names them. A DeepSpeed optimizer that offloads keeps its states in host memory: those are
``offloaded`` (``runtime.engines.deepspeed_tensors``), counted in the peak like the rest (on a CPU run every tensor is
in the same memory) and given apart so that the device's share can be read.

Torch ships a similar tracker (``torch.distributed._tools.mem_tracker.MemTracker``); this one is kept
small and hookless (no module hooks to interfere with the engines' wrappers) and reports the categories
the planner prices (``tensoropt.cost.model``: parameters, gradients, optimizer, activations, other).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporaries")
LARGEST_COUNT = 12        # the storages ``largest_at_peak`` names by default


def storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages holding a tensor's data: its own, or its inner tensors' for a wrapper (a DTensor's local
    shard)."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return [s for n in names if isinstance(inner := getattr(t, n), torch.Tensor) for s in storages(inner)]
    try:
        return [t.untyped_storage()]
    except (RuntimeError, NotImplementedError):        # a tensor without storage (sparse, nested)
        return []


def _phase() -> str:
    """The phase an allocation belongs to: inside autograd's backward, or else the forward."""
    return "backward" if torch._C._current_graph_task_id() != -1 else "forward"


def _metadata_only(tracker: StepMemory):
    """Stop counting while DTensor's sharding propagation runs: it runs the op on fake tensors of the global
    shape to learn the output's metadata (``ShardingPropagator._propagate_tensor_meta_non_cached``, "it is not
    part of the real (local) computation"), which allocates nothing on the device. On the simulation's fake
    tensors they would be counted: the global float32 log-softmax of a vocabulary-parallel loss, twice, at the
    forward's peak (2 x 1.96 GiB for a 128256-token vocabulary at 4096 positions). Returns what ``_restore``
    puts back."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def propagate(self, *args, **kwargs):
        tracker._shadowing += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            tracker._shadowing -= 1
    ShardingPropagator._propagate_tensor_meta_non_cached = propagate
    return original


def _restore(original) -> None:
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    ShardingPropagator._propagate_tensor_meta_non_cached = original


class StepMemory(TorchDispatchMode):
    """Count live tensor bytes (module doc). ``reset_peak()`` starts a new peak; ``breakdown()`` gives the
    latest peak by category once the model's tensors are ``register``-ed by role."""

    def __init__(self) -> None:
        super().__init__()
        self._serials = itertools.count()
        self._seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # storage -> serial
        self._live: dict[int, int] = {}          # serial -> bytes
        self._phase_of: dict[int, str] = {}      # serial -> phase it was made in
        self._role: dict[int, str] = {}          # serial -> parameters / gradients / optimizer
        self._made_by: dict[int, tuple] = {}     # serial -> (op or None, shape, dtype) of the tensor first seen in it
        self.live_bytes = self.peak_bytes = 0
        self._peak_serials: dict[int, int] = {}
        self.optimizer_phase = False
        self._resize = torch.UntypedStorage.resize_
        self._shadowing = 0                      # > 0 inside DTensor's sharding propagation (``_metadata_only``)

    # -- counting -------------------------------------------------------------------------------------
    def _add(self, storage: torch.UntypedStorage, phase: str) -> int:
        serial = self._seen.get(storage)
        if serial is None:
            serial = next(self._serials)
            self._seen[storage] = serial
            self._phase_of[serial] = phase
            weakref.finalize(storage, self._free, serial)
        self._set(serial, storage.nbytes())
        return serial

    def _set(self, serial: int, nbytes: int) -> None:
        self.live_bytes += nbytes - self._live.get(serial, 0)
        self._live[serial] = nbytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
            self._peak_serials = dict(self._live)

    def _free(self, serial: int) -> None:
        self.live_bytes -= self._live.pop(serial, 0)

    def reset_peak(self) -> None:
        self.peak_bytes, self._peak_serials = self.live_bytes, dict(self._live)

    def register(self, role: str, tensors: Iterable[torch.Tensor | None]) -> None:
        """Count these tensors' storages (made before tracking or not) and give them ``role``."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                for s in storages(t):
                    serial = self._add(s, "forward")
                    self._role[serial] = role
                    self._made_by.setdefault(serial, (None, t.shape, t.dtype))

    # -- the dispatch mode ----------------------------------------------------------------------------
    def __enter__(self):
        tracker, resize = self, self._resize

        def counted_resize(storage: torch.UntypedStorage, size: int):
            out = resize(storage, size)
            serial = tracker._seen.get(storage)
            if serial is not None:
                tracker._set(serial, storage.nbytes())
            elif size:
                tracker._add(storage, tracker._current_phase())
            return out
        torch.UntypedStorage.resize_ = counted_resize
        self._propagate = _metadata_only(self)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        _restore(self._propagate)
        return super().__exit__(*exc)

    def _current_phase(self) -> str:
        return "optimizer" if self.optimizer_phase else _phase()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented                # DTensor runs first; its local ops come back here
        from torch._subclasses.fake_tensor import FakeTensor
        if func is torch.ops._c10d_functional.wait_tensor.default and isinstance(args[0], FakeTensor):
            out = args[0]                        # eager waits return their input; the fake kernel makes a copy
        else:
            out = func(*args, **(kwargs or {}))
        if self._shadowing:
            return out
        phase = self._current_phase()
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                for s in storages(t):
                    serial = self._add(s, phase)
                    if serial not in self._made_by:      # named when the report asks (``largest_at_peak``)
                        self._made_by[serial] = (func, t.shape, t.dtype)
        return out

    # -- the result -----------------------------------------------------------------------------------
    def breakdown(self) -> dict[str, int]:
        """Bytes live at the latest peak, by category (module doc), and their total ``peak_bytes``."""
        out = dict.fromkeys(CATEGORIES, 0)
        for serial, nbytes in self._peak_serials.items():
            role = self._role.get(serial)
            if role is None:
                role = "activations" if self._phase_of.get(serial) == "forward" else "temporaries"
            out[role] = out.get(role, 0) + nbytes       # "offloaded" (host memory) only where there is some
        return out | {"peak_bytes": self.peak_bytes}

    def largest_at_peak(self, count: int = LARGEST_COUNT) -> list[dict]:
        """The ``count`` largest storages live at the latest peak, largest first: bytes, category (as in
        ``breakdown``), and the op, shape and dtype of the tensor that first held it (op ``None`` where it was made
        before tracking and ``register``-ed: a parameter or optimizer state). What a gap between a prediction and a
        simulation is made of can be read here."""
        def entry(serial: int, nbytes: int) -> dict:
            op, shape, dtype = self._made_by.get(serial, (None, None, None))
            role = self._role.get(serial) or (
                "activations" if self._phase_of.get(serial) == "forward" else "temporaries")
            return {"bytes": nbytes, "category": role, "op": None if op is None else str(op),
                    "shape": None if shape is None else list(shape), "dtype": None if dtype is None else str(dtype)}
        largest = sorted(self._peak_serials.items(), key=lambda item: (-item[1], item[0]))[:count]
        return [entry(serial, nbytes) for serial, nbytes in largest]


__all__ = ["CATEGORIES", "LARGEST_COUNT", "StepMemory", "storages"]
