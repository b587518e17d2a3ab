"""At capture: run every tensor-parallel layout the space would offer through the runtime's own sharding, on fake
tensors, so that a layout the workers cannot run is never offered.

``space.tp_check`` runs each branch on one rank's share of features with hooks (shapes only, no runtime code), and
``space.sp_check`` reads from the graph whether a block's stream may be split by sequence. Neither runs what the
workers run: ``torch``'s parallel styles and DTensor (``runtime.parallel.tp_styles``) and the sequence-parallel hooks
(``runtime.parallel.sequence_parallel``). Code the analysis accepts can still fail there: a model adding into a row
linear's output in place, or a norm inside a branch (Qwen3's per-head ``q_norm``/``k_norm``) whose weight sequence
parallelism makes a ``Replicate`` DTensor while it meets the branch's local tensor ("aten.mul.Tensor got mixed
torch.Tensor and DTensor"). The workers' check (``runtime.parallel.tp_guard``) finds these, but only once the plan was
chosen. So while the model is captured, the first copy of each block is sharded exactly as the workers shard it
(``tp_styles.shard_copy``), on a fake process group of each degree (``torch.testing``'s ``fake`` backend:
collectives return at once) and run forward and backward on fake tensors (nothing allocated):

- the branches, at each degree the space may offer the block (dividing every branch's checked ``max_tp``, up to
  64): all sharded at once first, each alone only where that fails (``_branches_failing``); a branch that fails
  alone is refused at that degree and its multiples, as ``tp_check`` refuses one;
- the copy sequence-parallel with no branch and with every branch sharded, at each such degree that divides the
  sequence: a block that fails is not offered sequence parallelism at that degree and its multiples.

The results join ``tp_check``'s in the graph's metadata (the block's entry ``SP_CHECK_KEY`` for sequence
parallelism), so the space, the cost model, ``--plan``'s checks and ``inspect`` read one verdict with its reason.
Values are still compared by the workers (``tp_guard``).
"""

from __future__ import annotations

import contextlib
import copy as copying
import json
import math
from collections.abc import Iterable, Iterator, Mapping
from functools import partial
from pathlib import Path

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten

from ...graph import block_verdicts
from ...graph.fold import fold
from ...graph.grouped_mm_meta import install_grouped_mm_meta
from ...graph.ir import OpGraph
from ...space.block import analyse_block
from ...space.run_plan import TPBranch
from ...space.sp_check import SP_CHECK_KEY
from ...space.tp_check import checked_degrees, first_copy_inputs
from ...space.tp_layout import tp_layout
from ...space.tp_meta import TP_CHECKS_META, tp_checks
from .tp_styles import shard_copy


def probe_layouts(model: nn.Module, example_inputs, graph: OpGraph, cache_dir: Path | None = None,
                  sources: Iterable[str] = ()) -> dict:
    """``graph``'s tensor-parallel checks (``space.tp_check``, recorded in it) with the runtime's own runs added
    (module doc): {block: {branch: {"max_tp": m} | {"refused": why}, SP_CHECK_KEY: {"max_tp": m} | {"refused":
    why}}}. Unchanged where a process group already exists (the probe needs its own fake one). With ``cache_dir``
    a block whose verdict is stored there under its key (``graph.block_verdicts``: its ops, layout, parameters, and
    the code of ``sources`` and of its classes) is not run again; the launcher's capture passes it, in-process
    callers that patch the runtime do not."""
    install_grouped_mm_meta()        # a float32 MoE layer's grouped products run on these fakes (graph.grouped_mm_meta)
    import torch.distributed as dist
    checks = json.loads(graph.meta(TP_CHECKS_META) or "{}")
    if dist.is_available() and dist.is_initialized():
        return checks
    seq_len = int(graph.meta("seq_len") or 0) or None
    layout = tp_layout(graph)
    cases: dict[str, tuple[str, tuple[TPBranch, ...], bool]] = {}   # block -> (scope, branches, SP analysed ok)
    blocks = fold(graph).blocks
    for block in blocks:
        space = analyse_block(block.ops, seq_len, checks=tp_checks(graph, block.name))
        branches = tuple(TPBranch.from_json(b, block.name) for b in layout.get(block.name, []))
        sp_ok = not space.sequence_refused and bool(seq_len)
        if branches or sp_ok:
            cases[block.name] = (block.occurrences[0].scope, branches, sp_ok)
    modules = dict(model.named_modules())
    cases = {b: c for b, c in cases.items() if c[0] in modules}
    missed = {}
    if cache_dir is not None:
        ops = {b.name: b.ops for b in blocks}
        keys = {name: block_verdicts.block_key("layout_probe", modules[scope], ops[name], tuple(sources), branches=[
            repr(b) for b in branches], sp=sp_ok, seq_len=seq_len, entry=checks.get(name))
            for name, (scope, branches, sp_ok) in cases.items()}
        missed = block_verdicts.reuse(cache_dir, keys, cases, checks)
    if cases:
        with _outside_capture():
            _probe_cases(model, example_inputs, cases, checks, seq_len)
    block_verdicts.keep(cache_dir, missed, checks)
    return checks


