"""Plans: the global choices (mesh, ZeRO, micro-batching, pipeline) plus per-layer strategies.

Every field is something the runtime can apply: a (dp, cp, tp, pp) mesh with tensor parallelism
inside a node, context parallelism (the sequence split over ``cp`` ranks, ``runtime.parallel.context_parallel``),
Megatron branches sharded over tp, sequence parallelism per layer, recomputation per layer, ZeRO stage over dp (and
cp), optimizer offload, micro-batches, 1F1B pipeline with ``virtual`` interleaved stages.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

RECOMPUTE = ("none", "selective", "full")
PLAN_SCHEMA_VERSION = 1
# training precisions, named as PyTorch Lightning names them: float32 weights with bf16 compute, everything in
# bf16, everything in float32 (what each engine holds under each: cost.model.state_bytes, runtime.engines.precision)
PRECISIONS = ("bf16-mixed", "bf16-true", "32-true")
# gradient layouts a plan may name beside its precision's own (``Plan.grad_dtype``): bf16 gradient accumulation and
# reduction under bf16-mixed, as DeepSpeed's ``data_types.grad_accum_dtype`` and Megatron-LM's ``--grad-reduce-in-bf16``
# offer it (what each engine holds: cost.states; how the torch engine runs it: runtime.engines.precision.fsdp_kwargs)
GRAD_DTYPES = ("bfloat16",)


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


def acts_per_copy(plan: Plan, block: BlockPlan, engine: str) -> bool:
    """Whether ``engine`` running ``plan`` acts on ``block``'s copies one by one, finding them by the block's name
    (``runtime.blocks``): recomputing or sequence-splitting them, sharding them for tensor parallelism, cutting
    pipeline stages between them, compiling them, or (the torch engine under ZeRO) wrapping each in FSDP2."""
    return plan.pp > 1 or plan.tp > 1 or plan.compile or (engine == "torch" and plan.zero >= 1) or any(
        s.recompute != "none" or s.sequence_parallel for s, _ in block.strategies)


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
    # the kernels the plan is priced for: False, eager PyTorch (what the torch engine runs: one kernel per op);
    # True, blocks compiled with torch.compile (memory-bound chains fused). plan.json key ``compile``; plans
    # written before it existed load as eager
    compile: bool = False
    # the engine the plan is priced for (``search.engines.ENGINES``): DeepSpeed holds buffers of its own beside
    # the model states (``cost.deepspeed_memory``); "" (plans made by hand, the planner's engine-free space):
    # priced as the torch engine runs it. plan.json's ``engine`` (``space.run_plan``)
    engine: str = ""
    # the dtype gradients are accumulated over micro-batches and reduced in, where the plan departs from its
    # precision's own (``GRAD_DTYPES``): "bfloat16" under bf16-mixed, the leaner state layout (the torch engine's
    # FSDP2 ZeRO 1-3 with ``reduce_dtype=bfloat16``; DeepSpeed's bf16 mode accumulates in bf16 anyway); "": the
    # precision's own (float32 in the torch engine's bf16-mixed). plan.json key ``grad_dtype``, written when set
    grad_dtype: str = ""
    # context parallelism: each sample's sequence split over ``cp`` ranks (load-balanced causal chunks; the
    # attention gathers the keys and values of the whole sequence, ``runtime.parallel.context_parallel``). The
    # devices are dp x cp x tp x pp; ``micro_batch`` counts whole samples of a data-parallel rank, which its cp
    # ranks share by sequence. plan.json key ``cp``, written when > 1 (plans without it: 1)
    cp: int = 1
    # expert parallelism: the experts of every token-routed (MoE) layer sharded over ``ep`` ranks taken from data
    # parallelism (ep divides dp; Megatron-LM's "parallel folding": the attention and dense layers keep dp, the experts
    # run on dp / ep expert-data-parallel replicas of ep ranks each). Tokens are sent to their experts' ranks by
    # all-to-all and back (``runtime.parallel.expert_parallel``). plan.json key ``ep``, written when > 1 (plans without
    # it: 1)
    ep: int = 1

    @property
    def precision_name(self) -> str:
        """The precision this plan trains in, by name (``precision``, else derived from dtype/master_weights)."""
        return self.precision or derived_precision(self.dtype, self.master_weights)

    @property
    def grad_accumulation(self) -> int:
        return self.global_batch // (self.dp * self.micro_batch)

    def summary(self) -> str:
        virtual = f"x{self.virtual_stages}" if self.virtual_stages > 1 else ""
        context = f" cp{self.cp}" if self.cp > 1 else ""
        experts = f" ep{self.ep}" if self.ep > 1 else ""
        parts = [f"dp{self.dp}{experts}{context} tp{self.tp} pp{self.pp}{virtual}",
                 f"mb{self.micro_batch}x{self.grad_accumulation}", f"zero{self.zero}"]
        if self.offload:
            parts.append("offload")
        if self.compile:
            parts.append("compiled")
        if self.grad_dtype:
            parts.append("grad:" + {"bfloat16": "bf16"}.get(self.grad_dtype, self.grad_dtype))
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
            "compile": self.compile,
        } | {key: value for key, value in (("precision", self.precision), ("engine", self.engine),
                                            ("grad_dtype", self.grad_dtype)) if value} | (
            {"cp": self.cp} if self.cp > 1 else {}) | ({"ep": self.ep} if self.ep > 1 else {})

    @staticmethod
    def from_json(d: dict[str, Any]) -> Plan:
        """The plan in a plan file's JSON; a ``ValueError`` naming every field that breaks the schema
        (``plan_problems``), so that no bad plan is priced, written or given to workers."""
        if problems := plan_problems(d):
            raise ValueError("; ".join(problems))
        return Plan(
            devices=d["devices"], dp=d["dp"], tp=d["tp"], pp=d["pp"],
            micro_batch=d["micro_batch"], global_batch=d["global_batch"],
            virtual_stages=d.get("virtual_stages", 1), zero=d["zero"], offload=d["offload"],
            tp_branches=tuple(d.get("tp_branches", ())), dtype=d.get("dtype", "bfloat16"),
            blocks=tuple(BlockPlan(b["block"], tuple(
                (LayerStrategy(s["recompute"], s["sequence_parallel"]), s["copies"])
                for s in b["strategies"])) for b in d["blocks"]),
            master_weights=d.get("master_weights", True), precision=d.get("precision") or "",
            compile=d.get("compile", False), engine=d.get("engine") or "", grad_dtype=d.get("grad_dtype") or "",
            cp=d.get("cp", 1), ep=d.get("ep", 1),
        )



DTYPES = ("bfloat16", "float16", "float32")
_POSITIVE = ("devices", "dp", "tp", "pp", "micro_batch", "global_batch")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def plan_problems(d: object) -> list[str]:
    """Every way the JSON ``d`` breaks the plan schema, each named with what to change (empty: a valid plan).
    Checked: the version, each field's type and range (counts >= 1, ZeRO 0-3, recompute in RECOMPUTE, a known
    dtype and precision), the mesh (dp x tp x pp = devices), the batch (micro_batch x gradient_accumulation x dp
    = global_batch) and the blocks (copies >= 0, at least one per block, the first block's a multiple of
    virtual_stages, as the search cuts them). What needs the model (its blocks' repeats = copies x pp) is checked
    where the model is known (the launcher)."""
    if not isinstance(d, dict):
        return [f"a plan is a JSON object, got {type(d).__name__}"]
    if d.get("schema_version") != PLAN_SCHEMA_VERSION:
        return [f"plan schema_version {d.get('schema_version')!r} is not {PLAN_SCHEMA_VERSION}"]
    problems = [f'"{key}" is missing' for key in (*_POSITIVE, "zero", "offload", "blocks") if key not in d]
    if problems:
        return problems
    problems += [f'"{key}" must be an integer >= 1, got {d[key]!r}'
                 for key in (*_POSITIVE, "virtual_stages", "cp", "ep")
                 if key in d and not (_is_int(d[key]) and d[key] >= 1)]
    counts_valid = not problems              # the mesh and batch arithmetic needs them
    if not (_is_int(d["zero"]) and 0 <= d["zero"] <= 3):
        problems.append(f'"zero" must be a ZeRO stage 0-3, got {d["zero"]!r}')
    problems += [f'"{key}" must be true or false, got {d[key]!r}' for key in ("offload", "master_weights", "compile")
                 if key in d and not isinstance(d[key], bool)]
    if d.get("dtype", "bfloat16") not in DTYPES:
        problems.append(f'"dtype" must be one of {", ".join(DTYPES)}, got {d["dtype"]!r}')
    if d.get("precision") not in (None, "", *PRECISIONS):
        problems.append(f'"precision" {d["precision"]!r} is not one of {", ".join(PRECISIONS)}')
    problems += _grad_problems(d)
    branches = d.get("tp_branches", [])
    if not (isinstance(branches, list) and all(isinstance(b, str) for b in branches)):
        problems.append(f'"tp_branches" must be a list of branch names, got {branches!r}')
    if counts_valid:
        problems += _mesh_problems(d)
    return problems + _block_problems(d["blocks"], d.get("virtual_stages", 1) if counts_valid else 1)


def _grad_problems(d: dict[str, Any]) -> list[str]:
    """A ``grad_dtype`` that is no gradient layout, or one its precision does not have: bf16 gradients depart from
    bf16-mixed's float32 ones only (bf16-true's are bf16 already, 32-true trains in float32)."""
    grad = d.get("grad_dtype")
    if grad in (None, ""):
        return []
    if grad not in GRAD_DTYPES:
        return [f'"grad_dtype" must be {" or ".join(map(repr, GRAD_DTYPES))} (or left out for the precision\'s own '
                f'gradients), got {grad!r}']
    if d.get("precision") != "bf16-mixed":
        return [f'"grad_dtype" {grad!r} needs "precision" "bf16-mixed", got {d.get("precision")!r}']
    return []


def _mesh_problems(d: dict[str, Any]) -> list[str]:
    problems = []
    cp = d.get("cp", 1)
    if d["dp"] * cp * d["tp"] * d["pp"] != d["devices"]:
        context = f' x cp {cp}' if cp != 1 else ''
        problems.append(f'dp {d["dp"]}{context} x tp {d["tp"]} x pp {d["pp"]} must equal "devices" {d["devices"]}')
    if d["dp"] % d.get("ep", 1):
        problems.append(f'"ep" {d["ep"]} must divide dp {d["dp"]}: the experts are sharded over ranks taken from data '
                        'parallelism')
    samples = d["dp"] * d["micro_batch"]
    steps = d.get("gradient_accumulation", d["global_batch"] // samples)
    if not (_is_int(steps) and steps >= 1 and samples * steps == d["global_batch"]):
        problems.append(f'micro_batch {d["micro_batch"]} x gradient_accumulation {steps!r} x dp {d["dp"]} must '
                        f'equal "global_batch" {d["global_batch"]}')
    virtual = d.get("virtual_stages", 1)
    if virtual > 1 and (d["pp"] == 1 or not _is_int(steps) or steps % d["pp"]):
        problems.append(f'"virtual_stages" {virtual} needs pp > 1 and a number of micro-batches (gradient_accumulation '
                        f'{steps!r}) that is a multiple of pp {d["pp"]}')
    return problems


def _block_problems(blocks: object, virtual: int) -> list[str]:
    if not isinstance(blocks, list):
        return [f'"blocks" must be a list, got {type(blocks).__name__}']
    problems: list[str] = []
    for i, block in enumerate(blocks):
        strategies = block.get("strategies") if isinstance(block, dict) else None
        if not (isinstance(block, dict) and isinstance(block.get("block"), str) and isinstance(strategies, list)):
            problems.append(f'blocks[{i}] must be {{"block": NAME, "strategies": [...]}}')
            continue
        for s in strategies:
            if not isinstance(s, dict) or s.get("recompute") not in RECOMPUTE:
                got = s.get("recompute") if isinstance(s, dict) else s
                problems.append(f'block {block["block"]}: "recompute" must be one of {", ".join(RECOMPUTE)}, '
                                f'got {got!r}')
            elif not isinstance(s.get("sequence_parallel"), bool):
                problems.append(f'block {block["block"]}: "sequence_parallel" must be true or false')
            elif not (_is_int(s.get("copies")) and s["copies"] >= 0):
                problems.append(f'block {block["block"]}: "copies" must be an integer >= 0, got {s.get("copies")!r}')
        if problems:
            continue
        copies = sum(s["copies"] for s in strategies)
        if copies < 1 or (i == 0 and copies % virtual):   # the first block's copies are cut into virtual stages
            problems.append(f'block {block["block"]}: its {copies} copies per stage must be at least 1'
                            + (f' and a multiple of virtual_stages {virtual}' if i == 0 else ''))
    return problems + blocks_named_twice([b["block"] for b in blocks if isinstance(b, dict)
                                          and isinstance(b.get("block"), str)])


def blocks_named_twice(names: list[str]) -> list[str]:
    """A line for each block a plan names more than once: the cost model and the runtime find a block's strategies
    and copies by its name, so two entries of one name would run as one. Plans written before blocks sharing a
    pattern were told apart (``graph.block_names``) named DeepSeek-V3's dense and MoE blocks both ``model.layers.*``."""
    return [f'block {name} is named {names.count(name)} times: name each block of the model once (re-plan: blocks '
            'sharing a pattern are named by their copies, "model.layers.*[0:3]")'
            for name in dict.fromkeys(names) if names.count(name) > 1]


def chain_order(pairs) -> tuple[tuple[LayerStrategy, int], ...]:
    """(strategy, copies) pairs in the order the copies run: replicated-stream copies first, then
    sequence-parallel ones (two layout changes at most per stage: with virtual stages the list is cut among
    the device's stages in order, so the SP copies fill the fewest), each by recomputation; empty ones dropped."""
    used = [(s, int(n)) for s, n in pairs if n > 0]
    return tuple(sorted(used, key=lambda item: (item[0].sequence_parallel, RECOMPUTE.index(item[0].recompute))))


@functools.cache
def divisors(n: int) -> tuple[int, ...]:
    """The divisors of ``n``, ascending (kept: the search asks for the same few numbers many times)."""
    return tuple(d for d in range(1, n + 1) if n % d == 0)


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
