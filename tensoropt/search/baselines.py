"""Reference solvers FT is judged against, over the same space and the same cost model.

- ``expert_grid``: how people plan by hand after Megatron-LM (Narayanan et al., SC'21, sec. 5.4):
  tensor parallelism across the GPUs of a node, pipeline stages across nodes, data parallelism for
  the rest, one recomputation setting for every layer (full or selective), sequence parallelism on,
  ZeRO 0 or 1 (distributed optimizer), micro-batch 1, 2 or 4.
- ``nsga2``: NSGA-II (Deb et al., 2002, as implemented by pymoo) over an encoding of the whole space:
  one gene picks the global context, six genes give the share of each layer strategy. Its shares give any count
  of copies per strategy, where FT cuts a stage's copies into at most 16 equal groups (``search.ft``): NSGA-II can
  reach mixes FT cannot express (e.g. GPT-3's ``[1xnone+sp,44xselective+sp,51xfull+sp]``, 25.04 s in 39.9 GiB,
  between two of FT's points).
"""

from __future__ import annotations

import time

import numpy as np

from ..cost.model import Context, ModelCost, estimate
from ..space.plan import RECOMPUTE, BlockPlan, LayerStrategy, Plan, chain_order
from .ft import FrontierPoint, SearchResult, SearchSpace, contexts, front_by_time, layer_options


def _plan(model: ModelCost, devices: int, ctx: Context, shares: dict[LayerStrategy, float]) -> Plan:
    blocks = []
    for block, cost in model.blocks:
        options = layer_options(cost, ctx.tp, SearchSpace(ctx.global_batch))
        k = block.repeats // ctx.pp
        weights = np.array([shares.get(o, 0.0) for o in options]) + 1e-12
        raw = k * weights / weights.sum()
        counts = np.floor(raw).astype(int)
        for i in np.argsort(raw - counts)[::-1][: k - counts.sum()]:     # largest remainders
            counts[i] += 1
        blocks.append(BlockPlan(block.name, chain_order(zip(options, counts))))
    return ctx.plan(devices, tuple(blocks))


def _result(model: ModelCost, plans: list[Plan], start: float) -> SearchResult:
    estimates = [estimate(model, p) for p in plans]
    values = np.array([[e.iteration_time_s, e.peak_memory_bytes] for e in estimates])
    points = [FrontierPoint(plans[i], float(values[i, 0]), float(values[i, 1])) for i in front_by_time(values)]
    return SearchResult(points, time.perf_counter() - start, len(plans))


def expert_grid(model: ModelCost, devices: int, global_batch: int) -> SearchResult:
    start = time.perf_counter()
    per_node = model.cluster.devices_per_node
    plans = []
    grid = SearchSpace(global_batch, micro_batches=(1, 2, 4), context_parallel=(1,),    # Megatron's grid: no CP
                       expert_parallel=(1,))                                          # nor EP
    for dp, tp, pp, branches, mb, globals_, _, _ in contexts(model, devices, grid):
        megatron_tp = max(t for t in range(1, per_node + 1) if per_node % t == 0 and model.tp_allowed(t)
                          and devices % t == 0)
        if tp != megatron_tp or set(branches) != set(model.branch_names if tp > 1 else ()):
            continue
        if pp > 1 and dp * tp < per_node:
            continue                                   # pipeline stages go across nodes
        for recompute in ("full", "selective"):
            strategy = LayerStrategy(recompute, tp > 1)
            if recompute == "selective" and not any(s.attention_core for s in model.spaces):
                continue
            for v, z, off, grad in globals_:
                if v == 1 and z <= 1 and not off and not grad:
                    plans.append(_plan(model, devices, Context(dp, tp, pp, v, mb, global_batch, z, off, branches),
                                       {strategy: 1.0}))
    return _result(model, plans, start)


def nsga2(model: ModelCost, devices: int, global_batch: int, seconds: float, seed: int = 0,
          population: int = 64) -> SearchResult:
    """NSGA-II for ``seconds`` of wall time over FT's global contexts and layer strategies, with any count of
    copies per strategy (module doc)."""
    from pymoo.algorithms.moo.nsga2 import NSGA2
    from pymoo.core.problem import ElementwiseProblem
    from pymoo.optimize import minimize
    from pymoo.termination.max_time import TimeBasedTermination

    start = time.perf_counter()
    space = SearchSpace(global_batch)
    ctxs = [Context(dp, tp, pp, v, mb, global_batch, z, off, br, cp=cp, ep=ep)
            for dp, tp, pp, br, mb, globals_, cp, ep in contexts(model, devices, space) for v, z, off, _ in globals_]
    strategies = [LayerStrategy(r, sp) for r in RECOMPUTE for sp in (False, True)]
    evaluated: list[Plan] = []

    class PlanProblem(ElementwiseProblem):
        def __init__(self):
            super().__init__(n_var=1 + len(strategies), n_obj=2, xl=0.0, xu=1.0)

        def _evaluate(self, x, out, *args, **kwargs):
            ctx = ctxs[min(int(x[0] * len(ctxs)), len(ctxs) - 1)]
            shares = {s: float(w) for s, w in zip(strategies, x[1:]) if ctx.tp > 1 or not s.sequence_parallel}
            plan = _plan(model, devices, ctx, shares)
            e = estimate(model, plan)
            evaluated.append(plan)
            out["F"] = [e.iteration_time_s, e.peak_memory_bytes]

    minimize(PlanProblem(), NSGA2(pop_size=population), TimeBasedTermination(seconds), seed=seed, verbose=False)
    return _result(model, evaluated, start)


def hypervolume(fronts: dict[str, np.ndarray]) -> dict[str, float]:
    """Hypervolume of each (time, memory) front after normalising all of them to [0, 1] together;
    reference point (1.1, 1.1). Larger is better."""
    from pymoo.indicators.hv import Hypervolume

    every = np.concatenate(list(fronts.values()))
    low, high = every.min(axis=0), every.max(axis=0)
    scale = np.where(high > low, high - low, 1.0)
    indicator = Hypervolume(ref_point=np.array([1.1, 1.1]))
    return {name: float(indicator((front - low) / scale)) for name, front in fronts.items()}
