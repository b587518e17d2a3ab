"""What each initialisation call of a meta-built model reads and writes, found without allocating anything.

``Materializer`` replays the model's initialisation at full size, but only a few tensors at a time: for that
it must know, before running anything, which tensors each ``reset_parameters()`` and each ``init_fn(module)``
call touches. A parent may initialise its children's tensors (Hugging Face GPT-2 scales ``c_proj.weight``
from the attention module), and a torchtitan-style ``init_weights()`` on the root touches every tensor.

``trace_calls`` runs every call once on stand-ins: fake tensors (``FakeTensorMode``: shapes and dtypes, no
storage, no random numbers drawn) swapped into the model's parameter and buffer slots, then restored. Fake
rather than meta tensors because ``torch.nn.init.trunc_normal_`` and ``orthogonal_`` return at once on a
meta tensor, which would hide their writes. A ``TorchDispatchMode`` maps every tensor an op receives to
the model tensor whose storage it shares (``.data``, slices and transposes share it) and reads the op's
schema: an argument marked as written is a write, one marked as aliased is a view (no data read), any
other a read. Assignments (``module.weight = ...``, a buffer replaced, ``.data =``) show as a changed slot
or storage afterwards. Values an init reads for its control flow (``.item()``, ``if mask.any()``) read as
zero on stand-ins, so such a call is traced along one path only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ...errors import TensorOptError

Slot = tuple[nn.Module, str, str]          # (module, "_parameters" or "_buffers", attribute name)
# ops that look only at a tensor's metadata (device, shape): not a read of its values
_METADATA_OPS = frozenset({
    "prim::device", "aten::empty_like", "aten::new_empty", "aten::new_empty_strided", "aten::zeros_like",
    "aten::ones_like", "aten::full_like", "aten::rand_like", "aten::randn_like", "aten::randint_like",
    "aten::new_zeros", "aten::new_ones", "aten::new_full", "aten::sym_size", "aten::sym_stride",
    "aten::sym_numel", "aten::sym_storage_offset"})


@dataclass
class Tracked:
    """One tensor of the model (tied names share one), as the script built it."""

    names: list[str]                     # every name it has in the model, first the one it is known by
    slots: list[Slot]
    shape: torch.Size
    dtype: torch.dtype
    is_param: bool
    requires_grad: bool
    real: torch.Tensor | None            # the value computed at construction (buffers under meta_init)
    attrs: dict = field(default_factory=dict)    # attributes set on the tensor (``_is_hf_initialized``)

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize

    def get(self) -> torch.Tensor:
        module, store, attr = self.slots[0]
        return getattr(module, store)[attr]

    def wrap(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` as the model would hold it: a Parameter for a parameter, with the original's attributes."""
        if self.is_param and not isinstance(value, nn.Parameter):
            value = nn.Parameter(value, requires_grad=self.requires_grad)
        value.__dict__.update(self.attrs)
        return value

    def put(self, value: torch.Tensor) -> list[tuple[Slot, torch.Tensor]]:
        """Register ``value`` (see ``wrap``) under every name of this tensor; returns what was there, for
        ``restore``."""
        saved = []
        for module, store, attr in self.slots:
            saved.append(((module, store, attr), getattr(module, store)[attr]))
            getattr(module, store)[attr] = value
        return saved


def restore(saved: Iterable[tuple[Slot, torch.Tensor]]) -> None:
    for (module, store, attr), value in reversed(list(saved)):
        getattr(module, store)[attr] = value


@dataclass(frozen=True)
class Call:
    """One initialisation call: ``module.reset_parameters()`` or ``init_fn(module)``, and the tensors
    (indices into the ``Tracked`` list) it reads or writes."""

    name: str                            # the module's name ("" for the root)
    run: Callable[[], object]
    touches: tuple[int, ...]
    writes: frozenset[int]


def track_tensors(model: nn.Module, script_name: Callable[[str], str]) -> list[Tracked]:
    """Every parameter and buffer of ``model`` once, with all its names and slots, in model order."""
    tracked: list[Tracked] = []
    index: dict[int, int] = {}
    seen_slots: set[tuple[int, str, str]] = set()
    for module_name, module in model.named_modules(remove_duplicate=False):
        for store in ("_parameters", "_buffers"):
            for attr, t in getattr(module, store).items():
                if t is None:
                    continue
                name = script_name(f"{module_name}.{attr}" if module_name else attr)
                if id(t) not in index:
                    index[id(t)] = len(tracked)
                    tracked.append(Tracked([], [], t.shape, t.dtype, store == "_parameters", t.requires_grad,
                                           None if t.is_meta else t.detach(), dict(t.__dict__)))
                entry = tracked[index[id(t)]]
                if name not in entry.names:
                    entry.names.append(name)
                if (id(module), store, attr) not in seen_slots:
                    seen_slots.add((id(module), store, attr))
                    entry.slots.append((module, store, attr))
    return tracked


def apply_order(model: nn.Module) -> list[nn.Module]:
    """Modules in the order ``model.apply`` visits them: children before their parent, a module shared by
    two parents once under each."""
    order: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            visit(child)
        order.append(module)
    visit(model)
    return order


