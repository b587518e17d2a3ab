"""Models built on the meta device: shard first, then give each rank storage for its own shard only.

A script builds a large model without memory, under ``torch.device("meta")`` or ``tensoropt.meta_init()``
(parameters on meta, buffers computed for real: rotary tables and masks keep their values). The engine
shards the meta model (tensor parallelism, FSDP2, a pipeline stage), ``Materializer.allocate`` gives every
tensor this rank holds storage on its device (``to_empty`` for meta tensors, a move for real ones), and
``Materializer.initialise`` fills it with the model's own initialisation.

Initialisation is the model's, module by module: ``module.reset_parameters()`` where a module defines it
(what every torch layer runs in its constructor), then ``init_fn(module)`` if the script gives one (the
function a script would ``model.apply``), for each module in ``model.modules()`` order. It runs on a
full-size scratch copy of that module's own tensors, and each rank keeps the slice it holds. Every rank
runs every module's initialisation, also for modules held by other ranks (pipeline stages), so the random
number streams stay aligned and a parameter gets the same values under every plan, on every rank count,
as the same script run alone. DTensor's random ops would instead draw each shard from its own rank's
generator on CPUs (``torch.distributed.tensor._random``: sharding-consistent on CUDA only) and compute
fan-in from whatever shape they see. The price is a transient buffer the size of the largest module's own
parameters (LLaMA-2 70B: one 8192 x 28672 linear, 0.44 GiB in bf16), never the whole model.

A parameter or buffer that came from the meta device and that no initialisation wrote is an error naming
it: training on uninitialised memory is never silent.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator

import torch
from torch import nn

from ..errors import TensorOptError
from .feature_order import feature_orders, in_run_order

InitFn = Callable[[nn.Module], object]
# prefixes the engines' wrappers put into parameter names; a tensor is found under the script's own name
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


@contextlib.contextmanager
def meta_init() -> Iterator[None]:
    """Build models whose parameters live on the meta device (no memory, no initialisation cost) while
    buffers (masks, rotary tables) are computed for real: the runtime then needs to initialise only the
    parameters. Use ``torch.device("meta")`` instead to put buffers on meta as well, and have ``init_fn``
    compute them."""
    register = nn.Module.register_parameter

    def register_on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(self, name, param)
    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def has_meta_tensors(model: nn.Module) -> bool:
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def script_name(name: str) -> str:
    """A tensor's name as the script's model has it, without the engines' wrapper prefixes."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _named_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    return {script_name(name): t for name, t in named}


def tied_parameters(module: nn.Module) -> list[tuple[str, ...]]:
    """Names of each parameter the module registers under several names (tied embeddings), in model order."""
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [tuple(group) for group in names.values() if len(group) > 1]


