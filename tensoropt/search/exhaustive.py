"""Exhaustive enumeration: the reference FT is judged against on small cases.

The same global choices as ``ft.search``, but every *ordered* sequence of strategies over a stage's
groups of copies is priced on its own through ``device_chain_sums`` (the code ``estimate`` uses: with
virtual stages and sequence parallelism, split into the device's stages' chains), with no
Pareto pruning before the end. The plans of one context are priced in one ``evaluate`` call, which prices each
entry as it would price it alone (``tests/test_pricing.py``). Exponential in the number of copies: small models only.
"""

from __future__ import annotations

import itertools
import time

import numpy as np

from ..cost.model import Context, ModelCost, device_chain_sums, evaluate
from ..space.plan import BlockPlan
from .ft import FrontierPoint, SearchResult, SearchSpace, contexts, device_split, front_by_time, layer_options


def exhaustive_search(model: ModelCost, devices: int, space: SearchSpace, max_sequences: int = 200_000) -> SearchResult:
    start = time.perf_counter()
    values, plans = [], []
    for dp, tp, pp, branches, mb, globals_, cp, ep in contexts(model, devices, space):
        chains_of = {}                 # the blocks' priced sequences for each number of virtual stages
        for v, z, off, grad in globals_:
            per_block = chains_of.setdefault(v, [])
            for block, cost in model.blocks if not per_block else ():
                options = layer_options(cost, tp, space)
                copies = block.repeats // pp
                chains, groups, size = device_split(space.groups(copies, block.repeats)[1], copies, v,
                                                    any(o.sequence_parallel for o in options))
                groups *= chains
                if len(options) ** groups > max_sequences:
                    raise ValueError(f"{len(options)}^{groups} sequences: too many for exhaustive search")
                per_block.append([([(o, size) for o in seq],
                                   device_chain_sums(cost, [(o, size) for o in seq], tp, branches, mb, v, cp, ep))
                                  for seq in itertools.product(options, repeat=groups)])
            ctx = Context(dp, tp, pp, v, mb, space.global_batch, z, off, branches, space.dtype,
                          space.master_weights, space.precision, engine=space.engine, grad_dtype=grad, cp=cp, ep=ep)
            combos = list(itertools.product(*per_block))
            sums = np.array([[c[1] for c in combo] for combo in combos])     # (combination, block, sum)
            # one call per context: evaluate prices each entry of its arrays as it would price it alone
            r = evaluate(model, ctx, sums[:, :, 0].sum(axis=1), sums[:, :, 1].sum(axis=1), sums[:, :, 2].sum(axis=1),
                         sums[:, :, 3].max(axis=1), sums[:, :, 4].sum(axis=1))
            values += zip(r["iteration_time_s"].tolist(), r["peak_memory_bytes"].tolist())
            plans += [(ctx, [seq for seq, _ in combo]) for combo in combos]
    values = np.array(values)
    points = []
    for k in front_by_time(values):
        ctx, seqs = plans[k]
        blocks = tuple(BlockPlan(block.name, tuple(seq)) for (block, _), seq in zip(model.blocks, seqs))
        plan = ctx.plan(devices, blocks)
        points.append(FrontierPoint(plan, float(values[k, 0]), float(values[k, 1])))
    return SearchResult(points, time.perf_counter() - start, len(values))
