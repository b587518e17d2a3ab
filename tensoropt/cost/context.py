"""The global choices of a plan (``Context``: everything but its per-layer strategies), one at a time or many as
columns (``ContextTable``).

The search enumerates thousands of contexts and prices them in a few numpy calls (``cost.model.evaluate_rows``):
as columns, a context costs one tuple while they are enumerated and one entry per array while they are priced, where
a ``Context`` object each cost more Python work than its pricing did (GPT-3 175B on 1024 GPUs: ~1600 contexts, most
of them dropped by ``search.bounds`` right after). A ``Context`` is built only for the plans the search returns.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..space.plan import BlockPlan, Plan


@dataclass(frozen=True)
class Context:
    """The global choices of a plan (everything but the per-layer strategies)."""

    dp: int
    tp: int
    pp: int
    virtual_stages: int
    micro_batch: int
    global_batch: int
    zero: int
    offload: bool
    tp_branches: tuple[str, ...]
    dtype: str = "bfloat16"          # the training precision: sizes the model states (``state_bytes``)
    master_weights: bool = True      # a float32 master copy of 16-bit weights (mixed precision)
    precision: str = ""              # one of space.plan.PRECISIONS; "": as dtype and master_weights say
    compile: bool = False            # compiled blocks (fused kernels) rather than eager PyTorch: ModelCost.compiled
    engine: str = ""                 # the engine priced: "deepspeed" adds its own buffers (cost.deepspeed_memory)
    grad_dtype: str = ""             # gradients accumulated and reduced in bf16 ("bfloat16"; ``Plan.grad_dtype``)
    cp: int = 1                      # context parallelism: each sample's sequence split over cp ranks (``Plan.cp``)
    ep: int = 1                      # expert parallelism: the experts sharded over ep of the dp ranks (``Plan.ep``)

    @property
    def micro_batches(self) -> int:
        return self.global_batch // (self.dp * self.micro_batch)

    @staticmethod
    def of(plan: Plan) -> Context:
        return Context(plan.dp, plan.tp, plan.pp, plan.virtual_stages, plan.micro_batch, plan.global_batch,
                       plan.zero, plan.offload, plan.tp_branches, plan.dtype, plan.master_weights, plan.precision,
                       plan.compile, plan.engine, plan.grad_dtype, plan.cp, plan.ep)

    def plan(self, devices: int, blocks: tuple[BlockPlan, ...]) -> Plan:
        """The plan of these global choices with these per-block strategies (inverse of ``of``)."""
        return Plan(devices, self.dp, self.tp, self.pp, self.micro_batch, self.global_batch, self.virtual_stages,
                    self.zero, self.offload, self.tp_branches, self.dtype, blocks, self.master_weights,
                    self.precision, self.compile, self.engine, self.grad_dtype, self.cp, self.ep)


@dataclass(frozen=True)
class ContextTable:
    """Contexts as columns, one entry per context. The choices that are numbers are arrays; the others index small
    tuples: ``branches`` the branch sets tp shards, ``kind`` the rest (global batch, dtype, master weights,
    precision, compile, engine, gradient dtype), of which one search has a handful."""

    dp: np.ndarray
    tp: np.ndarray
    pp: np.ndarray
    virtual_stages: np.ndarray
    micro_batch: np.ndarray
    zero: np.ndarray
    offload: np.ndarray                    # bool
    branches: np.ndarray                   # index into ``branch_sets``
    kind: np.ndarray                       # index into ``kinds``
    cp: np.ndarray                         # context-parallel degree (``Context.cp``)
    ep: np.ndarray                         # expert-parallel degree (``Context.ep``)
    branch_sets: tuple[tuple[str, ...], ...]
    kinds: tuple[tuple, ...]               # (global_batch, dtype, master_weights, precision, compile, engine, grad)

    # the columns of a row tuple, in order (``of_rows``)
    COLUMNS = ("dp", "tp", "pp", "virtual_stages", "micro_batch", "zero", "offload", "branches", "kind", "cp", "ep")

    def __len__(self) -> int:
        return len(self.dp)

    @staticmethod
    def of_rows(rows: list[tuple] | np.ndarray, branch_sets: tuple[tuple[str, ...], ...], kinds: tuple[tuple, ...]
                ) -> ContextTable:
        """A table of ``rows``, each (dp, tp, pp, virtual stages, micro-batch, zero, offload, branches, kind, cp,
        ep)."""
        columns = np.array(rows, dtype=np.int64).reshape(-1, len(ContextTable.COLUMNS)).T
        values = dict(zip(ContextTable.COLUMNS, columns))
        values["offload"] = values["offload"].astype(bool)
        return ContextTable(**values, branch_sets=branch_sets, kinds=kinds)

    @staticmethod
    def of(contexts: list[Context]) -> ContextTable:
        """The table of these contexts, in their order."""
        branch_sets = tuple(dict.fromkeys(c.tp_branches for c in contexts))
        kinds = tuple(dict.fromkeys(_kind(c) for c in contexts))
        where_branches, where_kind = {b: i for i, b in enumerate(branch_sets)}, {k: i for i, k in enumerate(kinds)}
        return ContextTable.of_rows([(c.dp, c.tp, c.pp, c.virtual_stages, c.micro_batch, c.zero, c.offload,
                                      where_branches[c.tp_branches], where_kind[_kind(c)], c.cp, c.ep)
                                     for c in contexts],
                                    branch_sets, kinds)

    def context(self, i: int) -> Context:
        """Row ``i`` as a ``Context``."""
        global_batch, dtype, master, precision, compile, engine, grad = self.kinds[int(self.kind[i])]
        return Context(int(self.dp[i]), int(self.tp[i]), int(self.pp[i]), int(self.virtual_stages[i]),
                       int(self.micro_batch[i]), global_batch, int(self.zero[i]), bool(self.offload[i]),
                       self.branch_sets[int(self.branches[i])], dtype, master, precision, compile, engine, grad,
                       int(self.cp[i]), int(self.ep[i]))


def _kind(c: Context) -> tuple:
    return c.global_batch, c.dtype, c.master_weights, c.precision, c.compile, c.engine, c.grad_dtype


__all__ = ["Context", "ContextTable"]
