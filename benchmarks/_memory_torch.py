"""Rows of ``memory_accuracy.py`` for the torch engine: rank 0's step simulated on fake tensors beside the cost
model's prediction of the same plan (issue 19 part 5).

Each row is one ``tensoropt launch examples/train_llama_large.py --plan PLAN --dry-run --check-memory`` (the
launcher captures the script in the plan's precision, prices the plan with ``tensoropt.cost.model.estimate`` and
simulates rank 0's second step through the torch engine's own ``apply``: ``runtime.memory.check.simulate``), so
the prediction is the library's own pricing and the peak is what the engine holds, at real scale on a CPU:
a Llama-3-8B-like model on 8 devices for every family, LLaMA-2 70B on 64 for the plans the planner chooses there,
and Megatron-LM's 22B GPT (Korthikanti et al. 2022, Table 3: hidden 6144, 48 layers, 64 heads, eager attention,
dropout 0.1; ``examples/train_gpt.py``) at their tp8 selective + SP, micro-batch 4, 2048 tokens on 8 devices.
``--quick`` keeps the 8B dimensions with 4 layers.

The simulated peaks are stored in ``results/memory_torch.json`` (each with the commit it was simulated at): they
depend on the runtime, not on the prices, so ``rows()`` re-prices them with the current cost model in a minute or
two, and simulates only a case not stored there; ``rows(simulate=True)`` (``memory_accuracy.py --simulate
_memory_torch``) simulates every case again, as a change to the runtime needs (the 70B plans take minutes each).

``actual_bytes`` is rank 0's simulated peak of tensor bytes (``memory.tracker.StepMemory``); rank 0 holds the
largest share (the loose ops' parameters, the first vocabulary shard) in every plan here.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks._common import check_memory, machine, memory_error  # noqa: E402
from tensoropt.space.plan import BlockPlan, LayerStrategy, Plan  # noqa: E402

SCRIPT = "examples/train_llama_large.py"
# Llama 3 8B (Meta 2024: 32 layers, hidden 4096, 32 heads in 8 key/value groups, SwiGLU 14336, vocabulary
# 128256), 4096 tokens
LLAMA3_8B = ["--layers", "32", "--hidden", "4096", "--heads", "32", "--kv-heads", "8", "--ffn", "14336",
             "--vocab", "128256", "--seq-len", "4096"]
ON_8 = ["--device", "cuda", "--gpus", "8", "--profile", "h200-141gb"]     # DDP of an 8B model needs ~97 GiB
ON_64 = ["--device", "cuda", "--gpus", "8", "--nnodes", "8", "--profile", "h200-141gb"]


def _chain(spec: str, layers: int) -> tuple[tuple[LayerStrategy, int], ...]:
    """``"none"``, ``"full+sp"`` or a mix ``"5/16 none+sp, full+sp"`` (the first share of the copies, the rest)
    as (strategy, copies) pairs over ``layers`` copies."""
    def strategy(word: str) -> LayerStrategy:
        recompute, _, sp = word.strip().partition("+")
        return LayerStrategy(recompute, sp == "sp")
    if "," not in spec:
        return ((strategy(spec), layers),)
    first, rest = spec.split(",")
    share, word = first.split()
    numerator, denominator = map(int, share.split("/"))
    n = layers * numerator // denominator
    return ((strategy(word), n), (strategy(rest), layers - n))


def plan_of(devices: int, dp: int, tp: int, zero: int, micro_batch: int, global_batch: int, precision: str,
            chain: str, layers: int, grad_dtype: str = "") -> Plan:
    """A torch-engine plan of the example's one block (``layers.*``) with the named precision (and gradients)."""
    return Plan(devices=devices, dp=dp, tp=tp, pp=1, micro_batch=micro_batch, global_batch=global_batch, zero=zero,
                tp_branches=("attn", "mlp") if tp > 1 else (), precision=precision,
                dtype="float32" if precision == "32-true" else "bfloat16", master_weights=False,
                blocks=(BlockPlan("layers.*", _chain(chain, layers)),), grad_dtype=grad_dtype)


def _dtype_args(precision: str) -> list[str]:
    """The script builds its weights in the dtype the precision keeps (float32 under bf16-mixed)."""
    return ["--dtype", "bfloat16" if precision == "bf16-true" else "float32"]


