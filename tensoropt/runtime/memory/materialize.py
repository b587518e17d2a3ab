"""Models built on the meta device: shard first, then give each rank storage for its own shard only.

A script builds a large model without memory, under ``torch.device("meta")`` or ``tensoropt.meta_init()``
(parameters on meta, buffers computed for real: rotary tables and masks keep their values). The engine
shards the meta model (tensor parallelism, FSDP2, a pipeline stage), ``Materializer.allocate`` gives every
tensor this rank holds storage on its device (``to_empty`` for meta tensors, a move for real ones), and
``Materializer.initialise`` fills it with the values the script run alone would give the model built for
real and then ``model.apply(init_fn)``: two passes over the random number stream,

1. "construction": each module's ``reset_parameters()``, children before their parent (the order torch
   layers draw in their constructors; a parent such as ``MoE`` builds its children, then resets itself);
2. "apply": ``init_fn(module)`` for every module in ``nn.Module.apply`` order (children before their
   parent, so a parent may re-initialise its children's tensors, as GPT-2's scaled ``c_proj`` does).

What each call reads and writes is found when the ``Materializer`` is made, before the engine touches the
model, by running every call once on fake tensors (``init_trace``). A tensor is then computed at full size
on this rank's device from the first call that touches it to the last, and each rank keeps its slice
(``_deliver``: a DTensor's shard, a DeepSpeed ZeRO 3 parameter's partition); where the rank holds it whole it
is computed in place. Pass 2 starts a tensor from its
pass-1 value by replaying the ``reset_parameters()`` calls that wrote it from the generator states
recorded before each in pass 1, so the transient full-size copies are those of the tensors one call
touches (and of tied weights between their calls), never the model. Every rank runs every call, also for
tensors other ranks hold (pipeline stages), so the random streams stay aligned and a parameter gets the
same values under every plan, on every rank count, as the same script run alone. DTensor's random ops
would instead draw each shard from its own rank's generator on CPUs (``torch.distributed.tensor._random``:
sharding-consistent on CUDA only) and compute fan-in from whatever shape they see.

An ``init_fn`` call that touches more than one block copy of the plan (a torchtitan-style whole-model
``init_weights()`` called from the root) works on a full-size copy of all it touches, said in one line on
rank 0; a copy that does not fit the device's free memory is a one-line error.

A parameter or buffer that came from the meta device and that no initialisation writes is an error naming
it: training on uninitialised memory is never silent.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

import torch
from torch import nn

from ...errors import TensorOptError
from ..device import check_placement, free_memory_bytes, on_device
from ..names import script_name
from ..parallel.feature_order import feature_orders, in_run_order
from .init_trace import Call, Tracked, restore, trace_calls, track_tensors

InitFn = Callable[[nn.Module], object]
# prefixes the engines' wrappers put into parameter names; a tensor is found under the script's own name


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
    if getattr(target, "ds_tensor", None) is not None:
        _deliver_partition(value, target)
    elif _is_dtensor(target):
        from torch.distributed.tensor import distribute_tensor
        # src_data_rank=None: every rank cuts its own shard from its own (identical) full value, no messages
        shard = distribute_tensor(value.detach(), target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(shard.to_local())
    else:
        target.copy_(value)


def _deliver_partition(value: torch.Tensor, param: torch.Tensor) -> None:
    """Copy this rank's part into a DeepSpeed ZeRO 3 parameter: its partition (``ds_tensor``) is slice ``rank`` of
    the flattened tensor padded with zeros to a multiple of the ranks (``Init._partition_param``)."""
    import torch.distributed as dist
    part = param.ds_tensor
    start = part.numel() * dist.get_rank(group=param.ds_process_group)
    mine = value.detach().reshape(-1)[start:start + part.numel()]
    part.data[mine.numel():].zero_()
    part.data[:mine.numel()].copy_(mine)


class Materializer:
    """What a meta-built model needs initialised and how, found before the engine re-wraps it (module doc)."""

    def __init__(self, model: nn.Module, init_fn: InitFn | None = None) -> None:
        self.init_fn = init_fn
        self.tracked: list[Tracked] = track_tensors(model, script_name)
        resets, self.inits = trace_calls(model, self.tracked, init_fn)
        # a reset that touches only tensors built for real already ran, at construction
        self.resets: list[Call] = [c for c in resets if any(self.tracked[k].real is None for k in c.touches)]
        # values of tensors built for real (tensoropt.meta_init): a stage cut from the model on meta needs them
        self.real = {name: t.real for t in self.tracked if t.real is not None for name in t.names}
        # bytes of the plan's largest block copy, set by the engine: an init_fn call touching more is reported
        self.block_bytes: int | None = None
        self._check_initialised()

    def _check_initialised(self) -> None:
        written = set().union(*(c.writes for c in self.resets + self.inits))
        unwritten = [t.names[0] for i, t in enumerate(self.tracked) if t.real is None and i not in written]
        if unwritten:
            more = f" and {len(unwritten) - 3} more" if len(unwritten) > 3 else ""
            raise TensorOptError(
                f"{', '.join(unwritten[:3])}{more} came from the meta device and nothing initialised them: give "
                "tensoropt.parallelize an init_fn(module) that sets them (or a reset_parameters() on their "
                "module), or build buffers under tensoropt.meta_init(), which keeps their values")

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
        with torch.no_grad():          # tensors built for real that reached this module on meta (a pipeline's cut)
            for name, target in _named_tensors(module).items():
                if name in was_meta and name in self.real:
                    target.copy_(self.real[name])

    @torch.no_grad()
    def initialise(self, rank_module: nn.Module, device: torch.device) -> None:
        """Run the construction pass, then the apply pass (module doc), and keep in ``rank_module`` (the
        model or this rank's pipeline stage, after ``allocate``) the part this rank holds."""
        targets = _named_tensors(rank_module)
        orders = feature_orders(rank_module)
        homes = self._homes(targets, device)
        self._check_memory(homes, device)
        states = self._construction_pass(targets, orders, homes, device)
        self._run(self.inits, lambda keys: self._construct(keys, homes, device, states),
                  lambda k, value: self._deliver_all(k, value, targets, orders))

    def _homes(self, targets: dict[str, torch.Tensor], device: torch.device) -> dict[int, torch.Tensor]:
        """The tensors this rank holds whole, on ``device``, under all the names it holds: computed in place."""
        homes = {}
        for k, t in enumerate(self.tracked):
            held = {id(targets[n]): targets[n] for n in t.names if n in targets}
            if t.real is None and len(held) == 1:
                home = next(iter(held.values()))
                if not _is_dtensor(home) and home.shape == t.shape and on_device(home, device):
                    homes[k] = home
        return homes

    def _fresh(self, k: int, device: torch.device, home: torch.Tensor | None = None) -> torch.Tensor:
        """A tensor's starting value: its value built for real, else ``home`` or a new full-size one."""
        t = self.tracked[k]
        if t.real is not None:
            return t.real.to(device, copy=True)
        return home if home is not None else torch.empty(t.shape, dtype=t.dtype, device=device)

    def _construction_pass(self, targets: dict[str, torch.Tensor], orders: dict[str, tuple],
                           homes: dict[int, torch.Tensor], device: torch.device) -> list[list[torch.Tensor]]:
        """Pass 1: every reset, delivering what the apply pass leaves alone; the generator states before each."""
        applied = {k for call in self.inits for k in call.touches}
        states: list[list[torch.Tensor]] = []

        def finish(k: int, value: torch.Tensor) -> None:
            if self.tracked[k].real is None and k not in applied:
                self._deliver_all(k, value, targets, orders)
        self._run(self.resets, lambda keys: {k: self._fresh(k, device, homes.get(k)) for k in keys}, finish,
                  before=lambda i: states.append(_rng_state(device)))
        return states

    def _construct(self, keys: list[int], homes: dict[int, torch.Tensor], device: torch.device,
                   states: list[list[torch.Tensor]]) -> dict[int, torch.Tensor]:
        """The pass-1 values of ``keys``, for the apply pass: the resets that wrote them (and those that wrote
        what these read) replayed from their recorded generator states; the apply stream is left as it was."""
        values = {k: self._fresh(k, device, homes.get(k)) for k in keys}
        needed, chosen = {k for k in keys if self.tracked[k].real is None}, []
        for i in reversed(range(len(self.resets))):
            if needed.intersection(self.resets[i].touches):
                chosen.append(i)
                needed.update(self.resets[i].touches)
        if not chosen:
            return values
        chosen.reverse()
        owned = {k: v for k, v in values.items() if self.tracked[k].real is None}
        stream = _rng_state(device)
        try:
            replayed = self._run([self.resets[i] for i in chosen], lambda ks: {k: self._fresh(k, device) for k in ks},
                                 lambda k, value: None, before=lambda j: _set_rng_state(states[chosen[j]], device),
                                 live=owned)
        finally:
            _set_rng_state(stream, device)
        return values | replayed

    def _run(self, calls: list[Call], fresh: Callable[[list[int]], dict[int, torch.Tensor]],
             finish: Callable[[int, torch.Tensor], None], before: Callable[[int], None] | None = None,
             live: dict[int, torch.Tensor] | None = None) -> dict[int, torch.Tensor]:
        """Run ``calls`` in order on full-size values: a tensor gets its value from ``fresh`` at the first call
        that touches it and goes to ``finish`` after the last; those given in ``live`` stay and are returned."""
        live = dict(live or {})
        owned = set(live)
        last = {k: i for i, call in enumerate(calls) for k in call.touches}
        for i, call in enumerate(calls):
            missing = [k for k in call.touches if k not in live]
            if missing:
                live.update(fresh(missing))
            if before is not None:
                before(i)
            self._call(call, live)
            for k in call.touches:
                if last[k] == i and k not in owned:
                    finish(k, live.pop(k))
        return {k: live[k] for k in owned}

    def _call(self, call: Call, live: dict[int, torch.Tensor]) -> None:
        """One call with the full-size values registered in the model's slots; a tensor the call assigns
        (``module.weight = ...``) becomes the value."""
        saved = []
        for k in call.touches:
            live[k] = self.tracked[k].wrap(live[k])
            saved += self.tracked[k].put(live[k])
        try:
            call.run()
            for k in call.touches:
                live[k] = self.tracked[k].get()
        finally:
            restore(saved)

    def _deliver_all(self, k: int, value: torch.Tensor, targets: dict[str, torch.Tensor],
                     orders: dict[str, tuple]) -> None:
        for name in self.tracked[k].names:
            _deliver(value, targets.get(name), orders.get(name))

    def _check_memory(self, homes: dict[int, torch.Tensor], device: torch.device) -> None:
        """Say in one line when an init_fn call needs more than a block copy at full size; stop with one line
        when the full-size values would not fit the device."""
        def scratch_bytes(keys) -> int:
            return sum(self.tracked[k].nbytes for k in keys if k not in homes)
        peak = max(_peak_live(calls, lambda k: scratch_bytes([k])) for calls in (self.resets, self.inits))
        widest = max(self.inits, key=lambda c: scratch_bytes(c.touches), default=None)
        wide = widest is not None and scratch_bytes(widest.touches) > max((t.nbytes for t in self.tracked), default=0)
        if wide and self.block_bytes is not None and scratch_bytes(widest.touches) > self.block_bytes \
                and _rank() == 0:
            print(f"tensoropt: init_fn({widest.name or 'the model'}) initialises {len(widest.touches)} tensors at "
                  f"once: each rank computes them on a full-size copy of {_size(peak)}, more than one block copy of "
                  f"the plan ({_size(self.block_bytes)})", file=sys.stderr, flush=True)
        free = free_memory_bytes(device)
        if peak <= free:
            return
        if wide:
            raise TensorOptError(
                f"init_fn({widest.name or 'the model'}) needs a full-size copy of {_size(peak)} on {device}, which "
                f"has {_size(free)} free: pass an init_fn that initialises each module's own tensors (call a "
                "layer's init from the layer, not the whole model's from its root)")
        largest = max(self.tracked, key=lambda t: t.nbytes)
        raise TensorOptError(
            f"initialising the model needs full-size copies of {_size(peak)} on {device} at once ({largest.names[0]} "
            f"alone is {_size(largest.nbytes)}), which has {_size(free)} free: each rank computes a tensor whole "
            "before it keeps its slice, so plan for devices with more memory")


def _peak_live(calls: list[Call], size: Callable[[int], int]) -> int:
    """The most bytes of tensors alive at once when ``calls`` run (``Materializer._run``), ``size`` bytes each."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, call in enumerate(calls):
        for k in call.touches:
            first.setdefault(k, i)
            last[k] = i
    change = [0] * (len(calls) + 1)
    for k, i in first.items():
        change[i] += size(k)
        change[last[k] + 1] -= size(k)
    peak = alive = 0
    for delta in change:
        alive += delta
        peak = max(peak, alive)
    return peak


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _rng_state(device: torch.device) -> list[torch.Tensor]:
    """The states of the generators an initialisation on ``device`` may draw from: the CPU's, and the device's."""
    states = [torch.get_rng_state()]
    if device.type != "cpu":
        states.append(torch.get_device_module(device).get_rng_state(device))
    return states


def _set_rng_state(states: list[torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(states[0])
    if device.type != "cpu":
        torch.get_device_module(device).set_rng_state(states[1], device)


def place(module: nn.Module, device: torch.device, materializer: Materializer | None) -> None:
    """Put ``module`` (already sharded, if the plan shards it) on ``device``: a meta-built one gets storage
    for this rank's part and the model's own initialisation, a real one is moved (only its shards, where
    FSDP2 or tensor parallelism already split it). Stops with one line if anything stays elsewhere."""
    if materializer is not None:
        materializer.materialize(module, device)
    else:
        module.to(device)
    check_placement(module, device, "tensoropt.parallelize")


__all__ = ["InitFn", "Materializer", "has_meta_tensors", "meta_init", "place", "script_name", "tie",
           "tied_parameters"]
