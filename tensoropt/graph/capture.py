"""Capture an ``nn.Module`` into an ``OpGraph`` without allocating its memory.

The forward pass runs once under ``FakeTensorMode`` on meta parameters, with autograd on, while
a dispatch-level tracer records every ATen op below autograd: its shapes, FLOPs, bytes, module
path and producers. ``saved_tensors_hooks`` tell which activations autograd keeps for backward.
Executing (rather than symbolically tracing) the forward means Python control flow, Hugging Face
models and arbitrary user code all work, as long as nothing depends on tensor *values*.
Fake tensors also make libraries that check ``is_fake_tensor`` (transformers does) skip their
data-dependent fast paths.

Two functions are routed to the kernels a GPU runs, because the meta device's CPU fallbacks
would misstate memory: ``F.scaled_dot_product_attention`` becomes the fused (flash) attention op,
one op that saves O(s) state instead of the O(s^2) score matrix, and ``F.dropout`` becomes
``native_dropout``, which keeps a 1-byte mask instead of one in the activation dtype.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..errors import CaptureError
from .experts import EXPERTS_META, check_experts, experts_metadata
from .grouped_mm_meta import install_grouped_mm_meta
from .ir import CONTEXT_PARALLEL_META, CROSS_ENTROPY_CALLS, OUTPUT_KEY, Op, OpGraph, Ref, TensorMeta
from .loss import check_loss, counting_cross_entropy, describe, loss_tensor
from .opinfo import ALIAS_OPS, backward_flops, forward_flops, op_kind, product_operands
from .precision import active_autocast, cuda_autocast_on_cpu
from .views import FULL, footprint


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(tuple(int(d) for d in t.shape), _dtype_name(t.dtype))


def _attr_value(value: object) -> str | None:
    """Stringify a non-tensor argument; None for those that do not affect cost (devices...)."""
    if isinstance(value, (torch.device, torch.layout, torch.memory_format)) or value is None:
        return None
    if isinstance(value, torch.dtype):
        return _dtype_name(value)
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return None
    return str(value)


@dataclass
class _Record:
    func: torch._ops.OpOverload
    module_path: str
    in_tensors: list[torch.Tensor]
    sources: list[Ref]
    out_tensors: list[torch.Tensor]
    attrs: tuple[tuple[str, str], ...]
    forward_flops: int
    requires_grad: bool
    grad_operands: int
    input_views: tuple[tuple[int, ...], ...]


# torch's own entry point: ``graph.precision.cuda_attention_policy`` puts a wrapper at
# ``F.scaled_dot_product_attention`` during bf16-mixed captures, which calls this one. There the CPU's own kernel
# choice stands (its flash kernel, as routed here, for equal head sizes), but for values narrower than the queries,
# where the CPU would decompose the attention into its S x S scores: those are routed as below
_SDPA = torch._C._nn.scaled_dot_product_attention


def _narrow_values(args: tuple, kwargs: dict) -> bool:
    q = args[0] if args else kwargs.get("query")
    v = args[2] if len(args) > 2 else kwargs.get("value")
    return isinstance(q, torch.Tensor) and isinstance(v, torch.Tensor) and v.shape[-1] != q.shape[-1]


class _GpuKernels(TorchFunctionMode):
    """Route attention and dropout to the kernels a GPU would run (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention or (func is _SDPA and _narrow_values(args, kwargs)):
            return self._attention(args, kwargs)
        if func is F.dropout:
            return self._dropout(*args, **kwargs)
        return func(*args, **kwargs)

    @staticmethod
    def _dropout(x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
        if not training or p == 0.0:
            return x
        return torch.ops.aten.native_dropout(x, p, True)[0]

    @staticmethod
    def _attention(args: tuple, kwargs: dict) -> torch.Tensor:
        q, k, v = args[:3]
        attn_mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
        dropout_p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
        is_causal = kwargs.get("is_causal", args[5] if len(args) > 5 else False)
        if kwargs.get("enable_gqa") and k.shape[-3] != q.shape[-3]:
            groups = q.shape[-3] // k.shape[-3]
            k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
        if v.shape[-1] != q.shape[-1]:
            # values narrower than queries and keys (DeepSeek's MLA: 192 vs 128): the flash kernels take one head size,
            # CUDA's SDPA runs the memory-efficient kernel, which keeps O(s) state as well
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                q, k, v, attn_mask, True, dropout_p, is_causal, scale=kwargs.get("scale"))[0]
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=kwargs.get("scale"))
        return out[0]