# (family, model, devices, dp, tp, zero, micro-batch, global batch, precision, chain)
CASES_8B = [
    ("ddp", 8, 8, 1, 0, 1, 8, "bf16-true", "none"),
    ("ddp-accumulation", 8, 8, 1, 0, 1, 16, "bf16-true", "none"),
    ("fsdp2-zero1", 8, 8, 1, 1, 1, 16, "bf16-true", "none"),
    ("fsdp2-zero2", 8, 8, 1, 2, 1, 16, "bf16-true", "none"),
    ("fsdp2-zero3", 8, 8, 1, 3, 1, 16, "bf16-true", "none"),
    ("tp2", 8, 4, 2, 3, 1, 8, "bf16-true", "none"),
    ("tp2-sp", 8, 4, 2, 3, 1, 8, "bf16-true", "none+sp"),
    ("recompute-none", 8, 8, 1, 3, 2, 16, "bf16-true", "none"),
    ("recompute-selective", 8, 8, 1, 3, 2, 16, "bf16-true", "selective"),
    ("recompute-full", 8, 8, 1, 3, 2, 16, "bf16-true", "full"),
    ("recompute-mixed", 8, 4, 2, 3, 2, 8, "bf16-true", "5/16 none+sp,full+sp"),
    ("precision-32-true", 8, 8, 1, 3, 1, 8, "32-true", "full"),
    ("precision-bf16-mixed", 8, 8, 1, 3, 1, 8, "bf16-mixed", "full"),
    ("precision-bf16-true", 8, 8, 1, 3, 1, 8, "bf16-true", "full"),
    ("precision-32-true", 8, 8, 1, 3, 2, 16, "32-true", "none"),
    ("precision-bf16-mixed", 8, 8, 1, 3, 2, 16, "bf16-mixed", "none"),
    ("gradients-float32", 8, 8, 1, 1, 1, 16, "bf16-mixed", "none"),
]
# bf16 gradients (issue 33 item 4: FSDP2 with reduce_dtype=bfloat16), beside gradients-float32 above: ZeRO 1 holds
# whole bf16 gradients over its two micro-batches instead of float32 ones; ZeRO 3 the same shards as float32
CASES_8B_BF16_GRADIENTS = [
    ("gradients-bf16", 8, 8, 1, 1, 1, 16, "bf16-mixed", "none"),
    ("gradients-bf16", 8, 8, 1, 3, 1, 16, "bf16-mixed", "none"),
]
# LLaMA-2 70B on 64: the plan the planner chose with --engine torch (README, --check-memory), and ZeRO 3 with SP
# and no recomputation (priced on the h200-141gb profile: it needs more than 80 GiB)
CASES_70B = [
    ("fsdp2-zero3", 64, 32, 2, 3, 2, 64, "bf16-true", "25/80 none+sp,full+sp"),
    ("tp2-sp", 64, 32, 2, 3, 1, 64, "bf16-true", "none+sp"),
    ("precision-bf16-mixed", 64, 32, 2, 3, 2, 64, "bf16-mixed", "25/80 none+sp,full+sp"),  # README's, before
]

# Megatron-LM's 22B GPT (Korthikanti et al. 2022, Table 3; its 51200-token vocabulary) at its tp8 selective + SP
# recipe on 8 GPUs (Table 5: micro-batch 4, 2048 tokens); priced by Megatron at 34 s b h / t bytes a layer
GPT_SCRIPT = "examples/train_gpt.py"
GPT_22B = ("--layers", "48", "--hidden", "6144", "--heads", "64", "--vocab", "51200", "--seq-len", "2048", "--meta")
ON_8_H100 = ("--device", "cuda", "--gpus", "8", "--profile", "h100-80gb")
CASES_22B = [
    ("selective-sp", 8, 1, 8, 0, 4, 4, "bf16-true", "selective+sp"),
]


@dataclass(frozen=True)
class Case:
    """One row's plan and the launch that simulates it: what ``memory_torch.json`` stores beside its peak."""

    family: str
    model: str
    devices: int
    dp: int
    tp: int
    zero: int
    micro_batch: int
    global_batch: int
    precision: str
    chain: str
    layers: int
    launch_args: tuple[str, ...]
    script_args: tuple[str, ...]
    script: str = SCRIPT
    grad_dtype: str = ""

    @property
    def plan(self) -> Plan:
        return plan_of(self.devices, self.dp, self.tp, self.zero, self.micro_batch, self.global_batch,
                       self.precision, self.chain, self.layers, self.grad_dtype)

    @property
    def all_script_args(self) -> list[str]:
        return [*self.script_args, *_dtype_args(self.precision), "--global-batch", str(self.global_batch)]

    @property
    def key(self) -> tuple[str, str, str, str]:
        return self.family, self.model, self.plan.summary(), self.precision


def cases(quick: bool = False, family: str | None = None) -> list[Case]:
    """The rows' cases (module doc); ``family``: only that family's."""
    layers = 4 if quick else 32
    model_8b = "llama3-8b-like" + (" (4 layers)" if quick else "")
    script_8b = tuple(LLAMA3_8B[:1] + [str(layers)] + LLAMA3_8B[2:])
    todo = [Case(c[0], model_8b, *c[1:], layers, tuple(ON_8), script_8b) for c in CASES_8B]
    todo += [Case(c[0], model_8b, *c[1:], layers, tuple(ON_8), script_8b,
                  grad_dtype="bfloat16") for c in CASES_8B_BF16_GRADIENTS]
    if not quick:
        todo += [Case(c[0], "llama2-70b", *c[1:], 80, tuple(ON_64), ()) for c in CASES_70B]
        todo += [Case(c[0], "gpt-22b", *c[1:], 48, ON_8_H100, GPT_22B, GPT_SCRIPT) for c in CASES_22B]
    return [c for c in todo if not family or c.family == family]


