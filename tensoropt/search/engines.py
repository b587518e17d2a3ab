"""What each engine runs: one table that the launcher's search and the runtime's check both read.

``ENGINE_SPACES`` is the part of the search space an engine applies (``SearchSpace`` arguments), so the
launcher searches only there. Some plans inside that space still cannot run, because a combination is not
applied (tensor with data parallelism under ZeRO 0 in the torch engine, for instance). ``unsupported``
names what a plan needs that an engine lacks. ``COMPILE_SPACES`` narrows an engine's part further for plans
with compiled blocks (``launch --compile``): only what its tests ran compiled; an engine without an entry never
compiles. The launcher drops those plans after the search, and a worker
refuses them before it runs anything else. ``ENGINES`` is defined with the plan file (``space.run_plan``),
which names the engine that runs it. Plain data on a ``Plan``: no GPU.
"""

from __future__ import annotations

from ..errors import TensorOptError
from ..graph.bf16_meta import bf16_weights_graph
from ..graph.ir import OUTPUT_KEY, OpGraph
from ..space.plan import Plan
from ..space.run_plan import ENGINES

ENGINE_SPACES = {
    "torch": dict(zero_stages=(0, 1, 2, 3), recompute=("none", "selective", "full"), sequence_parallel=True,
                  offload=False, max_virtual_stages=4),
    "deepspeed": dict(zero_stages=(0, 1, 2, 3), recompute=("none", "selective", "full"), sequence_parallel=False,
                      offload=True, max_virtual_stages=1, pipeline_stages=(1,), tensor_parallel=(1,)),
}

# how an engine's plans checkpoint (launch --checkpoint-dir, --elastic): a launch that checkpoints searches only the
# plans of these engines, and a worker refuses to checkpoint under another. DeepSpeed's own checkpoints
# (engine.save_checkpoint) hold ZeRO partitions in its own layout, which do not load into another plan's engine.
CHECKPOINTS = {"torch": "torch.distributed.checkpoint"}

# with compiled blocks (runtime.engines.compile), tested on CPU workers (tests/test_compile.py): DDP, FSDP2 ZeRO 1-3,
# tensor parallelism and pipeline stages (interleaved too) around or inside compiled copies, plain or fully recomputed.
# Not offered compiled: selective recomputation (dynamo fails on runtime.memory.selective's saved-tensor hooks),
# sequence parallelism (its module hooks install saved-tensor hooks too, which dynamo will not trace, and under
# checkpoint dynamo refuses their Python state: "HOP: Unsafe side effect"), both tried on CPU workers in torch 2.13;
# DeepSpeed runs its own engine eagerly. A key left out allows every value.
COMPILE_SPACES = {
    "torch": dict(recompute=("none", "full"), sequence_parallel=False),
}
# the same in words, for the launcher's error when no compiled plan fits the user's limits
COMPILED_PLANS = "no or full recomputation, no sequence parallelism"


def grad_dtypes(engine: str, precision: str | None) -> tuple[str, ...]:
    """The gradient layouts (``Plan.grad_dtype``) ``engine`` runs in ``precision``: the precision's own, and under
    bf16-mixed the torch engine's bf16 gradients too (FSDP2 ``reduce_dtype=bfloat16``, ZeRO 1-3:
    ``runtime.engines.precision.fsdp_kwargs``; the search pairs them with ZeRO 1-3 only). DeepSpeed's bf16 mode
    accumulates in bf16 as its own layout (``cost.states``), so it has nothing to add."""
    return ("", "bfloat16") if engine == "torch" and precision == "bf16-mixed" else ("",)


def unsupported(plan: Plan, engine: str) -> list[str]:
    """What ``plan`` needs that ``engine`` does not apply; empty when it can run it."""
    return _unsupported(plan, engine) + (_not_compiled(plan, engine) if plan.compile else [])


