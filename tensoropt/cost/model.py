"""Iteration time and peak memory per device of a plan.

Pipeline (Narayanan et al., SC'21): 1F1B with ``v`` interleaved stages takes (m + (p-1)/v) stage
times for m micro-batches, the bubble being (p-1)/(v m) of the ideal; stage 0 keeps p micro-batches
of activations in flight, times (1 + (p-1)/(p v)) when interleaved (Korthikanti et al. 2022, sec.
4.2.3). Data parallelism (Rajbhandari et al., SC'20): ZeRO 0/1 all-reduce the accumulated gradients
once per step (the torch engine's ZeRO 1, FSDP2 without gradient sync until the last micro-batch, runs
it as one reduce-scatter of the gradients and one all-gather of the updated weights: the same volume);
ZeRO 2 keeps only a gradient shard, so it reduce-scatters every micro-batch's gradients and all-gathers
the updated parameters once per step; ZeRO 3 also all-gathers the parameters in every micro-batch's
forward and backward. Sharded stages gather and reduce layer by layer (FSDP units, DeepSpeed's
per-module gathers), one collective per block copy plus one for the loose ops, each paying the link
latency, and copy the parameters or gradients into and out of flat communication buffers (one read and
one write of the tensor, at memory bandwidth).
Communication overlaps the backward (gradients) or the stage's compute (ZeRO 3 gathers) where the
device computes and communicates at once (the profile's ``overlaps_communication``), else adds to
the step. Model states take 2 + 2 + 12 bytes per parameter in mixed precision (bf16/fp16 weights and
gradients, fp32 master weights and Adam moments; ZeRO's K = 12; the plan's ``master_weights``) and
b + b + 2b when a model trains in its own dtype of b bytes (the plan's ``dtype``: the weights are the
master copy, K = 2b for the two Adam moments; float32 4 + 4 + 8, a bf16 model without master weights
2 + 2 + 4), divided over dp by stage: 1 optimizer states, 2 also gradients, 3 also weights; offload
moves the optimizer states and step to the CPU (ZeRO-Offload, Ren et al. 2021; the step and the micro-batches'
gradient copies to and from the host priced as DeepSpeed runs them, ``cost.offload``). Without master
weights, under ZeRO 1 and 2 the rank's optimizer updates its own partition of the weights, a copy
next to the full replicated weights (DeepSpeed's flat partition, FSDP2's sharded parameters under
``reshard_after_forward=False``): b more bytes per parameter over dp; mixed precision counts that copy
in K already, and ZeRO 3 updates the shards in place. A model captured under autocast (``graph.precision``)
keeps float32 states as above, computes and saves activations in the autocast's dtype (the graph's ops carry
it), and holds a 16-bit copy of every weight it computes with for the step (autocast caches the casts, and
the products save them for backward): 2 more bytes per parameter of the stage, over tp but not over dp
(the copies are of the gathered weights), counted in ``other_bytes``.
Model-state bytes per precision and engine: ``cost.states``.
Context parallelism (``Plan.cp``): data parallelism runs over the dp x cp ranks (DDP's all-reduce, FSDP2's mesh
flattened), so the states divide, and the collectives run, over dp x cp where they did over dp; the ops run on S / cp
tokens of each sample (``cost.layer``, ``cost.context_parallel``; the ops outside the blocks at micro_batch / cp
samples, ``cost.rows``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..graph.fold import Block, FoldedGraph
from ..graph.ir import OpGraph
from ..space.block import BlockSpace, analyse_block
from ..space.experts import Experts, expert_ops
from ..space.plan import LayerStrategy, Plan, blocks_named_twice
from ..space.tp_meta import tp_checks
from ..space.vocab import VocabLayout, vocab_layout
from .accumulation import accumulation_s
from .comm import p2p_s
from .context import Context, ContextTable
from .data_parallel import data_parallel_s
from .deepspeed_memory import largest_tied_parameter, overlaps_comm
from .layer import BlockCost, LooseCost, LooseOps, tp_comm_hidden_s
from .memory import dp_sharded_elements, memory_rows, uncast_parameter_elements
from .offload import gradient_copies_s, offload_step_s
from .pipeline_memory import in_flight
from .profile import Cluster
from .rows import plan_rows
from .runtimes import Runtime
from .states import DTYPE_BYTES, StateBytes, state_bytes


def _carried_bytes(block: Block) -> int:
    refs = {(r.index, r.slot) for op in block.ops for r in op.sources if r.kind == "prev"}
    return sum(block.ops[j].outputs[s].nbytes for j, s in refs)


def _side_input_refs(blocks) -> set[tuple[int, int]]:
    """(op, output) of every tensor the block copies read from outside their stream (made by the ops before them:
    a materialised attention mask, rotary tables)."""
    return {(r.index, r.slot) for b in blocks for op in b.ops for r in op.sources if r.kind == "op"}


def _side_inputs_bytes(graph: OpGraph, blocks) -> tuple[float, float]:
    """(bytes per sample of the tensors the copies read from outside their stream that ops make, bytes of the
    module buffers outside the copies they read, whatever the micro-batch): what a pipeline stage receives beside
    the stream, once per stage and micro-batch (``runtime.pipeline.split.Wiring``: each stage relays what later
    stages read, a root module's causal mask or rotary tables among them), into a buffer of its own that the
    stage's kept activations hold until its backward (``pipeline_memory.relayed_in_flight``). A buffer of the copy
    itself (named under its module) is the stage's own and is not received."""
    made = float(sum(graph.ops[i].outputs[s].nbytes for i, s in _side_input_refs(blocks)))
    scopes = tuple(f"{b.occurrences[0].scope}." for b in blocks if b.occurrences)
    read = {r.name for b in blocks for op in b.ops for r in op.sources if r.kind == "buffer"}
    buffers = dict(graph.buffers)
    outside = float(sum(buffers[name].nbytes for name in read if name in buffers and not name.startswith(scopes)))
    return made, outside


def _unsaved_block_inputs_bytes(graph: OpGraph, blocks) -> float:
    """Bytes per sample of the tensors the block copies read from outside their stream (made once by the ops before
    them and read by every copy: a materialised attention mask) that no op of the captured forward saves: a copy's
    recomputation holds them (``torch.utils.checkpoint`` keeps the inputs of the forward it runs again, the selective
    core's tape the tensors it reads) from the forward to that copy's backward, once for all copies, as Megatron-LM's
    ``CheckpointFunction`` does with the attention mask. Those the forward saves (the rotary tables, read by products)
    are priced with the ops that make them."""
    return float(sum(graph.ops[i].outputs[s].nbytes for i, s in _side_input_refs(blocks)
                     if graph.ops[i].saved_bytes < graph.ops[i].outputs[s].nbytes))


@dataclass(frozen=True)
class GraphFacts:
    """What the cost model reads of the whole graph rather than of its folded blocks: a scan of every op and
    parameter, which grows with depth. Computed once per graph (``planning.folded`` keeps it beside the folding),
    not once per device count, engine or priced kernel mode searched."""

    vocab: VocabLayout                # split over tp or replicated, as the runtime will run it
    autocast_copy_bytes: int
    buffer_bytes: int
    largest_parameter: int            # elements
    largest_tied_parameter: int       # elements
    flops_per_iteration: int          # forward and backward of a step without recomputation (the frontier's MFU)

    @staticmethod
    def of(graph: OpGraph) -> GraphFacts:
        # a script under autocast keeps a 16-bit copy of every weight it computes with for the step (autocast's
        # weight cache; the products save it for backward): bytes per parameter; 0 without autocast, or for
        # weights already in its dtype
        copy = DTYPE_BYTES.get(graph.meta("autocast") or "", 0)
        widths = [DTYPE_BYTES.get(meta.dtype, 4) for _, meta in graph.params]
        # the module's buffers (a causal mask, rotary tables): every rank holds them whole, no engine shards them;
        # and AdamW's step count, a float32 scalar per parameter tensor (``torch/optim/adam.py``; a device tensor on
        # CPU and on the fused and capturable paths, a host scalar on CUDA's default foreach path: bytes either way)
        return GraphFacts(vocab_layout(graph),
                          copy if widths and max(set(widths), key=widths.count) > copy else 0,
                          sum(meta.nbytes for _, meta in graph.buffers) + 4 * len(graph.params),
                          max((meta.numel for _, meta in graph.params), default=0),
                          largest_tied_parameter(graph), graph.flops_per_iteration)


class ModelCost:
    """A folded model on a cluster: per-block costs and the ops between blocks."""

    def __init__(self, graph: OpGraph, folded: FoldedGraph, cluster: Cluster, compiled: bool = False,
                 facts: GraphFacts | None = None, runtime: Runtime = Runtime.OURS) -> None:
        self.graph, self.folded, self.cluster = graph, folded, cluster
        # whose tensor parallelism is priced: the planner prices ours; the public benchmarks price Megatron-LM's
        # sequence-first stream and torch's own styles as their rows ran (``cost.runtimes.Runtime``)
        self.runtime = runtime
        # the kernels the plans priced here run: eager PyTorch (one kernel per op) or compiled blocks (fused)
        self.compiled = compiled
        self._kernels: dict[bool, ModelCost] = {compiled: self}
        seq_len = int(graph.meta("seq_len") or 0) or None
        self.experts = Experts.of(graph)
        self.blocks: list[tuple[Block, BlockCost]] = [
            (b, BlockCost(b.ops, analyse_block(b.ops, seq_len, _carried_bytes(b), tp_checks(graph, b.name)), cluster,
                          compiled, self.experts, runtime))
            for b in folded.blocks]
        # the model's expert weights, elements (sharded over ep ranks by expert parallelism: ``BlockCost.layer``)
        self.expert_parameters = float(sum(b.repeats * cost.expert_params for b, cost in self.blocks))
        # those of them no product reads through autocast's 16-bit copy (``cost.memory``: no copy of them is held)
        dtypes = {name: meta.dtype for name, meta in graph.params}
        self.uncast_expert_parameters = float(sum(
            b.repeats * uncast_parameter_elements(b.ops, expert_ops(b.ops, self.experts), dtypes)
            for b, _ in self.blocks)) if self.experts.params else 0.0
        first_block = min((o.start for b in folded.blocks for o in b.occurrences), default=len(graph.ops))
        last_block = max((o.start + len(b.ops) for b in folded.blocks for o in b.occurrences), default=0)
        self.checkpoint_inputs_bytes = _unsaved_block_inputs_bytes(graph, folded.blocks)
        # what a pipeline stage receives beside the stream: per sample, and per micro-batch whatever its size
        self.relayed_bytes, self.relayed_fixed_bytes = _side_inputs_bytes(graph, folded.blocks)
        self.head_ops = tuple(op for op in folded.loose_ops if op.index < first_block or not folded.blocks)
        self.tail_ops = tuple(op for op in folded.loose_ops if op.index >= last_block and folded.blocks)
        self.middle_ops = tuple(op for op in folded.loose_ops if first_block <= op.index < last_block)
        self.facts = facts or GraphFacts.of(graph)
        self.vocab = self.facts.vocab
        self.autocast_copy_bytes = self.facts.autocast_copy_bytes
        self.buffer_bytes = self.facts.buffer_bytes
        self.largest_parameter = self.facts.largest_parameter
        self.largest_tied_parameter = self.facts.largest_tied_parameter
        self._loose: dict[tuple, tuple[LooseCost, LooseCost]] = {}
        self._loose_ops: dict[bool, tuple[LooseOps, LooseOps]] = {}
        self.row_cache: dict[tuple, tuple] = {}      # ``cost.rows.plan_rows``' columns per shape of context

    def with_kernels(self, compiled: bool) -> ModelCost:
        """This model priced for the other kernel mode (built once, then kept)."""
        if compiled not in self._kernels:
            self._kernels[compiled] = ModelCost(self.graph, self.folded, self.cluster, compiled, self.facts,
                                                self.runtime)
            self._kernels[compiled]._kernels = self._kernels
        return self._kernels[compiled]

    @property
    def spaces(self) -> list[BlockSpace]:
        return [cost.space for _, cost in self.blocks]

    def tp_allowed(self, tp: int) -> bool:
        return tp == 1 or (bool(self.blocks) and all(s.tp_allowed(tp) for s in self.spaces))

    @property
    def carried_bytes(self) -> int:
        """Bytes per sample of the stream a pipeline stage hands on (the largest block's carried state)."""
        return max((cost.space.carried_bytes for _, cost in self.blocks), default=0)

    def units_per_stage(self, pp):
        """Communication units of sharded data parallelism on one stage: its block copies and the loose ops
        (``pp`` a number or an array of them)."""
        return sum(b.repeats for b, _ in self.blocks) // pp + 1

    @property
    def max_pp(self) -> int:
        """Pipelines split the layers of a single repeated block evenly."""
        return self.blocks[0][0].repeats if len(self.blocks) == 1 else 1

    @property
    def branch_names(self) -> tuple[str, ...]:
        return tuple(sorted({b.name for s in self.spaces for b in s.branches}))

    @property
    def refused_branches(self) -> dict[str, str]:
        """{branch: why} of the column -> row branches tensor parallelism must leave replicated."""
        return {name: why for s in self.spaces for name, why in s.refused}

    def check_branches(self, tp_branches: tuple[str, ...]) -> None:
        """A one-line error for a plan that shards a branch this model does not have or cannot shard."""
        for name in tp_branches:
            if name in self.refused_branches:
                raise ValueError(f"tensor parallelism cannot shard branch {name!r} of this model: "
                                 f"{self.refused_branches[name]}")
            if name not in self.branch_names:
                raise ValueError(f"this model has no tensor-parallel branch {name!r} (its branches: "
                                 f"{', '.join(self.branch_names) or 'none'})")

    def check_sequence_parallel(self, plan: Plan) -> None:
        """A one-line error for a plan running a copy sequence-parallel that the block analysis does not allow
        (a stream op mixing positions, a sequence ``tp`` does not divide; ``space.sp_check``)."""
        by_name = {block.name: cost.space for block, cost in self.blocks}
        for bp in plan.blocks:
            space = by_name.get(bp.block)
            if space is None or not any(s.sequence_parallel for s, n in bp.strategies if n):
                continue
            if space.sequence_refused:
                raise ValueError(f"sequence parallelism cannot split the stream of block {bp.block!r}: "
                                 f"{space.sequence_refused}")
            if space.sp_max_tp and space.sp_max_tp % plan.tp:
                raise ValueError(f"sequence parallelism over {plan.tp} devices fails for block {bp.block!r} "
                                 f"(run at capture on fake tensors; it runs over degrees dividing {space.sp_max_tp})")
            if not space.sp_allowed(plan.tp):
                raise ValueError(f"sequence parallelism over {plan.tp} devices splits the {space.seq_len} positions "
                                 f"of block {bp.block!r} unevenly: use a tp that divides the sequence length")

    def loose(self, tp: int, micro_batch: int, pp: int) -> tuple[LooseCost, LooseCost]:
        """(first stage, last stage) costs of the ops outside blocks, eager whatever ``compiled`` says: the runtime
        compiles the block copies only (``runtime.engines.compile``, as torchtitan does)."""
        split = pp > 1                   # which stages hold them matters, not how many stages there are
        key = (tp, micro_batch, split)
        if key not in self._loose:
            if split not in self._loose_ops:
                self._loose_ops[split] = (
                    LooseOps(self.head_ops + self.middle_ops + (() if split else self.tail_ops), self.cluster,
                             self.vocab),
                    LooseOps(self.tail_ops if split else (), self.cluster, self.vocab))
            head, tail = self._loose_ops[split]
            first = head.cost(tp, micro_batch)
            self._loose[key] = (first, tail.cost(tp, micro_batch) if split else first)
        return self._loose[key]


def evaluate(model: ModelCost, ctx: Context, layer_time_s, layer_backward_s, activation_bytes, transient_bytes,
             parameters) -> dict[str, np.ndarray]:
    """Time and memory of plans from their per-stage layer sums (arrays, one entry per plan)."""
    n = len(np.atleast_1d(layer_time_s))
    return evaluate_rows(model, [ctx], np.zeros(n, dtype=np.int64), layer_time_s, layer_backward_s, activation_bytes,
                         transient_bytes, parameters)


def evaluate_rows(model: ModelCost, ctxs: list[Context] | ContextTable, which: np.ndarray, layer_time_s,
                  layer_backward_s, activation_bytes, transient_bytes, parameters, totals_only: bool = False
                  ) -> dict[str, np.ndarray]:
    """``evaluate`` of many plans at once, plan i under context ``ctxs[which[i]]`` (the search prices all its
    candidates in one call, its contexts a ``ContextTable``). Every formula is applied element by element to per-plan
    arrays of the context's numbers, so each plan gets the very floats it would get priced alone.
    ``totals_only``: just iteration time and peak memory (and the exposed data-parallel communication, which
    ``search.bounds`` takes out of a bound's time)."""
    cluster, prof = model.cluster, model.cluster.profile
    table = ctxs if isinstance(ctxs, ContextTable) else ContextTable.of(ctxs)
    if any(kind[4] != model.compiled for kind in table.kinds):
        # the layer sums come from ``model``'s kernels; ``estimate`` switches models (``ModelCost.with_kernels``)
        raise ValueError("contexts priced for other kernels than the model's: use model.with_kernels(compile)")

    r = plan_rows(model, table, which)
    stage_s = np.asarray(layer_time_s, dtype=float) + r.loose_time_s
    # pipeline: (m + (p-1)/v) stage times; every micro-batch sends activations across each of v boundaries
    p2p = 2 * r.v * p2p_s(model.carried_bytes * r.mb / r.tp, r.tp * r.dp >= cluster.devices_per_node, cluster)
    pipeline_s = np.where(r.piped, (r.m + (r.pp - 1) / r.v) * (stage_s + p2p), r.m * stage_s)
    # model states on stage 0 (the larger share of the tied embedding lives there too)
    params = np.asarray(parameters, dtype=float) + r.loose_params
    backward = np.asarray(layer_backward_s, dtype=float)
    dp_comm, exposed = data_parallel_s(r.dp, r.tp, r.zero, r.m, r.gathered * params, r.reduced * params, stage_s,
                                        backward, cluster, model.units_per_stage(r.pp),
                                        serial=r.deepspeed & ~overlaps_comm(r.zero))
    # the optimizer steps a rank's share: over dp under ZeRO (the experts' too)
    opt_params = np.where(r.zero >= 1, dp_sharded_elements(model, r, params) / r.dp, params)
    offloaded_s = offload_step_s(opt_params, r.weight, prof) + gradient_copies_s(r.zero, r.m, opt_params, r.grad, prof)
    optimizer_s = np.where(r.offload, offloaded_s, opt_params * r.adam_moved / prof.memory_bytes_per_s)
    # the micro-batches' gradients summed on the device (``cost.accumulation``), on the stage with stage 0's weights
    accumulate_s = accumulation_s(params, r.m, r.zero, r.dp, r.grad, r.gathered,
                                  model.runtime.fuses_accumulation | (r.offload & (r.zero == 3)), prof)
    time_s = pipeline_s + exposed + optimizer_s + accumulate_s
    mem = memory_rows(model, r, activation_bytes, transient_bytes, params)
    if totals_only:
        return {"iteration_time_s": time_s, "peak_memory_bytes": mem["peak_memory_bytes"],
                "data_parallel_exposed_s": exposed}
    return {
        "iteration_time_s": time_s, **mem,
        "compute_s": r.m * (np.asarray(layer_time_s) + r.loose_time_s),
        "pipeline_bubble_s": np.where(r.piped, (r.pp - 1) / r.v * (stage_s + p2p), 0.0),
        "pipeline_p2p_s": np.where(r.piped, r.m * p2p, 0.0),
        "data_parallel_comm_s": dp_comm, "data_parallel_exposed_s": exposed, "optimizer_s": optimizer_s,
        "gradient_accumulation_s": accumulate_s,
    }


def chain_sums(cost: BlockCost, counts: list[tuple[LayerStrategy, int]], tp: int, tp_branches: tuple[str, ...],
               micro_batch: int, cp: int = 1, ep: int = 1) -> tuple[float, float, float, float, float]:
    """Sums over an ordered chain of copies, entered and left with a replicated stream:
    (time incl. layout changes, backward time, kept activations, transient max, parameters)."""
    time = back = acts = params = 0.0
    transient = 0.0
    layout = False
    for strategy, n in counts:
        if n == 0:
            continue
        sp = strategy.sequence_parallel and tp > 1
        if sp != layout:
            time += cost.layout_change_s(tp, micro_batch)
            layout = sp
        c = cost.layer(strategy, tp, tp_branches, micro_batch, cp, ep)
        time, back = time + n * c.time_s, back + n * c.backward_s
        acts, params = acts + n * c.activation_bytes, params + n * c.parameters
        transient = max(transient, c.transient_bytes)
    if layout:
        time += cost.layout_change_s(tp, micro_batch)
    return time, back, acts, transient, params


def device_chain_sums(cost: BlockCost, counts: list[tuple[LayerStrategy, int]], tp: int,
                      tp_branches: tuple[str, ...], micro_batch: int, virtual_stages: int = 1, cp: int = 1,
                      ep: int = 1) -> tuple[float, float, float, float, float]:
    """``chain_sums`` of a device's copies of one block (in the plan's order) as they run with
    ``virtual_stages`` interleaved stages: v consecutive chains of k / v copies, each held by another
    stage and so each entered and left with a replicated stream (runtime.pipeline.tp.shard_stage); a
    chain with sequence-parallel copies pays its own two layout changes. With SP copies last
    (space.plan.chain_order) that is ceil(n_sp / (k / v)) chains paying them, the fewest any order can."""
    total = sum(n for _, n in counts)
    if virtual_stages == 1 or total % virtual_stages:
        return chain_sums(cost, counts, tp, tp_branches, micro_batch, cp, ep)
    size, chains, chain, room = total // virtual_stages, [], [], total // virtual_stages
    for strategy, n in counts:          # cut the (strategy, copies) entries at the chains' boundaries
        while n:
            take = min(n, room)
            chain.append((strategy, take))
            n, room = n - take, room - take
            if not room:
                chains.append(chain)
                chain, room = [], size
    parts = [chain_sums(cost, c, tp, tp_branches, micro_batch, cp, ep) for c in chains]
    return (sum(p[0] for p in parts), sum(p[1] for p in parts), sum(p[2] for p in parts),
            max(p[3] for p in parts), sum(p[4] for p in parts))


@dataclass(frozen=True)
class Estimate:
    iteration_time_s: float
    peak_memory_bytes: float
    memory_breakdown: dict
    time_breakdown: dict


def estimate(model: ModelCost, plan: Plan, megatron_tp_comm_overlap: bool = False) -> Estimate:
    """The what-if of one plan, priced for the kernels it runs (``plan.compile``).

    ``megatron_tp_comm_overlap`` prices a run that is not the torch engine's: Megatron-LM's
    ``--tp-comm-overlap`` (Transformer Engine's userbuffers), which splits each tensor-parallel all-gather and
    reduce-scatter into chunks and runs them beside the GEMMs that consume or produce them. The planner's space
    never sets it (the torch engine runs TP collectives between its matmuls); it exists to price published
    Megatron-LM runs (``benchmarks/public_h100.py``). Priced as ``tp_comm_hidden_s``."""
    model = model.with_kernels(plan.compile)
    if plan.tp > 1:
        model.check_branches(plan.tp_branches)
        model.check_sequence_parallel(plan)
    ctx = Context.of(plan)
    stage = _stage_counts(model, plan)
    time = back = acts = transient = params = 0.0
    for cost, counts in stage:
        t, b, a, x, p = device_chain_sums(cost, counts, plan.tp, plan.tp_branches, plan.micro_batch,
                                          plan.virtual_stages, plan.cp, plan.ep)
        time, back, acts, params = time + t, back + b, acts + a, params + p
        transient = max(transient, x)
    hidden = tp_comm_hidden_s(stage, plan, model.cluster.profile.overlap_slowdown) if megatron_tp_comm_overlap \
        else 0.0
    r = evaluate(model, ctx, [time - hidden], [back], [acts], [transient], [params])
    mem_keys = ("parameters_bytes", "gradients_bytes", "optimizer_bytes", "activations_bytes", "other_bytes")
    time_keys = ("compute_s", "pipeline_bubble_s", "pipeline_p2p_s", "data_parallel_comm_s",
                 "data_parallel_exposed_s", "optimizer_s", "gradient_accumulation_s")
    breakdown = {k: float(r[k][0]) for k in time_keys}
    breakdown.update(_layer_parts(stage, plan, ctx.micro_batches))
    if megatron_tp_comm_overlap:
        breakdown["tensor_parallel_hidden_s"] = ctx.micro_batches * hidden
    return Estimate(float(r["iteration_time_s"][0]), float(r["peak_memory_bytes"][0]),
                    {k: float(r[k][0]) for k in mem_keys}, breakdown)


def _stage_counts(model: ModelCost, plan: Plan) -> list[tuple[BlockCost, list[tuple[LayerStrategy, int]]]]:
    """Each block's cost model and the plan's (strategy, copies) chain for one stage (a block the plan does not
    name runs its copies with no recomputation; a name the model lacks is refused). Blocks are found by name
    (``graph.block_names`` tells apart blocks sharing a pattern): a plan naming one twice is refused, its entries
    would price as one."""
    by_block = {bp.block: list(bp.strategies) for bp in plan.blocks}
    if len(by_block) < len(plan.blocks):
        raise ValueError("; ".join(blocks_named_twice([bp.block for bp in plan.blocks])))
    unknown = sorted(set(by_block) - {block.name for block, _ in model.blocks})
    if unknown:     # a plan made for another model, or before its blocks were renamed: its strategies would be lost
        raise ValueError(f"the plan names block {unknown[0]!r}, which this model does not have (its blocks: "
                         f"{', '.join(block.name for block, _ in model.blocks) or 'none'})")
    return [(cost, by_block.get(block.name, [(LayerStrategy(), block.repeats // plan.pp)]))
            for block, cost in model.blocks]


def _layer_parts(stage, plan: Plan, micro_batches: int) -> dict[str, float]:
    """What ``compute_s`` (every micro-batch on the slowest stage) is made of in the layers."""
    parts = {"forward_backward_s": 0.0, "recompute_s": 0.0, "tensor_parallel_comm_s": 0.0}
    if plan.cp > 1:
        parts["context_parallel_comm_s"] = 0.0
    if plan.ep > 1:
        parts["expert_parallel_comm_s"] = 0.0
    for cost, counts in stage:
        for strategy, n in counts:
            c = cost.layer(strategy, plan.tp, plan.tp_branches, plan.micro_batch, plan.cp, plan.ep)
            parts["forward_backward_s"] += micro_batches * n * (c.forward_s + c.backward_s)
            parts["recompute_s"] += micro_batches * n * c.recompute_s
            parts["tensor_parallel_comm_s"] += micro_batches * n * c.tp_comm_s
            if plan.cp > 1:
                parts["context_parallel_comm_s"] += micro_batches * n * c.cp_comm_s
            if plan.ep > 1:
                parts["expert_parallel_comm_s"] += micro_batches * n * c.ep_comm_s
    return parts


__all__ = ["Context", "Estimate", "ModelCost", "StateBytes", "chain_sums", "device_chain_sums", "estimate", "evaluate",
           "evaluate_rows", "in_flight", "state_bytes"]