def gpu_kernels() -> TorchFunctionMode:
    """The routing capture runs a forward under (see the module docstring), for code that re-runs parts of it."""
    return _GpuKernels()


class _Tracer(TorchDispatchMode):
    """Records ops as they are dispatched (below autograd) and where each input came from."""

    def __init__(self, state_refs: dict[int, Ref], module_stack: list[str], watch_autocast: bool = False) -> None:
        super().__init__()
        self.watch_autocast = watch_autocast    # note an autocast the forward enters (it has no effect on meta)
        # under autocast a product reads its weight's bf16 copy: recorded as reading the parameter (in bf16),
        # as the strategy space finds linears by the parameters they read. A buffer's cast is the model's own
        # (rotary tables cast to the stream's dtype, ``.to(x.dtype)``): a tensor made every forward, recorded
        self.casts_are_params = not watch_autocast
        self.autocast_seen: torch.dtype | None = None
        self.origin: dict[int, Ref] = dict(state_refs)
        self.records: list[_Record] = []
        self.keep_alive: list[torch.Tensor] = []   # ids stay unique while tensors live
        self.module_stack = module_stack
        self.current = ""

    def ref(self, t: torch.Tensor) -> Ref:
        return self.origin.get(id(t), Ref("const"))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.current = str(func)
        if self.watch_autocast and self.autocast_seen is None:
            self.autocast_seen = active_autocast()
        out = func(*args, **kwargs)
        if func.namespace == "prim":
            return out
        out_tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        in_tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if not out_tensors:
            return out
        name = func.overloadpacket.__name__
        if func.is_view or name in ALIAS_OPS or (self.casts_are_params and name == "_to_copy" and in_tensors
                                                 and self.ref(in_tensors[0]).kind == "param"):
            base = self.ref(in_tensors[0]) if in_tensors else Ref("const")
            for t in out_tensors:
                self.origin[id(t)] = base
                self.keep_alive.append(t)
            return out
        self._record(func, name, args, kwargs, out, in_tensors, out_tensors)
        return out

    def _record(self, func, name, args, kwargs, out, in_tensors, out_tensors) -> None:
        kind = op_kind(name)
        requires_grad = torch.is_grad_enabled() and any(t.requires_grad for t in in_tensors)
        grad_operands = sum(1 for t in product_operands(kind, name, in_tensors) if t.requires_grad)
        schema_args = func._schema.arguments
        attrs = []
        for i, value in enumerate(args):
            text = None if isinstance(value, torch.Tensor) else _attr_value(value)
            if text is not None:
                attrs.append((schema_args[i].name if i < len(schema_args) else str(i), text))
        attrs += [(k, t) for k, v in sorted(kwargs.items())
                  if not isinstance(v, torch.Tensor) and (t := _attr_value(v)) is not None]
        index = len(self.records)
        sources = [self.ref(t) for t in in_tensors]
        views = tuple(footprint(t, self.records[r.index].out_tensors[r.slot]) if r.kind == "op" else FULL
                      for t, r in zip(in_tensors, sources))
        self.records.append(_Record(
            func=func, module_path=self.module_stack[-1] if self.module_stack else "",
            in_tensors=in_tensors, sources=sources, out_tensors=out_tensors,
            attrs=tuple(attrs),
            forward_flops=forward_flops(func, kind, args, kwargs, out, out_tensors, in_tensors),
            requires_grad=requires_grad, grad_operands=grad_operands,
            input_views=views if any(views) else (),
        ))
        for slot, t in enumerate(out_tensors):
            self.origin[id(t)] = Ref("op", index, slot)
        self.keep_alive.extend(in_tensors + out_tensors)


def _translate_error(exc: Exception, op: str, module_path: str) -> CaptureError:
    """One line that names the failing op / module and says what to do."""
    where = f"in module '{module_path or '<root>'}'" + (f" at {op}" if op else "")
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    data_dependent = ("item()" in text or "data-dependent" in text.lower() or "DynamicOutputShape" in
                      type(exc).__name__ or "DataDependent" in type(exc).__name__)
    if data_dependent:
        return CaptureError(
            f"cannot capture the model {where}: its forward depends on tensor values ({text}); "
            "TensorOpt captures on the meta device, so make shapes and control flow independent of "
            "data (no .item(), bool(tensor) or nonzero() in forward)")
    return CaptureError(f"cannot capture the model {where}: {type(exc).__name__}: {text}; "
                        "check that the model's forward runs on the meta device with the example inputs")


_TRACING: list[torch.device] = []     # the device the running trace's fake tensors are on (see tracing_device)
CPU = torch.device("cpu")