def _probe_cases(model: nn.Module, example_inputs, cases: dict, checks: dict, seq_len: int | None) -> None:
    modules = dict(model.named_modules())
    fake_mode, cpu = FakeTensorMode(allow_non_fake_inputs=True), torch.device("cpu")
    inputs = first_copy_inputs(model, example_inputs if isinstance(example_inputs, (tuple, Mapping))
                               else (example_inputs,), {scope for scope, _, _ in cases.values()}, fake_mode, cpu)
    for name, (scope, branches, sp_ok) in cases.items():
        if scope in inputs:
            _probe_block(modules[scope], inputs[scope], scope, branches, sp_ok and seq_len, checks.setdefault(name, {}),
                         fake_mode)


def _probe_block(copy: nn.Module, inputs: tuple, scope: str, branches: tuple[TPBranch, ...], seq_len: int | None,
                 entry: dict, fake_mode) -> None:
    """Add the runtime's runs of one block's first copy to its entry (module doc); sequence-parallel ones only
    with ``seq_len`` (the analysis allows it)."""
    # the space plans a block at degrees dividing every branch's ``max_tp`` (``BlockSpace.tp_allowed``): no other
    # degree is offered, so none other is run
    offered = math.gcd(*(b.max_tp for b in branches)) if branches else 0
    failed = _branches_failing(offered, branches, partial(_fails, copy, inputs, layout=None, fake_mode=fake_mode,
                                                           scope=scope))
    for branch in branches:
        result = _verdict(checked_degrees(offered), failed[branch.branch])
        if result and (result.get("max_tp") or 0) < _largest(offered):     # a degree failed: kept with its limit
            entry[branch.branch] = _stricter(entry.get(branch.branch), result)
    usable = tuple(b for b in branches if "refused" not in entry.get(b.branch, {}))
    if seq_len and usable:
        offered = math.gcd(seq_len, *(entry.get(b.branch, {}).get("max_tp", b.max_tp) for b in usable))
        if result := _degrees_passing(offered, partial(_sp_fails, copy, inputs, usable, branches, fake_mode, scope),
                                      "sequence parallelism"):
            entry[SP_CHECK_KEY] = result


def _sp_fails(copy, inputs, usable, layout, fake_mode, scope: str, tp: int) -> str:
    """Why the copy run sequence-parallel over ``tp`` ranks fails with no branch sharded (each runs whole, its input
    gathered and output sliced) or with every branch ``tp`` allows sharded (column and row styles); "" if neither
    does. Between them they run each branch both ways; mixed sets run the same code per branch."""
    allowed = tuple(b for b in usable if b.max_tp % tp == 0)
    for sharded in dict.fromkeys(((), allowed)):
        if why := _fails(copy, inputs, sharded, layout, fake_mode, scope, tp):
            names = "+".join(b.branch for b in sharded) or "no branch"
            return f"{why} (sharding {names})"
    return ""