def _devices(launch_args: tuple[str, ...]):
    """The devices ``tensoropt launch`` plans for with these arguments (``--device cuda --dry-run``): (devices,
    devices per node)."""
    from launcher.devices import detect
    args = dict(zip(launch_args[::2], launch_args[1::2]))
    per_node, nodes = int(args["--gpus"]), int(args.get("--nnodes", 1))
    devices = detect(args["--device"], per_node, None, args.get("--profile"), dry_run=True)
    return dataclasses.replace(devices, count=per_node * nodes), per_node


def predicted(case: Case) -> dict:
    """The cost model's breakdown of the case's plan as ``launch --plan --dry-run --check-memory`` prices it
    (``launcher.memory.predicted_breakdown``; the graph captured in the plan's precision, cached)."""
    from launcher.capture import capture_script
    from launcher.launch import cost_model, planned_precision, price
    from launcher.memory import predicted_breakdown
    from tensoropt.search.engines import choose_engine
    devices, per_node = _devices(case.launch_args)
    graph = capture_script(str(REPO / case.script), case.all_script_args, precision=case.precision)
    engine = choose_engine(planned_precision(case.plan, "torch", case.precision))
    point = price(graph, devices, per_node, case.plan, engine, case.precision)
    return predicted_breakdown(cost_model(graph, devices, per_node, point.plan), point,
                               devices.profile.runtime_overhead_bytes)


def _row(case: Case, simulated: dict, prediction: dict, commit: str) -> dict:
    return {"family": case.family, "model": case.model, "plan": case.plan.summary(), "precision": case.precision,
            "script": case.script, "how": "simulated", "actual_of": "rank 0", "simulated_at": commit,
            "predicted_tensor_bytes": int(prediction["tensor_bytes"]), "actual_bytes": int(simulated["peak_bytes"]),
            "predicted": prediction, "actual": simulated}


def simulated(case: Case, cache_dir: str) -> dict:
    """The case's row, simulated now (a ``launch --check-memory`` subprocess; minutes for the 70B plans)."""
    check = check_memory(case.script, list(case.launch_args), list(case.all_script_args), case.plan, cache_dir)
    row = _row(case, check["simulated"], check["predicted"], machine()["commit"])
    print(f"  {case.family:22s} {case.model:26s} {row['plan']:52s} {memory_error(row):+7.1%}", file=sys.stderr,
          flush=True)
    return row


def stored() -> dict[tuple, dict]:
    """The simulations in ``results/memory_torch.json`` by (family, model, plan, precision)."""
    if not STORE.exists():
        return {}
    return {(r["family"], r["model"], r["plan"], r["precision"]): r for r in json.loads(STORE.read_text())["rows"]}


def store(new_rows: list[dict]) -> None:
    """Add or replace these rows' simulations in ``results/memory_torch.json`` (the peaks, not the prices)."""
    keep = stored() | {(r["family"], r["model"], r["plan"], r["precision"]): r for r in new_rows}
    kept = [{k: v for k, v in r.items() if k not in ("predicted", "predicted_tensor_bytes")} for r in keep.values()]
    STORE.write_text(json.dumps({"script": SCRIPT, "rows": kept}, indent=1) + "\n")


def rows(quick: bool = False, family: str | None = None, simulate: bool = False) -> list[dict]:
    """One row per case (module doc): the peaks stored in ``results/memory_torch.json`` (they depend on the
    runtime, not on the prices), re-priced with the current cost model; a case not stored there, or every case
    with ``simulate``, is simulated now and stored."""
    todo, have = cases(quick, family), stored()
    missing = [c for c in todo if simulate or c.key not in have]
    if missing:
        with tempfile.TemporaryDirectory() as cache_dir, ThreadPoolExecutor(WORKERS) as pool:
            fresh = list(pool.map(lambda c: simulated(c, cache_dir), missing))
        store(fresh)
        have |= {c.key: r for c, r in zip(missing, fresh)}
    out = []
    for case in todo:
        row = have[case.key]
        out.append(_row(case, row["actual"], predicted(case), row["simulated_at"]))
    return out


WORKERS = 2          # simulations at once (each its own process)
STORE = REPO / "benchmarks" / "results" / "memory_torch.json"


__all__ = ["CASES_22B", "CASES_70B", "CASES_8B", "CASES_8B_BF16_GRADIENTS", "Case", "cases", "plan_of", "predicted",
           "rows", "simulated", "stored"]
