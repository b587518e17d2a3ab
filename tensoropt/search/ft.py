"""Frontier-tracking search (FT; Cai et al., "TensorOpt", IEEE TPDS 2021, arXiv 2004.10856).

Dynamic programming whose states hold Pareto sets instead of single values. A copy's options are its
layer strategies (recomputation x sequence parallelism) priced by the cost model; moving the carried stream
between its layouts (replicated, or split by sequence for sequence-parallel copies) costs a collective. A
chain's set for k copies is built by repeated doubling of one-step sets in O(log k) Minkowski sums
(``search.chain.Chain``: as multisets of strategies, the layout changes added in closed form), and equals the
copy-by-copy DP (tests check both against exhaustive enumeration).

A stage's copies of a block are split into at most ``max_layer_groups`` equal groups, each running
one strategy (``recompute-num-layers`` in Megatron-LM is such a split): the chain's steps are groups,
so its cost depends on the number of groups, not on the depth.

With v interleaved virtual stages and sequence-parallel options a device's k copies run as v chains
of k / v, one per stage, each entered and left replicated (the runtime slices and gathers in every
stage holding SP copies): the device's set is the Minkowski sum of v chain sets (``device_split``,
``Chain.device``), which prices any multiset of strategies at its best split, the one the runtime
runs (``space.plan.chain_order``: whole copies first, so the SP ones fill the fewest stages).

Around the chains, the global choices are enumerated: mesh (dp, tp, pp) with tp inside a node, or (dp, cp, tp)
with context parallelism (pp 1: what the runtime runs it with; ``space.context_parallel``),
which branches tp shards, micro-batch size, interleaved stages, ZeRO stage, optimizer offload, gradient dtype.
Every candidate is priced by the same code as ``tensoropt estimate`` (``evaluate_rows``, of which
``evaluate`` is the one-plan case), and the non-dominated (time, peak memory) points form the frontier.

Speed: the work is numpy over many small sets, so it is done in few calls. The contexts are columns of a
``ContextTable`` (one tuple each while enumerated, built per mesh and micro-batch with numpy; a ``Context`` object
only for the plans returned). The chains of one block are computed together for every (tp, group size, branches,
micro-batch) they are needed for (one Pareto set per key in one ``ParetoSets`` array; search/pareto.py), layer
costs are cached per (strategy, tp, branches, micro-batch) on the block's cost (and the cost model is kept between
plans of the same graph and devices: ``planning.model_cost``), contexts an engine does not run or that a real plan
beats everywhere (``search.bounds``) are dropped before their chains are built, and all candidates are priced in
one call and pruned once. Each of these gives the very floats the one-at-a-time computation gives
(tests/test_pricing.py, tests/test_search.py).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..cost.accumulation import accumulation_bytes
from ..cost.context import Context, ContextTable
from ..cost.layer import BlockCost
from ..cost.model import ModelCost, evaluate_rows
from ..cost.states import state_bytes
from ..space.context_parallel import default_degrees, graph_refusal
from ..space.plan import RECOMPUTE, BlockPlan, LayerStrategy, Plan, chain_order, divisors, meshes
from .bounds import Seeds, bound_contexts
from .chain import Chain, Key
from .pareto import ParetoSet, combine, front_by_time


@dataclass(frozen=True)
class SearchSpace:
    global_batch: int
    micro_batches: tuple[int, ...] = (1, 2, 4, 8)
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    recompute: tuple[str, ...] = RECOMPUTE
    sequence_parallel: bool = True
    offload: bool = True
    max_virtual_stages: int = 4
    pipeline_stages: tuple[int, ...] | None = None   # restrict pp (None: every even split)
    tensor_parallel: tuple[int, ...] | None = None   # restrict tp (None: every degree inside a node)
    max_layer_groups: int = 16         # a stage's copies of a block form at most this many equal groups,
    #                                    each with one strategy: bounds the work per chain whatever the depth

    def groups(self, copies: int, repeats: int) -> tuple[int, int]:
        """(groups, copies per group) for ``copies`` copies of a block on one stage.

        The group size is fixed per block, the smallest that splits all its ``repeats`` into at
        most ``max_layer_groups`` groups, reduced to divide the stage's copies: every pipeline depth
        then shares one chain and its doubling powers."""
        base = min(d for d in divisors(repeats) if repeats // d <= self.max_layer_groups)
        size = math.gcd(base, copies)
        return copies // size, size
    eps: float = 0.002                 # epsilon-dominance while composing (0 = exact); see search/pareto.py
    dtype: str = "bfloat16"            # training precision: sizes the model states (cost.model.state_bytes)
    master_weights: bool = True        # a float32 master copy of 16-bit weights (mixed precision)
    precision: str = ""                # one of space.plan.PRECISIONS ("": as dtype and master_weights say)
    engine: str = ""                   # the engine the plans are priced for ("": the torch engine's memory)
    # gradient layouts searched (``Plan.grad_dtype``): "" the precision's own; "bfloat16" bf16 accumulation and
    # reduction, a sharded optimizer's layout (ZeRO 1-3: under ZeRO 0 the gradients are the weights' dtype)
    grad_dtypes: tuple[str, ...] = ("",)
    # context-parallel degrees searched (``Plan.cp``; 1: none, every other mesh): None, 1 and the degrees leaving
    # each rank at least ``space.context_parallel.MIN_TOKENS_PER_RANK`` tokens (``default_degrees``)
    context_parallel: tuple[int, ...] | None = None
    # expert-parallel degrees searched (``Plan.ep``; 1: none) for a Mixture-of-Experts model: None, every degree
    # dividing dp and the experts (``space.experts.Experts.degrees``)
    expert_parallel: tuple[int, ...] | None = None


@dataclass(frozen=True)
class FrontierPoint:
    plan: Plan
    iteration_time_s: float
    peak_memory_bytes: float


@dataclass
class SearchResult:
    points: list[FrontierPoint]
    seconds: float
    candidates: int = 0
    stats: dict = field(default_factory=dict)


def layer_options(cost: BlockCost, tp: int, space: SearchSpace) -> list[LayerStrategy]:
    recompute = [r for r in space.recompute if r != "selective" or cost.space.attention_core]
    sps = (False, True) if space.sequence_parallel and cost.space.sp_allowed(tp) else (False,)
    return [LayerStrategy(r, sp) for r in recompute for sp in sps]


def _combine_blocks(parts: list[ParetoSet], eps: float) -> ParetoSet:
    """Blocks run one after another: Minkowski sum, counts side by side."""
    total = None
    for part in parts:
        if total is None:
            total = part
            continue
        grown = ParetoSet(total.values, np.pad(total.counts, ((0, 0), (0, part.counts.shape[1]))))
        shifted = ParetoSet(part.values, np.pad(part.counts, ((0, 0), (total.counts.shape[1], 0))))
        total = combine(grown, shifted, eps)
    return total


def device_split(size: int, copies: int, virtual_stages: int, sequence_parallel: bool) -> tuple[int, int, int]:
    """(chains, groups per chain, copies per group) of a device's ``copies`` copies of a block grouped
    ``size`` at a time. With virtual stages and sequence-parallel options each of the device's v stages
    enters and leaves its own chain replicated (cost.model.device_chain_sums), so the device's copies
    are v chains of k / v (groups shrunk to divide them); otherwise one chain (layout changes are then
    the same in any split). A k that v does not divide is priced, and run, as one chain."""
    chains = virtual_stages if sequence_parallel and virtual_stages > 1 and copies % virtual_stages == 0 else 1
    size = math.gcd(size, copies // chains)
    return chains, copies // chains // size, size


def cp_degrees(model: ModelCost, devices: int, space: SearchSpace) -> tuple[int, ...]:
    """The context-parallel degrees > 1 searched for ``model`` on ``devices``: the space's (or the default ones),
    where the model runs them (``space.context_parallel``) on eager kernels of the torch engine (a space for
    DeepSpeed has none), with pp 1 in the space's limits."""
    seq = int(model.graph.meta("seq_len") or 0) or None
    wanted = default_degrees(devices, seq) if space.context_parallel is None else space.context_parallel
    if model.compiled or space.engine == "deepspeed" \
            or (space.pipeline_stages is not None and 1 not in space.pipeline_stages):
        return ()
    return tuple(cp for cp in sorted(set(wanted)) if cp > 1 and devices % cp == 0
                 and not graph_refusal(model.graph, cp))


