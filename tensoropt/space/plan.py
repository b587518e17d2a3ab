"""Plans: the global choices (mesh, ZeRO, micro-batching, pipeline) plus per-layer strategies.

Every field is something the runtime can apply: a (dp, tp, pp) mesh with tensor parallelism
inside a node, Megatron branches sharded over tp, sequence parallelism per layer, recomputation
per layer, ZeRO stage over dp, optimizer offload, micro-batches, 1F1B pipeline with ``virtual``
interleaved stages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import fields as F

RECOMPUTE = ("none", "selective", "full")
PLAN_SCHEMA_VERSION = 1
# training precisions, named as PyTorch Lightning names them: float32 weights with bf16 compute, everything in
# bf16, everything in float32 (what each engine holds under each: cost.model.state_bytes, runtime.precision)
PRECISIONS = ("bf16-mixed", "bf16-true", "32-true")


def derived_precision(dtype: str, master_weights: bool) -> str:
    """The precision a plan without a ``precision`` key (older plan files, ``estimate --dtype``) describes: a
    float32 model trains in float32; a 16-bit one with a float32 master copy in mixed precision, else pure."""
    if dtype == "float32":
        return "32-true"
    return "bf16-mixed" if master_weights else "bf16-true"


def compute_dtype(precision: str) -> str:
    """The dtype products compute and activations are saved in under ``precision``."""
    return "float32" if precision == "32-true" else "bfloat16"


@dataclass(frozen=True, order=True)
class LayerStrategy:
    """What one copy of a block does: recomputation and whether its stream is sequence-parallel."""

    recompute: str = "none"
    sequence_parallel: bool = False

    def label(self) -> str:
        return self.recompute + ("+sp" if self.sequence_parallel else "")


@dataclass(frozen=True)
class BlockPlan:
    """How the copies of one unique block are run: (strategy, number of copies) pairs."""

    block: str
    strategies: tuple[tuple[LayerStrategy, int], ...]

    @property
    def copies(self) -> int:
        return sum(n for _, n in self.strategies)


@dataclass(frozen=True)
class Plan:
    devices: int
    dp: int
    tp: int
    pp: int
    micro_batch: int
    global_batch: int
    virtual_stages: int = 1
    zero: int = 0
    offload: bool = False
    tp_branches: tuple[str, ...] = ()       # branch names sharded over tp (others replicated)
    dtype: str = "bfloat16"
    blocks: tuple[BlockPlan, ...] = field(default=())   # per pipeline stage (every stage alike)
    # a float32 master copy of 16-bit weights (mixed precision, Megatron-LM / DeepSpeed bf16); False: the
    # weights, gradients and optimizer states all in ``dtype``, as a script that trains its bf16 model runs
    master_weights: bool = True
    # one of PRECISIONS, as the launcher chose it; "" (plans made by hand or before the field existed): the
    # precision ``dtype`` and ``master_weights`` describe (``derived_precision``), priced as they always were
    precision: str = ""

    @property
    def precision_name(self) -> str:
        """The precision this plan trains in, by name (``precision``, else derived from dtype/master_weights)."""
        return self.precision or derived_precision(self.dtype, self.master_weights)

    @property
    def grad_accumulation(self) -> int:
        return self.global_batch // (self.dp * self.micro_batch)

    def summary(self) -> str:
        virtual = f"x{self.virtual_stages}" if self.virtual_stages > 1 else ""
        parts = [f"dp{self.dp} tp{self.tp} pp{self.pp}{virtual}",
                 f"mb{self.micro_batch}x{self.grad_accumulation}", f"zero{self.zero}"]
        if self.offload:
            parts.append("offload")
        if self.tp > 1 and self.tp_branches:
            parts.append("tp:" + "+".join(sorted(set(self.tp_branches))))
        for bp in self.blocks:
            mix = ",".join(f"{n}x{s.label()}" for s, n in bp.strategies)
            parts.append(f"[{mix}]")
        return " ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": PLAN_SCHEMA_VERSION, "devices": self.devices, "dp": self.dp, "tp": self.tp,
            "pp": self.pp, "virtual_stages": self.virtual_stages, "micro_batch": self.micro_batch,
            "global_batch": self.global_batch, "gradient_accumulation": self.grad_accumulation,
            "zero": self.zero, "offload": self.offload, "tp_branches": list(self.tp_branches), "dtype": self.dtype,
            "master_weights": self.master_weights, "blocks": [{"block": bp.block, "strategies": [
                {"recompute": s.recompute, "sequence_parallel": s.sequence_parallel, "copies": n}
                for s, n in bp.strategies]} for bp in self.blocks],
            "summary": self.summary(),
        } | ({"precision": self.precision} if self.precision else {})

    @staticmethod
    def from_json(d: dict[str, Any]) -> Plan:
        """The plan in ``d`` (``to_json``'s keys; extra keys are the caller's), every field checked for its JSON
        type (``space.fields``) and the mesh and batch for consistency; a ValueError names the field."""
        if d.get("schema_version") != PLAN_SCHEMA_VERSION:
            raise ValueError(f"plan schema_version {d.get('schema_version')!r} is not {PLAN_SCHEMA_VERSION}")
        plan = Plan(
            devices=F.integer(d, "devices", minimum=1), dp=F.integer(d, "dp", minimum=1),
            tp=F.integer(d, "tp", minimum=1), pp=F.integer(d, "pp", minimum=1),
            micro_batch=F.integer(d, "micro_batch", minimum=1), global_batch=F.integer(d, "global_batch", minimum=1),
            virtual_stages=F.integer(d, "virtual_stages", 1, minimum=1), zero=F.integer(d, "zero", minimum=0),
            offload=F.boolean(d, "offload"), tp_branches=F.strings(d, "tp_branches", ()),
            dtype=F.text(d, "dtype", "bfloat16"),
            blocks=tuple(_block(b, f"blocks[{i}]") for i, b in enumerate(F.objects(d, "blocks"))),
            master_weights=F.boolean(d, "master_weights", True), precision=_precision(d.get("precision")),
        )
        _check(plan, d)
        return plan


def _block(b: dict[str, Any], where: str) -> BlockPlan:
    strategies = F.objects(b, "strategies", where=where)
    return BlockPlan(F.text(b, "block", where=where), tuple(
        (LayerStrategy(F.text(s, "recompute", choices=RECOMPUTE, where=f"{where}.strategies[{j}]"),
                       F.boolean(s, "sequence_parallel", where=f"{where}.strategies[{j}]")),
         F.integer(s, "copies", minimum=0, where=f"{where}.strategies[{j}]"))
        for j, s in enumerate(strategies)))


def _check(plan: Plan, d: dict[str, Any]) -> None:
    """The fields agree: the mesh fills the devices, the batch splits into micro-batches, and the derived
    ``gradient_accumulation`` (where written) is the one the other fields give."""
    if plan.dp * plan.tp * plan.pp != plan.devices:
        raise ValueError(f"dp {plan.dp} x tp {plan.tp} x pp {plan.pp} is not the plan's {plan.devices} devices")
    if plan.zero > 3:
        raise ValueError(f"field 'zero' is {plan.zero}, not a ZeRO stage (0, 1, 2 or 3)")
    if plan.global_batch % (plan.dp * plan.micro_batch):
        raise ValueError(f"global_batch {plan.global_batch} does not split into dp {plan.dp} x micro_batch "
                         f"{plan.micro_batch}")
    written = F.integer(d, "gradient_accumulation", plan.grad_accumulation)
    if written != plan.grad_accumulation:
        raise ValueError(f"field 'gradient_accumulation' is {written}, but global_batch / (dp x micro_batch) is "
                         f"{plan.grad_accumulation}")


def _precision(name: object) -> str:
    if name in (None, ""):
        return ""
    if name not in PRECISIONS:
        raise ValueError(f"precision {name!r} is not one of {', '.join(PRECISIONS)}")
    return str(name)


def chain_order(pairs) -> tuple[tuple[LayerStrategy, int], ...]:
    """(strategy, copies) pairs in the order the copies run: replicated-stream copies first, then
    sequence-parallel ones (two layout changes at most per stage: with virtual stages the list is cut among
    the device's stages in order, so the SP copies fill the fewest), each by recomputation; empty ones dropped."""
    used = [(s, int(n)) for s, n in pairs if n > 0]
    return tuple(sorted(used, key=lambda item: (item[0].sequence_parallel, RECOMPUTE.index(item[0].recompute))))


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def meshes(devices: int, devices_per_node: int, max_tp: int, max_pp: int) -> list[tuple[int, int, int]]:
    """(dp, tp, pp) with tp inside a node (tp divides the node and the model's ``max_tp``) and pp
    dividing ``max_pp`` (the layers that can be split evenly)."""
    out = []
    for tp in divisors(min(devices, devices_per_node)):
        if devices_per_node % tp or max_tp % tp or devices % tp:
            continue
        for pp in divisors(devices // tp):
            if max_pp % pp == 0:
                out.append((devices // (tp * pp), tp, pp))
    return out