def _branches_failing(limit: int, branches: tuple[TPBranch, ...], fails) -> dict[str, dict[int, str]]:
    """{branch: {degree: why}}: the degrees dividing ``limit`` at which each branch, sharded alone, fails (none run
    at a multiple of one that failed). Each degree first runs every branch still in play sharded at once, and each
    alone only if that fails: without sequence parallelism a row linear hands the next branch a whole local tensor
    (``use_local_output``), as the unsharded model does, so branches sharded together run as each does alone."""
    failed: dict[str, dict[int, str]] = {b.branch: {} for b in branches}
    for tp in checked_degrees(limit):
        live = tuple(b for b in branches if not any(tp % bad == 0 for bad in failed[b.branch]))
        if len(live) > 1 and not fails(live, tp=tp):
            continue
        for branch in live:
            if why := fails((branch,), tp=tp):
                failed[branch.branch][tp] = why
    return failed


def _degrees_passing(limit: int, fails, what: str = "") -> dict | None:
    """{"max_tp": m}: the largest degree dividing ``limit`` (up to ``MAX_CHECKED_TP``) all of whose divisors pass;
    {"refused": why} where none does; None where no degree above 1 divides ``limit`` (nothing to run)."""
    failed: dict[int, str] = {}
    degrees = checked_degrees(limit)
    for tp in degrees:
        if not any(tp % bad == 0 for bad in failed) and (why := fails(tp)):
            failed[tp] = why
    return _verdict(degrees, failed, what)


def _verdict(degrees: list[int], failed: dict[int, str], what: str = "") -> dict | None:
    """``_degrees_passing``'s answer from the degrees run and those that failed, with why."""
    if not degrees:
        return None
    good = [d for d in degrees if not any(d % bad == 0 for bad in failed)]
    if good:
        return {"max_tp": max(good)}
    tp, why = min(failed.items())
    return {"refused": f"{what + ' ' if what else ''}on {tp} tensor-parallel ranks {why}".strip()}


def _largest(limit: int) -> int:
    return max(checked_degrees(limit), default=1)


def _stricter(tp_checked: dict | None, probed: dict) -> dict:
    if tp_checked is None or "refused" in tp_checked:
        return tp_checked or probed
    if "refused" in probed:
        return probed
    return {"max_tp": min(tp_checked["max_tp"], probed["max_tp"])}


def _fails(copy: nn.Module, inputs: tuple, sharded, layout, fake_mode, scope: str, tp: int) -> str:
    """Why the runtime's copy of ``copy`` with ``sharded`` sharded over ``tp`` fake ranks (sequence-parallel with
    ``layout`` unless None) does not run forward and backward on fake tensors; "" if it does."""
    args, kwargs = inputs
    try:
        probe = _on_fake_cpu(copying.deepcopy(copy).train(), fake_mode)
        with _fake_group(tp) as mesh, fake_mode:
            shard_copy(probe, tuple(sharded), mesh, layout, scope)
            leaves = [t for t in tree_flatten(probe(*args, **kwargs))[0]
                      if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
            if leaves:
                sum(t.sum() for t in leaves).backward()
    except Exception as exc:  # the model's code failing under the runtime's sharding is the finding
        text = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        return f"the runtime's sharded {scope} fails on fake tensors: {type(exc).__name__}: {text}"
    return ""


def _on_fake_cpu(module: nn.Module, fake_mode) -> nn.Module:
    """``module`` with every parameter and buffer a fake CPU tensor of its shape (the captured model is on meta,
    whose tensors DTensor cannot copy into shards), ties kept."""
    made: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            with fake_mode:
                value = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
            made[id(t)] = nn.Parameter(value, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) \
                else value
        return made[id(t)]
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None:
                sub._parameters[name] = fake(param)
        for name, buffer in list(sub._buffers.items()):
            if buffer is not None:
                sub._buffers[name] = fake(buffer)
    return module


@contextlib.contextmanager
def _outside_capture() -> Iterator[None]:
    """Without the capture's torch-function modes (``capture_run``: every device is meta): the probe's tensors are
    fake CPU tensors."""
    with contextlib.ExitStack() as stack:
        while torch._C._len_torch_function_stack():
            stack.enter_context(torch.overrides._pop_mode_temporarily())
        yield


@contextlib.contextmanager
def _fake_group(world: int) -> Iterator[object]:
    """A fake default process group of ``world`` ranks (this process rank 0) and its 1-D device mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield DeviceMesh("cpu", list(range(world)))
    finally:
        dist.destroy_process_group()


__all__ = ["probe_layouts"]