def construction_order(model: nn.Module) -> list[nn.Module]:
    """Modules in the order their constructors draw: a constructor builds its children before it calls its
    own ``reset_parameters()`` (``MoE``, ``nn.MultiheadAttention``), so children come first, each module once."""
    seen: set[int] = set()
    return [m for m in apply_order(model) if id(m) not in seen and not seen.add(id(m))]


def _storage_id(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):          # tensors without storage (sparse, nested)
        return None


class _Recorder(TorchDispatchMode):
    """Notes which tracked tensors each op reads and writes (see module doc)."""

    def __init__(self, keys: dict[int, int], originals: dict[int, str]) -> None:
        super().__init__()
        self.keys, self.originals = keys, originals
        self.reads: set[int] = set()
        self.writes: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import DataDependentOutputException
        kwargs = kwargs or {}
        if func._schema.name not in _METADATA_OPS:
            for i, argument in enumerate(func._schema.arguments):
                value = kwargs.get(argument.name) if argument.kwarg_only or i >= len(args) else args[i]
                for t in value if isinstance(value, (list, tuple)) else (value,):
                    if isinstance(t, torch.Tensor):
                        self._note(t, argument.alias_info)
        try:
            return func(*args, **kwargs)
        except DataDependentOutputException:
            if func is torch.ops.aten._local_scalar_dense.default:   # .item(), bool(): read as zero
                return False
            raise

    def _note(self, t: torch.Tensor, alias_info) -> None:
        storage = _storage_id(t)
        if storage in self.originals:
            raise TensorOptError(
                f"the initialisation reaches {self.originals[storage]} through a reference it kept, not through "
                "the module it is given: reach tensors as module attributes (module.weight), which tensoropt "
                "swaps for full-size copies")
        key = self.keys.get(storage)
        if key is None:
            return
        if alias_info is not None and alias_info.is_write:
            self.writes.add(key)
        elif alias_info is None:
            self.reads.add(key)


def trace_calls(model: nn.Module, tracked: list[Tracked], init_fn: Callable[[nn.Module], object] | None,
                ) -> tuple[list[Call], list[Call]]:
    """The "construction" calls (each module's ``reset_parameters()``, children first) and the "apply"
    calls (``init_fn(module)`` in ``model.apply`` order) that touch a tracked tensor, each with what it
    touches; calls that touch nothing are left out."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    subtree = _subtree_tensors(model, tracked)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        stand_ins = [t.wrap(torch.empty(t.shape, dtype=t.dtype)) for t in tracked]
    originals = {_storage_id(t.get()): t.names[0] for t in tracked if t.get().is_meta}
    saved = [s for t, stand_in in zip(tracked, stand_ins) for s in t.put(stand_in)]
    keys = {_storage_id(stand_in): i for i, stand_in in enumerate(stand_ins)}
    resets, inits = [], []
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            for module in construction_order(model):
                reset = getattr(module, "reset_parameters", None)
                if callable(reset):
                    label = f"{names[id(module)] or 'the model'}.reset_parameters()"
                    resets += _trace(label, names[id(module)], reset, fake, tracked, subtree[id(module)], keys,
                                     originals)
            for module in apply_order(model) if init_fn is not None else ():
                label, run = f"init_fn({names[id(module)] or 'the model'})", (lambda m: lambda: init_fn(m))(module)
                inits += _trace(label, names[id(module)], run, fake, tracked, subtree[id(module)], keys, originals)
    finally:
        restore(saved)
    return resets, inits


def _subtree_tensors(model: nn.Module, tracked: list[Tracked]) -> dict[int, list[int]]:
    """For each module (by id), the tracked tensors registered in it or its descendants."""
    own: dict[int, set[int]] = {}
    for i, t in enumerate(tracked):
        for module, _, _ in t.slots:
            own.setdefault(id(module), set()).add(i)
    return {id(m): sorted(set().union(*(own.get(id(d), ()) for d in m.modules()))) for m in model.modules()}


def _trace(label: str, name: str, run: Callable[[], object], fake, tracked: list[Tracked], local: list[int],
           keys: dict[int, int], originals: dict[int, str]) -> list[Call]:
    """The call, once on the stand-ins: [Call] if it touches a tracked tensor, else []. Assignments are looked
    for in the module's own subtree (``local``); in-place writes anywhere."""
    before = [(i, tracked[i].get(), _storage_id(tracked[i].get())) for i in local]
    recorder = _Recorder(keys, originals)
    try:
        with fake, recorder:
            run()
    except TensorOptError as error:
        raise TensorOptError(f"{label}: {error}") from None
    except Exception as error:       # the script's own code, run on stand-ins: say which call and why
        first_line = (str(error).splitlines() or [""])[0]
        raise TensorOptError(f"{label} failed when run on fake tensors to find what it initialises "
                             f"({type(error).__name__}: {first_line}); it must not need the values of what it "
                             "initialises") from error
    for i, value, storage in before:
        now = tracked[i].get()
        if now is not value or _storage_id(now) != storage:     # assigned: a new tensor or new storage
            recorder.writes.add(i)
            keys[_storage_id(now)] = i
    touches = recorder.reads | recorder.writes
    if not touches:
        return []
    return [Call(name, run, tuple(sorted(touches)), frozenset(recorder.writes))]


__all__ = ["Call", "Tracked", "apply_order", "construction_order", "restore", "track_tensors", "trace_calls"]