def ep_searched(model: ModelCost, space: SearchSpace) -> bool:
    """Whether the search tries expert parallelism for ``model``: a Mixture-of-Experts model on eager kernels of the
    torch engine (a space for DeepSpeed has none), with pp 1 in the space's limits and no context parallelism
    required."""
    return bool(model.experts.modules) and not model.compiled and space.engine != "deepspeed" \
        and (space.pipeline_stages is None or 1 in space.pipeline_stages) \
        and (space.context_parallel is None or 1 in space.context_parallel)


def _branch_sets(names: tuple[str, ...], tp: int) -> list[tuple[str, ...]]:
    """The sets of branches tp may shard: none at tp 1, else every non-empty one, largest first."""
    return [()] if tp == 1 else [c for r in range(len(names), 0, -1) for c in itertools.combinations(names, r)]


def contexts(model: ModelCost, devices: int, space: SearchSpace):
    """Every global choice the runtime supports for this model on ``devices`` devices: (dp, tp, pp, branches,
    micro-batch, (virtual stages, ZeRO, offload, gradients) choices, cp, ep)."""
    cluster = model.cluster
    max_tp = int(np.gcd.reduce([b.max_tp for s in model.spaces for b in s.branches])) if model.branch_names else 1
    by_virtual: dict[tuple[int, ...], tuple] = {}        # the global choices of each virtual-stage list, built once
    virtuals: dict[tuple[int, bool], tuple[int, ...]] = {}        # per (pp, micro-batches fill the stages)
    names, repeats = model.branch_names, model.blocks[0][0].repeats if model.blocks else 1
    for dp, tp, pp in meshes(devices, cluster.devices_per_node, max_tp, model.max_pp):
        if not model.tp_allowed(tp) or (space.pipeline_stages is not None and pp not in space.pipeline_stages) \
                or (space.tensor_parallel is not None and tp not in space.tensor_parallel) \
                or (space.context_parallel is not None and 1 not in space.context_parallel):
            continue
        if space.expert_parallel is not None and 1 not in space.expert_parallel:
            continue
        copies = repeats // pp
        for branches in _branch_sets(names, tp):
            for mb in space.micro_batches:
                if space.global_batch % (dp * mb):
                    continue
                whole = (space.global_batch // (dp * mb)) % pp == 0     # micro-batches fill the interleaved stages
                if (pp, whole) not in virtuals:
                    virtuals[(pp, whole)] = tuple(v for v in divisors(copies) if v <= space.max_virtual_stages
                                                  and (v == 1 or whole)) if pp > 1 else (1,)
                virtual = virtuals[(pp, whole)]
                if virtual not in by_virtual:
                    by_virtual[virtual] = tuple((v, z, off, g) for v in virtual for z in space.zero_stages
                                                for off in ((False, True) if space.offload and z >= 1 else (False,))
                                                for g in space.grad_dtypes if z >= 1 or not g)
                yield dp, tp, pp, branches, mb, by_virtual[virtual], 1, 1
    # context parallelism: a (dp, cp, tp) mesh, tp inside a node, pp 1, no offload (runtime.parallel.context_parallel)
    plain = tuple((1, z, False, g) for z in space.zero_stages for g in space.grad_dtypes if z >= 1 or not g)
    for cp in cp_degrees(model, devices, space):
        for dp, tp in _unpiped_meshes(model, devices // cp, space, max_tp):
            for branches, mb in _batches(names, dp, tp, space):
                yield dp, tp, 1, branches, mb, plain, cp, 1
    # expert parallelism: ep of the dp ranks share the experts, pp 1, no offload (runtime.parallel.expert_parallel)
    for dp, tp in _unpiped_meshes(model, devices, space, max_tp) if ep_searched(model, space) else ():
        for ep in model.experts.degrees(dp):
            if space.expert_parallel is None or ep in space.expert_parallel:
                for branches, mb in _batches(names, dp, tp, space):
                    yield dp, tp, 1, branches, mb, plain, 1, ep


def _unpiped_meshes(model: ModelCost, devices: int, space: SearchSpace, max_tp: int):
    """(dp, tp) meshes of ``devices`` without pipeline stages, tp inside a node, that the model and the space allow
    (what context and expert parallelism run beside)."""
    for dp, tp, _ in meshes(devices, model.cluster.devices_per_node, max_tp, 1):
        if model.tp_allowed(tp) and (space.tensor_parallel is None or tp in space.tensor_parallel):
            yield dp, tp


def _batches(names: tuple[str, ...], dp: int, tp: int, space: SearchSpace):
    """(branches tp shards, micro-batch) pairs of a (dp, tp) mesh whose micro-batches divide the global batch."""
    for branches in _branch_sets(names, tp):
        for mb in space.micro_batches:
            if not space.global_batch % (dp * mb):
                yield branches, mb


def search(model: ModelCost, devices: int, space: SearchSpace, doubling: bool = True,
           runs: Callable[[Plan], bool] | None = None, bound: bool = True) -> SearchResult:
    """The frontier of ``space`` on ``devices``, every plan priced for ``model``'s kernels (``model.compiled``:
    compiled blocks, and the plans say ``compile``). ``runs``: whether an engine runs a plan's global choices
    (asked of a plan without blocks): the others are left out before any chain is built, so they cost nothing and
    dominate no plan that runs. ``bound``: contexts whose every plan a real plan beats are dropped before their
    chains are built (``search.bounds``; the same frontier)."""
    start = time.perf_counter()
    blocks = range(len(model.blocks))
    choices, table = _choices(model, devices, space, runs)
    split = {(b, pp): space.groups(model.blocks[b][0].repeats // pp, model.blocks[b][0].repeats)
             for b in blocks for pp in {c[2] for c in choices}}         # (groups, copies per group)
    options = {(b, tp): layer_options(model.blocks[b][1], tp, space) for b in blocks for tp in {c[1] for c in choices}}
    # a block with no strategy left (only selective recomputation allowed, and it keeps no scores) has no plan
    choices = [c for c in choices if all(options[(b, c[1])] for b in blocks)]
    sp = {key: any(o.sequence_parallel for o in opts) for key, opts in options.items()}

    layouts: dict[tuple[int, int, int], tuple[tuple[int, int, int], ...]] = {}

    def splits(tp: int, pp: int, v: int) -> tuple[tuple[int, int, int], ...]:
        if (tp, pp, v) not in layouts:
            layouts[(tp, pp, v)] = tuple(device_split(split[(b, pp)][1], model.blocks[b][0].repeats // pp, v,
                                                      sp[(b, tp)]) for b in blocks)
        return layouts[(tp, pp, v)]

    # each choice's contexts (rows of ``table``), grouped by how their virtual stages split the device's chains
    grouped = []
    for _, tp, pp, branches, mb, first, by_v, cp, ep in choices:
        by_split: dict[tuple, list[np.ndarray]] = {}
        for v, offsets in by_v:
            by_split.setdefault(splits(tp, pp, v), []).append(first + offsets)
        grouped += [(tp, branches, mb, cp, ep, layout, same[0] if len(same) == 1 else np.sort(np.concatenate(same)))
                    for layout, same in by_split.items()]
    shapes = dict.fromkeys((tp, branches, mb, cp) for tp, branches, mb, cp, _, _, _ in grouped)
    for b in blocks:                    # every layer cost the bounds and chains read, in one pass per block
        model.blocks[b][1].prepare((tp, branches, o.sequence_parallel and tp > 1, mb, cp)
                                   for tp, branches, mb, cp in shapes for o in options[(b, tp)])
    seeds = Seeds.empty(len(model.blocks))
    if bound:
        grouped, seeds = bound_contexts(model, table, grouped, options)
    # one chain per block, with a Pareto set per (tp, group size, branches, micro-batch, cp, ep) it is needed for
    needs: dict[int, dict[Key, set[tuple[int, int]]]] = {b: {} for b in blocks}
    for tp, branches, mb, cp, ep, layout, _ in grouped:
        for b, (chains, groups, size) in zip(blocks, layout):
            needs[b].setdefault((tp, size, branches, mb, cp, ep), set()).add((groups, chains))
    builders = {b: Chain(model.blocks[b][1], {key[0]: options[(b, key[0])] for key in keys}, keys, space.eps)
                for b, keys in needs.items() if keys}
    per_option: dict[tuple, tuple] = {}     # (block, tp, branches, mb, cp, ep) -> per strategy: backward s, parameters
    ctxs: list[np.ndarray] = []          # per entry of ``grouped``: its rows of ``table``
    stages = []          # per (tp, branches, micro-batch, pp, split): (stage set, option lists, backward, parameters)
    ctx_stage = []       # per context: index into stages
    for tp, branches, mb, cp, ep, layout, priced in grouped:
        parts = [builders[b].set((tp, size, branches, mb, cp, ep), groups, chains, doubling)
                 for b, (chains, groups, size) in zip(blocks, layout)]
        option_lists = [options[(b, tp)] for b in blocks]
        stage = _combine_blocks(parts, space.eps) if parts else \
            ParetoSet(np.zeros((1, 3)), np.zeros((1, 0), dtype=np.int64))
        backward, params = np.zeros(len(stage)), np.zeros(len(stage))
        for b, (_, counts) in zip(blocks, _split(stage.counts, option_lists)):
            if (b, tp, branches, mb, cp, ep) not in per_option:
                layers = [model.blocks[b][1].layer(o, tp, branches, mb, cp, ep) for o in options[(b, tp)]]
                per_option[(b, tp, branches, mb, cp, ep)] = (np.array([c.backward_s for c in layers]),
                                                         np.array([c.parameters for c in layers]))
            backward += counts @ per_option[(b, tp, branches, mb, cp, ep)][0]
            params += counts @ per_option[(b, tp, branches, mb, cp, ep)][1]
        stages.append((stage, option_lists, backward, params))
        ctxs.append(priced)
        ctx_stage += [len(stages) - 1] * len(priced)
    ctxs = np.concatenate(ctxs) if ctxs else np.zeros(0, dtype=np.int64)
    if not len(ctxs) and not len(seeds.rows):
        return SearchResult([], time.perf_counter() - start, 0, {"chains": 0, "contexts": 0})
    # every candidate (context, stage point) priced in one call: rows of all stage sets, then their contexts
    sizes = np.array([len(s[0]) for s in stages], dtype=np.int64)
    offsets = np.cumsum(sizes) - sizes
    per_ctx = sizes[ctx_stage] if len(ctxs) else np.zeros(0, dtype=np.int64)
    which = np.repeat(np.arange(len(ctxs)), per_ctx)
    row = np.repeat(offsets[ctx_stage] - (np.cumsum(per_ctx) - per_ctx), per_ctx) + np.arange(len(which)) \
        if len(ctxs) else np.zeros(0, dtype=np.int64)
    all_values = seeds.values
    if len(ctxs):
        values = np.concatenate([s[0].values for s in stages])[row]
        backward, params = (np.concatenate([s[k] for s in stages])[row] for k in (2, 3))
        r = evaluate_rows(model, table, ctxs[which], values[:, 0], backward, values[:, 1], values[:, 2], params,
                          totals_only=True)
        all_values = np.concatenate([np.stack([r["iteration_time_s"], r["peak_memory_bytes"]], axis=1), seeds.values])
    points = []
    for k in front_by_time(all_values):
        if k >= len(which):                     # one of the real plans that bounded the contexts
            s = k - len(which)
            plan = _plan(model, devices, table.context(seeds.rows[s]), *seeds.strategies(s, options))
        else:
            c = which[k]
            stage, option_lists = stages[ctx_stage[c]][:2]
            plan = _plan(model, devices, table.context(ctxs[c]), stage.counts[row[k] - offsets[ctx_stage[c]]],
                         option_lists)
        points.append(FrontierPoint(plan, float(all_values[k, 0]), float(all_values[k, 1])))
    return SearchResult(points, time.perf_counter() - start, len(all_values),
                        {"chains": len(stages), "contexts": len(ctxs), "bounded": len(seeds.rows) // 2})


def _choices(model: ModelCost, devices: int, space: SearchSpace, runs: Callable[[Plan], bool] | None
             ) -> tuple[list[tuple], ContextTable]:
    """The contexts to price, as rows of a ``ContextTable``, and per mesh, branches and micro-batch that has any:
    (dp, tp, pp, branches, micro-batch, its first row, per virtual-stage count the offsets of its rows from the
    first); those ``runs`` refuses left out. ``runs`` is asked once per (mesh, virtual stages, ZeRO, offload,
    gradients): what an engine applies does not depend on the micro-batch or the branches tp shards
    (``search.engines``). Built per choice with numpy, not per context (there are thousands)."""
    asked: dict[tuple, bool] = {}
    undominated: dict[tuple, list] = {}
    grads = {g: k for k, g in enumerate(space.grad_dtypes)}
    # ZeRO 1-3 as FSDP2 over bf16 weights with float32 states (the torch engine's bf16-mixed): ZeRO 1's gradients
    # held wider than the products make them (``cost.accumulation``), ZeRO 0's autocast copy without a counterpart
    zero0, one = (state_bytes(space.dtype, space.master_weights, space.precision, z) for z in (0, 1))
    fsdp_mixed = one.grad != one.gathered_bytes

    sums_more: dict[int, bool] = {}

    def zero1_sums_more(micro_batches: int) -> bool:
        """Whether ZeRO 1 sums a step's micro-batches in more bytes a parameter than ZeRO 0 (``cost.accumulation``),
        once per count of micro-batches."""
        if micro_batches not in sums_more:
            sums_more[micro_batches] = bool(accumulation_bytes(1, micro_batches, 1, 1, one.grad, one.gathered_bytes)
                                            > accumulation_bytes(1, micro_batches, 0, 1, zero0.grad,
                                                                 zero0.gathered_bytes))
        return sums_more[micro_batches]
    kinds = tuple((space.global_batch, space.dtype, space.master_weights, space.precision, model.compiled,
                   space.engine, g) for g in space.grad_dtypes)
    branch_sets: dict[tuple[str, ...], int] = {}

    def kept(dp, tp, pp, branches, mb, v, z, off, g, cp, ep) -> bool:
        key = (dp, tp, pp, v, z, off, g, cp, ep)
        if key not in asked:
            ctx = Context(dp, tp, pp, v, mb, space.global_batch, z, off, branches, space.dtype,
                          space.master_weights, space.precision, model.compiled, space.engine, g, cp, ep)
            asked[key] = runs is None or runs(ctx.plan(devices, ()))
        return asked[key]
    out, heads, parts, total = [], [], [], 0
    runnable: dict[tuple, tuple] = {}         # per (mesh, global choices): (v, z, off, gradients) rows, by v
    for dp, tp, pp, branches, mb, globals_, cp, ep in contexts(model, devices, space):
        # ZeRO 1's sums of this step's micro-batches take longer than ZeRO 0's (fsdp_mixed below 4 micro-batches)
        few = zero1_sums_more(space.global_batch // (dp * mb))
        key = (globals_, dp * cp == 1, few)       # data parallelism runs over the dp x cp ranks
        if key not in undominated:
            undominated[key] = _undominated(globals_, dp * cp, pp, fsdp_mixed, few)
        where = (dp, tp, pp, globals_, cp, ep, few)
        if where not in runnable:      # the same for every micro-batch and branches
            mine = np.array([(v, z, off, grads[g]) for v, z, off, g in undominated[key]
                             if kept(dp, tp, pp, branches, mb, v, z, off, g, cp, ep)], dtype=np.int64).reshape(-1, 4)
            runnable[where] = mine, tuple((int(v), np.flatnonzero(mine[:, 0] == v))
                                          for v in dict.fromkeys(mine[:, 0].tolist()))
        mine, by_v = runnable[where]
        if len(mine):
            out.append((dp, tp, pp, branches, mb, total, by_v, cp, ep))
            heads.append((dp, tp, pp, mb, branch_sets.setdefault(branches, len(branch_sets)), cp, ep, len(mine)))
            parts.append(mine)
            total += len(mine)
    if not out:
        return out, ContextTable.of_rows([], (), kinds)
    head = np.array(heads, dtype=np.int64)
    each = np.repeat(head[:, :7], head[:, 7], axis=0)       # dp, tp, pp, mb, branches, cp, ep per row
    mine = np.concatenate(parts)                             # v, z, off, gradients per row
    return out, ContextTable.of_rows(np.column_stack([each[:, :3], mine[:, 0], each[:, 3], mine[:, 1:3], each[:, 4],
                                                      mine[:, 3], each[:, 5], each[:, 6]]), tuple(branch_sets), kinds)


def _undominated(globals_: tuple[tuple[int, int, bool, str], ...], dp: int, pp: int, fsdp_mixed: bool = False,
                 few: bool = False) -> list[tuple[int, int, bool, str]]:
    """Drop global choices the cost model proves dominated, before pricing them.

    - bf16 gradients (``grad_dtype``, ZeRO 1-3) against the same choice with the precision's own float32 ones:
      the same states but for the gradients held whole under ZeRO 1 (2 bytes per parameter instead of 4), half the
      bytes reduced and copied into FSDP2's reduce-scatter input, the same compute (``cost.states.torch_mixed``),
      and sums of the micro-batches in bf16 in place instead of widened into float32 (``cost.accumulation``): no
      more time, less memory. Where both are allowed, the float32 one goes.
    - dp = 1: nothing is communicated and no stage divides anything, so every stage without offload
      prices ZeRO 0's time with ZeRO 0's memory or more (ZeRO 1 and 2 add the optimizer's partition copy
      when there is no master copy); ZeRO 0 (where allowed) stands for the precision's own gradients without
      offload. With offload the stages differ in where the micro-batches' gradients are summed (ZeRO 3 on the
      host, the others on the device: ``cost.accumulation``), so each is kept. None is dropped under the torch
      engine's bf16-mixed (``fsdp_mixed``): ZeRO 0 holds autocast's bf16 copy of the float32 weights, which FSDP2's
      bf16 gathers make needless (ZeRO 3 holds less at the same time), and FSDP2's ZeRO 1 sums bf16 gradients into
      float32 ones, 10 bytes a later micro-batch and 6 once against ZeRO 0's float32 in-place 12 (faster past 4
      micro-batches, slower below).
    - dp > 1: ZeRO 1 communicates what ZeRO 0 does (one all-reduce of the gradients) and divides the
      optimizer's states and step over dp: (K + copy) / dp <= K for dp >= 2 (the copy is 0 or half of K),
      so ZeRO 0 goes where ZeRO 1 is allowed, but for ``few``: where ZeRO 1's sums of the step's micro-batches take
      longer (``fsdp_mixed`` below 4 micro-batches: 10 (m - 1) + 6 bytes a parameter against 12 (m - 1)). ZeRO 2 is not
      comparable with them: it reduce-scatters every micro-batch and gathers once, at each collective's own
      bandwidth (gloo's run at a third of its all-reduce rate), so it can be slower; ZeRO 3 keeps the least.
    The exhaustive reference does not prune: the tests that compare it with FT check this is sound."""
    lean = {(v, z, off) for v, z, off, grad in globals_ if grad}
    stages = {z for _, z, off, grad in globals_ if not off and not grad}

    def kept(v: int, z: int, off: bool, grad: str) -> bool:
        if grad:
            return True
        if (v, z, off) in lean:
            return False
        if dp == 1:
            return off or fsdp_mixed or 0 not in stages or z == 0
        return not (z == 0 and 1 in stages and not few)
    return [g for g in globals_ if kept(*g)]


def _split(counts: np.ndarray, option_lists: list[list[LayerStrategy]]):
    start = 0
    for options in option_lists:
        yield options, counts[..., start:start + len(options)]
        start += len(options)


def _plan(model: ModelCost, devices: int, ctx: Context, counts: np.ndarray, option_lists) -> Plan:
    return ctx.plan(devices, tuple(BlockPlan(block.name, chain_order(zip(options, c)))
                                   for (block, _), (options, c) in zip(model.blocks, _split(counts, option_lists))))