def tracing_device() -> torch.device | None:
    """The device a running capture's fake tensors are on (meta; the CPU under autocast, see ``precision``),
    None outside a capture: code that moves tensors during a capture sends them there."""
    return _TRACING[-1] if _TRACING else None


def _fake(fake_mode: FakeTensorMode, x: object, on_cpu: bool) -> object:
    """A fake tensor like ``x``: on x's device, or on the CPU (a meta ``x`` included) when ``on_cpu``."""
    if not isinstance(x, torch.Tensor):
        return x
    if not on_cpu or x.device.type == "cpu":
        fake = fake_mode.from_tensor(x.detach() if isinstance(x, nn.Parameter) else x)
    else:
        fake = FakeTensor(fake_mode, x.detach().to("meta"), CPU)
    return fake.requires_grad_(x.requires_grad) if x.requires_grad and not fake.requires_grad else fake


def _fake_inputs(fake_mode: FakeTensorMode, example_inputs: object, on_cpu: bool) -> object:
    if isinstance(example_inputs, Mapping):
        return {k: _fake(fake_mode, v, on_cpu) for k, v in example_inputs.items()}
    return tuple(_fake(fake_mode, x, on_cpu) for x in example_inputs)


def _input_refs(fakes: object) -> tuple[dict[int, Ref], list[TensorMeta]]:
    values = list(fakes.values()) if isinstance(fakes, Mapping) else list(fakes)
    refs, metas = {}, []
    for x in values:
        if isinstance(x, torch.Tensor):
            refs[id(x)] = Ref("input", len(metas))
            metas.append(_meta(x))
    return refs, metas


def trace_module(model: nn.Module, example_inputs: tuple | Mapping, name: str = "model",
                 metadata: Mapping[str, str] | None = None, require_loss: bool = False) -> OpGraph:
    """Run one training-mode forward of ``model`` on fake tensors and return its op graph.

    ``example_inputs`` is a tuple of positional arguments or a mapping of keyword arguments; its
    tensors should be on the meta device (CPU tensors are converted, never computed on). Under an
    autocast (around the call, or entered by the forward itself) the ops carry the dtypes autocast gives
    them (``precision``). ``require_loss``: a forward that does not return the loss is a one-line
    ``CaptureError`` (``loss``); the graph records what it returned either way.
    """
    install_grouped_mm_meta()        # a float32 MoE layer's grouped products (graph.grouped_mm_meta)
    check_experts(model)
    model.train()
    calls = [0]
    with cuda_autocast_on_cpu(), counting_cross_entropy(calls), _quiet_fake_tensors():
        dtype = active_autocast()
        graph, output, autocast_inside = _trace(model, example_inputs, name, dtype)
        if dtype is None and autocast_inside:          # the forward enters autocast itself: trace where it acts
            calls[0] = 0
            graph, output, _ = _trace(model, example_inputs, name, autocast_inside)
    if require_loss:
        owner = type(model).__name__
        check_loss(output, owner if name == owner else f"{name}: {owner}")
    precision = {"autocast": _dtype_name(dtype or autocast_inside)} if (dtype or autocast_inside) else {}
    return replace(graph, metadata=tuple(sorted({
        **(metadata or {}), **precision, "returns": describe(output), CROSS_ENTROPY_CALLS: str(calls[0]),
        OUTPUT_KEY: output_kind(output), CONTEXT_PARALLEL_META: context_parallel_refusal(model),
        **({EXPERTS_META: experts} if (experts := experts_metadata(model)) else {})}.items())))


_SHARD_NOT_READ = ("its forward does not read its sequence shard (tensoropt.models.sequence): context parallelism "
                   "runs the built-in models, whose positions, causal mask and attention follow the shard")


