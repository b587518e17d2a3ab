"""Sequence parallelism with tensor parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", sec. 4.2.2), for the copies the plan marks ``sequence_parallel``.

In such a copy the residual stream, and every op outside the column -> row branches (norms, dropouts, residual
adds), runs on the rank's ``1/tp`` share of the sequence (dim 1, batch-first); the planner offers it only to
blocks whose ops outside the branches are per token (``space.sp_check``) and whose sequence ``tp`` divides.
Entering a branch the stream is all-gathered along the sequence (once per distinct input: q, k and v reading
the same normed tensor share one gather, whose backward is one reduce-scatter); leaving it, the row linears'
partial outputs are reduce-scattered along the sequence instead of all-reduced. Two placements of
``torch.distributed.tensor`` carry this: the stream inside the copy is a ``DTensor`` sharded on dim 1, the
parameters outside the branches (norm weights) are ``Replicate`` ``DTensor``s, so the gradients each rank
computes on its share come out ``Partial`` and are summed over the tensor-parallel group (all in one all-reduce
before the optimizer's step, ``runtime.parallel.partial_grads``, or by FSDP2 before its reduce-scatter, see
``fsdp._fully_shard._fsdp_param``).

A branch the plan leaves replicated runs whole on every rank inside an SP copy: its input is all-gathered,
its output sliced back to the rank's share (backward: the output gradient all-gathered, the input gradient
sliced): two all-gathers of the branch's activations per copy, as ``cost.layer`` prices it.

Autograd saves a column linear's input for its backward: every SP copy keeps the share instead of the gathered
whole and gathers it again in the backward (Megatron-LM's way, Korthikanti et al. sec. 4.2.2), so it holds ``1/tp``
of its stream activations, with or without recomputation, as ``cost.layer`` prices it. It does so with saved-tensor
hooks, which do not nest: only the innermost pair sees a saved tensor. So the copy's pair does not shadow the pair
that is innermost when its forward starts, it composes with it (``_SavedShares``): every tensor goes on to that
pair's pack, a gathered input as its share, and comes back through its unpack, a share gathered again. That pair
is a selective recomputation's (``runtime.memory.selective``: the share is not core, so it is kept as it is), torch's
checkpoint's in a fully recomputed copy's forward (the share's place is recorded) and in the recomputation in the
backward (the recomputed share is what the backward gets back and gathers: the recompute working set holds shares,
as Megatron's does), or none.

Between copies the stream is a plain tensor: the rank's share between two consecutive SP copies of a block
(no communication), the whole sequence elsewhere. The first SP copy of a run slices its input (backward:
all-gather), the last gathers its output (backward: slice), as ``cost.model.chain_sums`` prices the layout
changes. The stream is the block's first tensor argument and its output (or the output's first element);
other inputs (masks, rotary tables, positions) stay whole and are used inside the branches on the whole
sequence.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ...errors import TensorOptError
from ...space.plan import Plan
from ...space.run_plan import Branches
from ..blocks import copies_of
from .sequence_collectives import SEQUENCE_DIM, gather_sequence, gathered

# ``handoff[0]`` of a pipeline stage's first copy whose input is the previous stage's share, received as a message:
# true (it arrives sharded), and no copy of this stage handed it on, so the relay check does not apply
FROM_MESSAGE = "message"


def sequence_parallel_copies(model: nn.Module, plan: Plan) -> dict[str, tuple[bool, bool]]:
    """{copy module name: (its input arrives sharded, its output stays sharded)} for every copy the plan runs
    sequence-parallel; a copy hands its share on only to the next copy of the same block that is SP too."""
    if plan.tp < 2:
        return {}
    out = {}
    for bp in plan.blocks:
        copies = copies_of(model, bp.block)
        flags = [s.sequence_parallel for s, n in bp.strategies for _ in range(n)] * plan.pp
        for i, (name, sp) in enumerate(zip(copies, flags)):
            if sp:
                out[name] = (i > 0 and flags[i - 1], i + 1 < len(flags) and flags[i + 1])
    return out


def apply_sequence_parallel(copy: nn.Module, name: str, layout: Branches, sharded: Branches, tp_mesh,
                            handoff: tuple[bool, bool], relay: dict | None = None,
                            stream_argument: int | None = None) -> None:
    """Make one already tensor-sharded copy run its stream on the rank's share of the sequence (module doc).
    ``layout``: every branch of the block (plan.json's ``tp_layout``), ``sharded``: those the plan shards,
    ``handoff``: (input arrives sharded, output stays sharded), ``relay``: shared by a run of copies so that a
    copy can check it receives the very share its predecessor handed on, ``stream_argument``: the position of the
    stream among the copy's arguments where it is not the first tensor (a traced copy's arguments are in the
    trace's order)."""
    names = {b.branch for b in sharded}
    gathers = _GatherOnce(tp_mesh)
    linears = set()
    for branch in layout:
        local = branch.branch not in names
        for column in branch.column:
            copy.get_submodule(column).register_forward_pre_hook(gathers.hook(local), prepend=True)
        if local:
            for row in branch.row:
                copy.get_submodule(row).register_forward_hook(_slice_output(tp_mesh))
        linears |= set(branch.linears)
    _replicate_stream_parameters(copy, linears, tp_mesh)
    relay = {} if relay is None else relay
    copy.register_forward_pre_hook(_enter(name, tp_mesh, handoff[0], gathers, relay, stream_argument),
                                   with_kwargs=True)
    copy.register_forward_hook(_leave(name, handoff[1], gathers, relay), with_kwargs=True)
    copy.register_forward_hook(gathers.drop, always_call=True)


class _GatherOnce:
    """All-gathers a column linear's sequence-sharded input, once per input tensor within a copy's forward
    (Megatron-LM gathers once per branch), so that q, k and v reading one normed tensor share one gather and
    their input gradients one reduce-scatter."""

    def __init__(self, mesh) -> None:
        self.mesh, self.done, self.saving = mesh, {}, None

    def clear(self) -> None:
        self.done = {}
        if self.saving is not None:
            self.saving.__exit__(None, None, None)
            self.saving = None

    def drop(self, _module, _args, _output) -> None:
        """The copy's forward hook run even when its forward raises (``always_call``): a full recomputation
        stops at the last tensor the backward needs (torch.utils.checkpoint's early stop raises
        ``_StopRecomputationError`` inside the forward), so ``_leave`` never runs for it, and ``done`` would
        keep the recomputed stream and its gathered whole, with the recomputed autograd graph behind them,
        until the copy's next forward: every recomputed SP copy's tensors held through the rest of the
        backward (LLaMA-2 70B at dp32 tp2 with 55 recomputed SP copies: 63 GiB of a 113 GiB peak)."""
        self.clear()

    def save_shares(self) -> None:
        """Until ``clear``: a gathered input autograd saves is kept as the share it was gathered from, composed with
        the saved-tensor hooks innermost now (module doc)."""
        top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
        if top is None:
            raise TensorOptError("sequence parallelism needs torch 2.8 or newer (it composes its saved-tensor hooks "
                                 f"with recomputation's; this is {torch.__version__}): upgrade torch or plan "
                                 "without it")
        self.saving = _SavedShares(self, top(True))
        self.saving.__enter__()

    def share_of(self, t: torch.Tensor) -> DTensor | None:
        """The share ``t`` was gathered from, where ``t`` is (a contiguous view of all of) a gathered input."""
        local = t._local_tensor if isinstance(t, DTensor) else t
        for share, whole in self.done.values():
            w = whole._local_tensor
            if _same_storage(local, w) and local.is_contiguous() \
                    and local.storage_offset() == w.storage_offset() and local.numel() == w.numel():
                return share
        return None

    def hook(self, local: bool):
        def gather(module, args):
            x = args[0]
            if not isinstance(x, DTensor):
                raise TensorOptError(f"under sequence parallelism a branch's linear ({type(module).__name__}) reads "
                                     "a tensor that is not the block's sequence-sharded stream: plan this model "
                                     "without sequence parallelism")
            key = id(x)
            if key not in self.done:
                share = _autocast(x)
                self.done[key] = (share, gather_sequence(share, self.mesh))
            whole = self.done[key][1]
            return (whole.to_local() if local else whole, *args[1:])
        return gather


def _autocast(x: torch.Tensor) -> torch.Tensor:
    """A column linear's share as the linear will compute with it: under an autocast (bf16-mixed with float32
    weights, ZeRO 0) cast to the autocast's dtype before it is gathered, as autocast would cast the gathered whole
    (the same values): the gather moves half the bytes, and the linear saves the gathered tensor itself, which the
    copy then keeps as its share (``_SavedShares``); cast after the gather, the linear would save autocast's copy
    of it, whole."""
    device = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        if x.dtype != dtype:
            return x.to(dtype)
    return x


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors view one storage: the storage objects themselves are compared, not their data
    pointers, which are 0 for every fake tensor (``runtime.memory.check``'s simulation), where comparing them
    packed any saved tensor of a gathered input's size as the first gathered share of the copy (the MLP's input
    as the attention's: one share per copy missing from the simulated peak)."""
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata


class _Share:
    """A saved gathered input, held as the rank's share of it: ``inner`` is what the composed pair packed the share
    as (the share itself where there is none)."""

    def __init__(self, inner, shape: torch.Size, distributed: bool, mesh) -> None:
        self.inner, self.shape, self.distributed, self.mesh = inner, shape, distributed, mesh


class _SavedShares(torch.autograd.graph.saved_tensors_hooks):
    """An SP copy's one pair of saved-tensor hooks, composed with ``outer``, the pair that was innermost when the
    copy's forward began (``(pack, unpack)`` or None): every tensor is packed by ``outer``'s pack, a gathered
    input as its share, so that pair still sees, in the same order, one tensor for each that autograd saves (torch's
    checkpoint counts them and checks their metadata against the recomputation's, which packs shares too)."""

    def __init__(self, gathers: _GatherOnce, outer: tuple | None) -> None:
        outer_pack, outer_unpack = outer if outer is not None else (None, None)

        def pack(t: torch.Tensor):
            share = gathers.share_of(t)
            if share is None:
                return t if outer_pack is None else outer_pack(t)
            return _Share(share if outer_pack is None else outer_pack(share), t.shape, isinstance(t, DTensor),
                          gathers.mesh)

        def unpack(packed):
            if not isinstance(packed, _Share):
                return packed if outer_unpack is None else outer_unpack(packed)
            share = packed.inner if outer_unpack is None else outer_unpack(packed.inner)
            with torch.no_grad():
                whole = gathered(share)
            return whole.view(packed.shape) if packed.distributed else whole.to_local().view(packed.shape)
        super().__init__(pack, unpack)


def _slice_output(mesh):
    """A replicated branch's output (whole sequence, equal on every rank) as the rank's share of the stream."""
    def slice_(_module, _args, output):
        return DTensor.from_local(output, mesh, [Replicate()], run_check=False).redistribute(
            mesh, [Shard(SEQUENCE_DIM)])
    return slice_


def _replicate_stream_parameters(copy: nn.Module, linears: set[str], mesh) -> None:
    """Parameters outside the branches' linears (norm weights and biases) as ``Replicate`` DTensors: they meet
    the sequence-sharded stream, and their gradients (partial sums over the rank's tokens) are summed over the
    tensor-parallel group."""
    for module_name, module in copy.named_modules():
        if any(module_name == n or module_name.startswith(n + ".") for n in linears):
            continue
        for pname, param in list(module.named_parameters(recurse=False)):
            if isinstance(param, DTensor):
                continue
            module.register_parameter(pname, nn.Parameter(distribute_tensor(param.detach(), mesh, [Replicate()]),
                                                          requires_grad=param.requires_grad))


def _stream_position(args: tuple, kwargs: dict, index: int | None = None) -> tuple[str, int | str]:
    if index is not None and index < len(args):
        return "args", index
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            return "args", i
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return "kwargs", k
    raise TensorOptError("a sequence-parallel block received no tensor to carry as its stream")


def _enter(name: str, mesh, arrives_sharded: bool, gathers: _GatherOnce, relay: dict, stream_argument: int | None):
    tp = mesh.size()
    # the model's routing of the stream is fixed: checked on the copy's first forward only (a full recomputation
    # re-enters in the backward with its saved input, which the relay may no longer hold)
    checked: list[bool] = []

    def enter(_module, args, kwargs):
        gathers.clear()
        where, key = _stream_position(args, kwargs, stream_argument)
        x = args[key] if where == "args" else kwargs[key]
        if isinstance(x, DTensor):      # a recomputation re-entering: already converted
            return None
        if arrives_sharded:
            if arrives_sharded is not FROM_MESSAGE and not checked \
                    and not any(_same_values(ref(), x) for ref in relay.values()):
                raise TensorOptError(f"{name} runs sequence-parallel after another such copy, but its input is not "
                                     "that copy's output (the model changes the stream between its blocks): plan "
                                     "this model without sequence parallelism")
            checked.append(True)
            stream = DTensor.from_local(x, mesh, [Shard(SEQUENCE_DIM)], run_check=False)
        else:
            if x.dim() < 2 or x.shape[SEQUENCE_DIM] % tp:
                raise TensorOptError(f"sequence parallelism over {tp} devices splits dim {SEQUENCE_DIM} of {name}'s "
                                     f"input {tuple(x.shape)}, which {tp} does not divide: use a sequence length "
                                     f"that {tp} divides, or plan without sequence parallelism")
            # the share copied out of the whole, as Megatron-LM's scatter to the sequence-parallel region does:
            # a view would keep the whole stream alive as long as the copy's first op saves its share (the whole
            # embedding output of every micro-batch in flight on a pipeline's first stage)
            stream = DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(
                mesh, [Shard(SEQUENCE_DIM)]).clone()
        if torch.is_grad_enabled():
            gathers.save_shares()
        if where == "args":
            return (*args[:key], stream, *args[key + 1:]), kwargs
        return args, {**kwargs, key: stream}
    return enter


def _leave(name: str, stays_sharded: bool, gathers: _GatherOnce, relay: dict):
    def leave(_module, _args, _kwargs, output):
        gathers.clear()
        first = output[0] if isinstance(output, (tuple, list)) else output
        if not isinstance(first, DTensor):
            raise TensorOptError(f"{name}'s output is not its sequence-sharded stream: plan this model without "
                                 "sequence parallelism")
        y = first.to_local() if stays_sharded else gather_sequence(first, first.device_mesh).to_local()
        if stays_sharded:       # all kept: a recomputation re-enters with an earlier copy's output
            for key in [k for k, ref in relay.items() if ref() is None]:
                del relay[key]
            relay[id(y)] = weakref.ref(y)
        if isinstance(output, tuple):
            return (y, *output[1:])
        if isinstance(output, list):
            return [y, *output[1:]]
        return y
    return leave


def _same_values(handed: torch.Tensor | None, x: torch.Tensor) -> bool:
    """Whether ``x`` is the share a copy handed on, or a view of it (FSDP2 hooks the outputs of the modules it
    wraps through a view)."""
    return handed is not None and handed.shape == x.shape and _same_storage(handed, x)


__all__ = ["FROM_MESSAGE", "apply_sequence_parallel", "sequence_parallel_copies"]