def _not_compiled(plan: Plan, engine: str) -> list[str]:
    """What a plan with compiled blocks needs that ``engine`` does not run compiled (``COMPILE_SPACES``)."""
    if engine not in COMPILE_SPACES:
        return [f"compiled blocks (the {engine} engine runs eager PyTorch: drop --compile)"]
    space = COMPILE_SPACES[engine]
    recompute = {s.recompute for b in plan.blocks for s, _ in b.strategies}
    return [f"compiled blocks with {what}" for what, needed in [
        (f"ZeRO {plan.zero}", plan.zero not in space.get("zero_stages", (plan.zero,))),
        (f"{' and '.join(sorted(recompute - set(space['recompute'])))} recomputation",
         bool(recompute - set(space["recompute"]))),
        ("sequence parallelism", _sequence_parallel(plan) and not space.get("sequence_parallel", True)),
        ("tensor parallelism", plan.tp not in space.get("tensor_parallel", (plan.tp,))),
        ("pipeline stages", plan.pp not in space.get("pipeline_stages", (plan.pp,))),
        # the torch engine runs context parallelism eager only (runtime.parallel.context_parallel)
        ("context parallelism", plan.cp > 1),
        # nor expert parallelism (runtime.parallel.expert_parallel: its all-to-alls between eager products)
        ("expert parallelism", plan.ep > 1),
    ] if needed]


def _sequence_parallel(plan: Plan) -> bool:
    return any(s.sequence_parallel for b in plan.blocks for s, _ in b.strategies)


def _unsupported(plan: Plan, engine: str) -> list[str]:
    if plan.grad_dtype and plan.precision != "bf16-mixed":   # bf16-true's are bf16 already, 32-true's float32
        return [f"{plan.grad_dtype} gradients in {plan.precision_name}"]
    if engine == "deepspeed":
        return [what for what, needed in [
            ("interleaved virtual pipeline stages", plan.virtual_stages > 1),
            ("sequence parallelism", _sequence_parallel(plan)),
            ("tensor parallelism", plan.tp != 1), ("pipeline stages", plan.pp != 1),
            ("optimizer offload without ZeRO", plan.offload and plan.zero == 0),
            # DeepSpeed keeps a float32 master copy under ZeRO 0 (BF16_Optimizer): bf16 master weights need 1-3
            ("bf16-true without ZeRO", plan.precision == "bf16-true" and plan.zero == 0),
            # the sequence split needs the model's attention to gather keys and values: the torch engine's
            ("context parallelism (the torch engine runs it)", plan.cp > 1),
            # TensorOpt's own token exchange, not DeepSpeed-MoE's layers (runtime.parallel.expert_parallel)
            ("expert parallelism (the torch engine runs it)", plan.ep > 1),
        ] if needed]
    return [what for what, needed in [
        ("optimizer offload", plan.offload),
        # DDP keeps gradients in the weights' dtype (float32 under bf16-mixed): bf16 ones are FSDP2's reduce dtype
        ("bf16 gradients without ZeRO 1, 2 or 3", bool(plan.grad_dtype) and plan.zero == 0),
        # DDP does not take tensor-parallel DTensors: FSDP2 (ZeRO 1-3) runs over a (dp, tp) mesh (over the flattened
        # dp x cp ranks under context parallelism)
        ("tensor and data parallelism without ZeRO 1, 2 or 3", plan.tp > 1 and plan.dp * plan.cp > 1
         and plan.zero == 0),
        ("context parallelism with pipeline stages", plan.cp > 1 and plan.pp > 1),
        ("expert parallelism with pipeline stages", plan.ep > 1 and plan.pp > 1),
        ("expert parallelism with context parallelism", plan.ep > 1 and plan.cp > 1),
        # the experts would see each tp rank's share of the tokens (runtime.parallel.expert_parallel.check_plan)
        ("expert parallelism with sequence parallelism", plan.ep > 1 and _sequence_parallel(plan)),
    ] if needed]


def master_weights(engine: str, precision: str | None = "bf16-mixed") -> bool:
    """Whether an engine keeps a float32 master copy beside bf16 weights: DeepSpeed's bf16 mode does under
    bf16-mixed (``BF16_Optimizer``, ZeRO's float32 partitions: 2 + 2 + 12 bytes per parameter); the torch engine
    keeps the weights themselves in float32 (``cost.states.torch_mixed``), and bf16-true / 32-true keep none."""
    return engine == "deepspeed" and precision == "bf16-mixed"