@contextlib.contextmanager
def _quiet_fake_tensors():
    """Within: torch's fake tensors do not log the traceback of an op that fails on them (an ERROR record with the
    stack): the capture turns the failure into its one line (``_translate_error``)."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def context_parallel_refusal(model: nn.Module) -> str:
    """Why ``model`` cannot run context-parallel ("" when it can). A model whose forward reads its sequence shard
    (``models.sequence``: the built-in ``DecoderLM``) says so with a ``context_parallel_refusal()`` method giving its
    own conditions (no token-routed layers); any other model computes positions and its causal mask from the length
    of the input it gets, which a sequence split makes wrong."""
    method = getattr(model, "context_parallel_refusal", None)
    return method() if callable(method) else _SHARD_NOT_READ


def output_kind(output: object) -> str:
    """What a forward returned, as far as pipeline stages care (``search.engines.pipeline_refused``): ``tensor``
    (the loss itself), ``loss`` (an output carrying it, ``.loss`` or ``["loss"]``: a Hugging Face output, whose
    other fields the stages leave out, ``runtime.pipeline.trace``) or ``structured`` (no loss there to split)."""
    if isinstance(output, torch.Tensor):
        return "tensor"
    return "loss" if loss_tensor(output) is not None else "structured"


def _trace(model: nn.Module, example_inputs: tuple | Mapping, name: str,
           autocast_dtype: torch.dtype | None) -> tuple[OpGraph, object, torch.dtype | None]:
    """(graph, the forward's output, the dtype of an autocast the forward entered on meta tensors or None).
    With ``autocast_dtype`` every tensor is a fake CPU tensor and the forward runs under a CPU autocast."""
    on_cpu = autocast_dtype is not None
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    module_names: dict[int, str] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        module_names.setdefault(id(mod), mod_name)

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = _fake_inputs(fake_mode, example_inputs, on_cpu)
    refs, input_metas = _input_refs(fakes)
    states = {n: _fake(fake_mode, t, True) for n, t in {**params, **buffers}.items()} if on_cpu else {}
    refs.update({id(states.get(n, p)): Ref("param", name=n) for n, p in params.items()})
    refs.update({id(states.get(n, b)): Ref("buffer", name=n) for n, b in buffers.items()})

    stack: list[str] = []
    tracer = _Tracer(refs, stack, watch_autocast=not on_cpu)
    saved: set[tuple[int, int]] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        r = tracer.ref(t)
        if r.kind == "op":
            saved.add((r.index, r.slot))
        return t

    def enter(mod: nn.Module, _args: object) -> None:
        stack.append(module_names.get(id(mod), type(mod).__name__))

    def leave(_mod: nn.Module, _args: object, _out: object) -> None:   # must return None
        if stack:
            stack.pop()

    args, kwargs = ((), fakes) if isinstance(fakes, Mapping) else (fakes, {})
    # not always_call: after an exception the stack still names the module that failed
    pre = nn.modules.module.register_module_forward_pre_hook(enter)
    post = nn.modules.module.register_module_forward_hook(leave)
    _TRACING.append(CPU if on_cpu else torch.device("meta"))
    try:
        with contextlib.ExitStack() as scope:
            scope.enter_context(fake_mode)
            if on_cpu:      # tensors the forward makes without a device go where the others are
                scope.enter_context(torch.device(CPU))
                scope.enter_context(torch.autocast("cpu", dtype=autocast_dtype))
            for mode in (_GpuKernels(), tracer, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)):
                scope.enter_context(mode)
            output = (torch.func.functional_call(model, states, args, kwargs) if on_cpu
                      else model(*args, **kwargs))
    except CaptureError:
        raise
    except Exception as exc:   # any failure inside user code becomes one line
        raise _translate_error(exc, tracer.current, stack[-1] if stack else "") from exc
    finally:
        _TRACING.pop()
        pre.remove()
        post.remove()

    saved_slots: dict[int, list[int]] = {}
    for index, slot in saved:
        saved_slots.setdefault(index, []).append(slot)
    ops = tuple(_build_op(i, rec, saved_slots.get(i, [])) for i, rec in enumerate(tracer.records))
    graph = OpGraph(
        name=name, ops=ops,
        params=tuple((n, _meta(p)) for n, p in params.items()),   # tied weights appear once
        buffers=tuple((n, _meta(b)) for n, b in buffers.items()),
        inputs=tuple(input_metas),
    )
    return graph, output, tracer.autocast_seen


def _build_op(index: int, rec: _Record, saved_slots: list[int]) -> Op:
    inputs = tuple(_meta(t) for t in rec.in_tensors)
    outputs = tuple(_meta(t) for t in rec.out_tensors)
    kind = op_kind(rec.func.overloadpacket.__name__)
    return Op(
        index=index, target=str(rec.func), kind=kind, module_path=rec.module_path,
        inputs=inputs, outputs=outputs, sources=tuple(rec.sources), attrs=rec.attrs,
        forward_flops=rec.forward_flops,
        backward_flops=backward_flops(kind, rec.forward_flops, rec.grad_operands, rec.requires_grad),
        bytes_read=sum(m.nbytes for m in inputs), bytes_written=sum(m.nbytes for m in outputs),
        saved_bytes=sum(outputs[s].nbytes for s in saved_slots),
        requires_grad=rec.requires_grad, input_views=rec.input_views,
    )