def tie(module: nn.Module, names: list[str] | tuple[str, ...]) -> nn.Parameter:
    """Register the parameter named ``names[0]`` under every other name too; returns it."""
    param = module.get_parameter(names[0])
    for name in names[1:]:
        owner, _, attr = name.rpartition(".")
        setattr(module.get_submodule(owner) if owner else module, attr, param)
    return param


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def _deliver(value: torch.Tensor, target: torch.Tensor | None, order: tuple | None = None) -> None:
    """Copy this rank's part of the full ``value`` into ``target`` (a DTensor's local shard, or all of it); ``order``
    (dim, order): the run holds the tensor's features in another order (``feature_order``)."""
    if target is None or target is value:
        return
    if order is not None:
        value = in_run_order(value, *order)
    if _is_dtensor(target):
        from torch.distributed.tensor import distribute_tensor
        # src_data_rank=None: every rank cuts its own shard from its own (identical) full value, no messages
        shard = distribute_tensor(value.detach(), target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(shard.to_local())
    else:
        target.copy_(value)


class Materializer:
    """What a meta-built model needs initialised, recorded before the engine re-wraps it (see module doc)."""

    def __init__(self, model: nn.Module, init_fn: InitFn | None = None) -> None:
        self.init_fn = init_fn
        # values of buffers built for real (tensoropt.meta_init): a stage cut from the model on meta needs them
        self.real_buffers = {script_name(n): b for n, b in model.named_buffers(remove_duplicate=False) if not b.is_meta}
        self.owners: list[tuple[str, nn.Module, tuple[str, ...], tuple[str, ...]]] = []
        for name, module in model.named_modules():
            params = tuple(n for n, p in module._parameters.items() if p is not None and p.is_meta)
            buffers = tuple(n for n, b in module._buffers.items() if b is not None and b.is_meta)
            if params or buffers:
                self.owners.append((name, module, params, buffers))

    def materialize(self, module: nn.Module, device: torch.device) -> None:
        """Give ``module`` (the model, or this rank's pipeline stage) storage for what this rank holds on
        ``device`` and fill it with the model's initialisation (``allocate``, then ``initialise``)."""
        self.allocate(module, device)
        self.initialise(module, device)

    def allocate(self, module: nn.Module, device: torch.device) -> None:
        """Storage on ``device`` for every tensor ``module`` holds on this rank: uninitialised for meta
        tensors (only the local shard of a sharded one), a copy for real ones. Tied parameters stay tied
        (``Module.to_empty`` would give each name a parameter of its own)."""
        tied = tied_parameters(module)
        was_meta = {name for name, t in _named_tensors(module).items() if t.is_meta}
        module._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t.to(device))
        for names in tied:
            tie(module, names)
        with torch.no_grad():          # buffers built for real that reached this module on meta (a pipeline's cut)
            for name, target in _named_tensors(module).items():
                if name in was_meta and name in self.real_buffers:
                    target.copy_(self.real_buffers[name])

    @torch.no_grad()
    def initialise(self, rank_module: nn.Module, device: torch.device) -> None:
        """Run every module's initialisation at full size and keep, in ``rank_module`` (the model or this
        rank's pipeline stage, after ``allocate``), the part this rank holds."""
        targets = _named_tensors(rank_module)
        orders = feature_orders(rank_module)
        owners_left = Counter(id(store[attr]) for _, module, params, buffers in self.owners
                              for store, attr in self._slots(module, params, buffers))
        live: dict[int, torch.Tensor] = {}      # full values of tensors that more modules own (tied weights)
        names: dict[int, list[str]] = {}         # every name a tensor has, delivered once its last owner is done
        written: dict[int, bool] = {}
        unwritten: list[str] = []
        for name, module, params, buffers in self.owners:
            slots = self._slots(module, params, buffers)
            originals = [store[attr] for store, attr in slots]
            works = [self._working_copy(store, attr, live, device) for store, attr in slots]
            versions = [w._version for w in works]
            self._run_init(module)
            for (store, attr), original, work, version in zip(slots, originals, works, versions):
                result, key = store[attr], id(original)
                store[attr] = original
                if result is not work and original is work:
                    original.copy_(result)               # the init replaced a tensor the rank holds whole
                names.setdefault(key, []).append(f"{name}.{attr}" if name else attr)
                written[key] = written.get(key, False) or result is not work or work._version != version
                owners_left[key] -= 1
                if owners_left[key]:
                    live[key] = result                   # its next owner initialises this same full value
                    continue
                live.pop(key, None)
                for fqn in names.pop(key):
                    _deliver(result, targets.get(fqn), orders.get(fqn))
                if not written.pop(key):
                    unwritten.append(f"{name}.{attr}" if name else attr)
        if unwritten:
            more = f" and {len(unwritten) - 3} more" if len(unwritten) > 3 else ""
            raise TensorOptError(
                f"{', '.join(unwritten[:3])}{more} came from the meta device and nothing initialised them: give "
                "tensoropt.parallelize an init_fn(module) that sets them (or a reset_parameters() on their "
                "module), or build buffers under tensoropt.meta_init(), which keeps their values")

    @staticmethod
    def _slots(module: nn.Module, params: tuple[str, ...], buffers: tuple[str, ...]) -> list[tuple[dict, str]]:
        return [(module._parameters, p) for p in params] + [(module._buffers, b) for b in buffers]

    @staticmethod
    def _working_copy(store: dict, attr: str, live: dict[int, torch.Tensor], device: torch.device) -> torch.Tensor:
        """The tensor the initialisation writes: the rank's own tensor where it holds it whole, else a
        full-size scratch (registered in its place until the module is done)."""
        current = store[attr]
        if not current.is_meta and not _is_dtensor(current):
            return current
        scratch = live.get(id(current))
        if scratch is None:
            scratch = torch.empty(current.shape, dtype=current.dtype, device=device)
        if isinstance(current, nn.Parameter):
            scratch = nn.Parameter(scratch, requires_grad=current.requires_grad)
        store[attr] = scratch
        return scratch

    def _run_init(self, module: nn.Module) -> None:
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
        if self.init_fn is not None:
            self.init_fn(module)


__all__ = ["InitFn", "Materializer", "has_meta_tensors", "meta_init", "script_name", "tie", "tied_parameters"]