def computes_with_bf16_weights(engine: str, zero: int, pp: int, precision: str | None) -> bool:
    """Whether ``engine`` runs a bf16-mixed plan with bf16 weights in its forward and backward, so with a bf16
    residual stream and no per-op weight casts: FSDP2 (the torch engine's ZeRO 1-3, pipeline stages included:
    ``runtime.pipeline.trace`` traces them with the bf16 weights FSDP2 gathers) gathers them in
    ``param_dtype=bf16`` (``runtime.engines.precision.fsdp_kwargs``), and DeepSpeed's bf16 mode casts the module to
    bf16. DDP and one process (ZeRO 0, with or without stages: ``pp`` does not matter) compute with the float32 weights
    that the autocast casts per op, so the stream stays float32 (``graph.precision``)."""
    return precision == "bf16-mixed" and (engine == "deepspeed" or zero >= 1)


def priced_graph(graph: OpGraph, engine: str, zero: int, pp: int, precision: str | None) -> OpGraph:
    """The graph that prices a plan of ``engine`` (torch when "") at ``zero`` with ``pp`` stages in ``precision``:
    the one captured with bf16 weights where that engine computes with them (``computes_with_bf16_weights``) and
    the capture has it, else ``graph``."""
    if computes_with_bf16_weights(engine or "torch", zero, pp, precision):
        return bf16_weights_graph(graph) or graph
    return graph


def pipeline_refused(graph: OpGraph) -> str | None:
    """Why no engine runs ``graph``'s model in pipeline stages, in one line; None where they run it. The stages'
    last one hands back the loss alone (``runtime.pipeline.trace``): the forward must return it, as a tensor or in
    an output that carries it (``.loss`` or ``["loss"]``, a Hugging Face output: its other fields, the logits, are
    not handed back, and the script reads ``run.train_step``'s loss, never the output). Anything else (a tuple, an
    output without the loss) has no loss for the last stage to compute."""
    if graph.meta(OUTPUT_KEY, "tensor") in ("tensor", "loss"):
        return None
    return (f"the forward returns {graph.meta('returns') or 'no loss'}, no loss for the last stage to compute: "
            "return the loss (a scalar tensor, or an output with .loss)")


def staged_tp_refused(graph: OpGraph) -> str | None:
    """Why ``graph``'s model runs pipeline stages only without tensor parallelism, in one line; None where both
    combine. The stages are traced graphs, whose linears ``runtime.pipeline.tp`` gives back as ``nn.Linear`` to shard
    them; for a model returning a Hugging Face output only tp 1 stages are run (issue 37, torch 2.13 on CPU workers):
    GPT-2's ``Conv1D`` traces to an ``addmm`` on its (in, out) weight, no linear to give back, and Llama's RMSNorm
    cast (``.to(float32)``), traced with an ``aten._assert_tensor_metadata`` that has no DTensor rule, stops a
    sequence-parallel stage."""
    if graph.meta(OUTPUT_KEY, "tensor") != "loss":
        return None
    return (f"the forward returns {graph.meta('returns')}: its stages run at tp 1 (tensor parallelism inside its "
            "traced stages is not run yet: GPT-2's Conv1D, Llama's norm casts)")


def tp_in_stages(plan: Plan) -> bool:
    """Whether ``plan`` runs tensor parallelism inside pipeline stages."""
    return plan.pp > 1 and plan.tp > 1


def pipelines_not_offered(graph: OpGraph) -> list[str]:
    """The ``not offered:`` lines of ``launch`` and ``inspect`` for pipeline stages, where they are left out."""
    if refused := pipeline_refused(graph):
        return [f"pipeline stages: {refused}"]
    refused = staged_tp_refused(graph)
    return [f"tensor parallelism inside pipeline stages: {refused}"] if refused else []


def choose_engine(plan: Plan, requested: str | None = None) -> str:
    """The engine that runs a plan: ``requested`` if it can, else torch, else DeepSpeed."""
    for engine in [requested] if requested else ENGINES:
        if not unsupported(plan, engine):
            return engine
    engine = requested or "torch"
    raise TensorOptError(f"plan {plan.summary()} needs {', '.join(unsupported(plan, engine))}, which the {engine} "
                         "engine does not apply" + ("" if requested else " (nor does DeepSpeed)"))


__all__ = ["CHECKPOINTS", "COMPILED_PLANS", "COMPILE_SPACES", "ENGINES", "ENGINE_SPACES", "choose_engine",
           "computes_with_bf16_weights", "grad_dtypes", "master_weights", "pipeline_refused", "pipelines_not_offered",
           "priced_graph", "staged_tp_refused", "tp_in_stages", "unsupported"]
