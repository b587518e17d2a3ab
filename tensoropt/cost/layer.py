"""Cost of one copy of a block under a layer strategy, and of the ops between blocks.

Tensor parallelism follows Megatron-LM (Shoeybi et al. 2019; Narayanan et al. 2021): a sharded
branch costs one all-reduce of its output in the forward and one of its input gradient in the
backward; under sequence parallelism (Korthikanti et al. 2022) each all-reduce becomes an
all-gather plus a reduce-scatter of the same total volume, and the stream's ops and activations
divide by tp (every SP copy, recomputed or not, gathers its branches' inputs once more in the backward, having
kept only its share of them: ``runtime.parallel.sequence_parallel``). Activation memory is what the captured graph says
autograd keeps, divided by the op's shard; recomputation keeps less and runs more (Chen et al. 2016; Korthikanti
et al. 2022): ``selective`` drops the attention core, ``full`` keeps only the block's input and holds, while its
backward runs, what its recomputation saves (the same tensors as without recomputation, the gathered inputs as
shares under SP).

Against Korthikanti et al.'s per-layer activations (their eq. 2-5; DESIGN.md "Reference footprints"), for a GPT
layer (eager attention, dropout, 16-bit activations): with SP and selective recomputation they count
``34 s b h / t`` bytes. The captured graph keeps exactly that, plus what the paper leaves out: each LayerNorm's mean
and reciprocal standard deviation (two values per token per norm, in the dtype the capture shows, divided by t
under SP), which ``native_layer_norm`` saves for its backward; the same holds for their formulas without
recomputation, with and without SP. ``tests/test_sequence_parallel.py`` holds the price of such a layer to them.

Context parallelism (``cp`` > 1): every op runs on S / cp tokens of each sample, so a copy is priced at micro_batch /
cp samples (its tensor-parallel traffic too), plus its attention's all-gathers of the keys and values, gathered again
in the backward, which holds the rest of them beside the share the copy keeps (``cost.context_parallel``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..graph.ir import Op
from ..space.block import BlockSpace
from ..space.experts import Experts, dispatch_bytes, expert_ops
from ..space.plan import LayerStrategy
from ..space.vocab import VocabLayout
from . import tp_copies
from .comm import all_gather_s, all_reduce_s, all_to_all_s
from .context_parallel import attention_kv
from .ops import OpArrays, op_times
from .pipeline_memory import backward_working_bytes
from .profile import Cluster
from .runtimes import Runtime


@dataclass(frozen=True)
class LayerCost:
    forward_s: float
    backward_s: float
    recompute_s: float
    tp_comm_s: float
    activation_bytes: float      # kept for backward, per micro-batch
    transient_bytes: float       # extra working set while its backward runs (recomputed activations)
    parameters: float            # elements held on one device before ZeRO partitioning
    cp_comm_s: float = 0.0       # context parallelism's K/V all-gathers and reduce-scatters (``cost.context_parallel``)
    ep_comm_s: float = 0.0       # expert parallelism's dispatch and combine all-to-alls (``_expert_exchange_s``)

    @property
    def time_s(self) -> float:
        return self.forward_s + self.backward_s + self.recompute_s + self.tp_comm_s + self.cp_comm_s + self.ep_comm_s


def _param_elements(ops: tuple[Op, ...], indices) -> np.ndarray:
    """Elements of the parameters each op reads, each parameter counted at its first reader."""
    seen, out = set(), np.zeros(len(ops))
    for i in indices:
        for meta, ref in zip(ops[i].inputs, ops[i].sources):
            if ref.kind == "param" and ref.name not in seen:
                seen.add(ref.name)
                out[i] += meta.numel
    return out


def _row_bias_elements(ops: tuple[Op, ...], space: BlockSpace) -> np.ndarray:
    """Elements of the biases (1-D parameters) the branches' row linears read first: ``RowwiseParallel`` splits a
    row linear's weight and keeps its bias whole on every rank (torch ``distributed/tensor/parallel/style.py``,
    ``RowwiseParallel._partition_linear_fn``: bias ``Replicate()``; ``runtime.parallel.tp_styles.ConvRows``
    likewise)."""
    rows = {i for branch in space.branches for i in branch.row}
    seen, out = set(), np.zeros(len(ops))
    for i, op in enumerate(ops):
        for meta, ref in zip(op.inputs, op.sources):
            if ref.kind == "param" and ref.name not in seen:
                seen.add(ref.name)
                if i in rows and len(meta.shape) == 1:
                    out[i] += meta.numel
    return out


def _column_input_bytes(ops: tuple[Op, ...], columns: tuple[int, ...]) -> float:
    """Bytes of the distinct activations a branch's column linears read: what sequence parallelism gathers."""
    inputs = {(r.kind, r.index, r.slot): meta.nbytes for c in columns for meta, r in zip(ops[c].inputs, ops[c].sources)
              if r.kind in ("local", "prev")}
    return float(sum(inputs.values()))


@dataclass(frozen=True)
class _Shared:
    """Sums over a copy's ops that every recomputation choice of one (tp, branches, SP, micro-batch) reads."""

    forward_s: float
    backward_s: float
    saved_bytes: float
    core_forward_s: float          # the attention core's (selective recomputation)
    core_saved_bytes: float
    comm_s: float                  # tensor-parallel communication of one copy
    sp_comm_s: float               # the same with sequence parallelism's gathers of the branches' inputs
    parameters: float
    cp_gather_s: float = 0.0       # context parallelism: the K/V all-gathers of one copy (forward; again in backward)
    cp_scatter_s: float = 0.0      # and the backward's reduce-scatters of their gradients
    cp_regathered_bytes: float = 0.0   # the K and V gathered again while the copy's backward runs, beyond the share


class BlockCost:
    """Costs of one unique block's copies; built once per (block, profile)."""

    def __init__(self, ops: tuple[Op, ...], space: BlockSpace, cluster: Cluster, compiled: bool = False,
                 experts: Experts | None = None, runtime: Runtime = Runtime.OURS) -> None:
        self.ops, self.space, self.cluster = ops, space, cluster
        self.compiled = compiled
        # whose tensor parallelism runs the copy: the copies around its collectives (``cost.tp_copies``)
        self.runtime = runtime
        self.arrays = OpArrays.of(ops, cluster.profile, compiled)
        self.params = _param_elements(ops, range(len(ops)))
        self.row_biases = _row_bias_elements(ops, space)
        self.backward_bytes = np.array([backward_working_bytes(op) for op in ops], dtype=float)
        self.core = np.zeros(len(ops), dtype=bool)
        self.core[list(space.attention_core)] = True
        self._cache: dict[tuple, LayerCost] = {}
        self._op_cache: dict[tuple, tuple] = {}
        self._branch_nbytes = {b: float(sum(ops[r].outputs[0].nbytes for r in b.row)) for b in space.branches}
        self._gathered_nbytes = {b: _column_input_bytes(ops, b.column) for b in space.branches}
        self.kv = attention_kv(ops, space.attention_core)      # what context parallelism gathers
        # the branch that computes the attention (its K and V are sharded by heads when tp shards it)
        attention = set(space.attention_core) | {i for i, op in enumerate(ops) if op.kind == "attention"}
        self._attention_branch = next((b.name for b in space.branches if attention & set(b.ops)), None)
        # Mixture-of-Experts: the elements of the expert weights (sharded over ep ranks) and the bytes per sample the
        # dispatch all-to-all moves (``space.experts``)
        experts_at = expert_ops(ops, experts) if experts else ()
        self.expert_params = float(self.params[list(experts_at)].sum()) if experts_at else 0.0
        self.dispatch_bytes = dispatch_bytes(ops, experts_at)
        self.dispatch_rows = float(ops[experts_at[0]].inputs[0].shape[0]) if experts_at else 0.0   # tokens x top-k
        self._expert_arrays = self.arrays.subset(list(experts_at)) if experts_at else None
        self.imbalance = experts.imbalance if experts else 1.0

    def shards(self, tp: int, tp_branches: tuple[str, ...], sequence_parallel: bool) -> np.ndarray:
        shard = np.full(len(self.ops), float(tp if sequence_parallel else 1))
        for branch in self.space.branches:
            shard[list(branch.ops)] = tp if branch.name in tp_branches else 1
        return shard

    def _branch_bytes(self, branch) -> float:
        """Bytes of the tensor a branch's all-reduce moves: its row linears' output."""
        return self._branch_nbytes[branch]

    def tp_comm_s(self, tp: int, tp_branches: tuple[str, ...], sequence_parallel: bool, micro_batch: int) -> float:
        """Forward + backward tensor-parallel communication of one copy (tp ranks are adjacent)."""
        if tp == 1:
            return 0.0
        total = 0.0
        for branch in self.space.branches:
            nbytes = self._branch_bytes(branch) * micro_batch
            if branch.name in tp_branches:
                # all-reduce fwd + bwd; under SP all-gather + reduce-scatter of the same volume each way
                total += 2 * all_reduce_s(nbytes, tp, 1, self.cluster)
            elif sequence_parallel:
                # a replicated branch on a sequence-split stream gathers its input in the forward and its output's
                # gradient in the backward; its output and input gradient are sliced locally
                # (runtime.parallel.sequence_parallel)
                total += 2 * all_gather_s(nbytes, tp, 1, self.cluster)
        return total

    def layer(self, strategy: LayerStrategy, tp: int, tp_branches: tuple[str, ...], micro_batch: int, cp: int = 1,
              ep: int = 1) -> LayerCost:
        """One copy under ``strategy``, ``micro_batch`` whole samples per data-parallel rank shared by ``cp``
        context-parallel ranks, its experts (if any) sharded over ``ep`` ranks."""
        key = (strategy, tp, tp_branches, micro_batch, cp, ep)
        if key not in self._cache:
            layer = self._layer(strategy, tp, tp_branches, micro_batch, cp)
            # a block without experts (a dense layer of an MoE model) runs as it would without ep
            sharded = ep > 1 and self._expert_arrays is not None
            self._cache[key] = self._with_experts(layer, strategy, tp, micro_batch, ep) if sharded else layer
        return self._cache[key]

    def _with_experts(self, layer: LayerCost, strategy: LayerStrategy, tp: int, micro_batch: int, ep: int
                      ) -> LayerCost:
        """``layer`` with its experts sharded over ``ep`` ranks (Megatron-LM's and torchtitan's expert parallelism):
        each rank holds experts / ep of the weights. Under balanced routing (what the capture prices) a rank's expert
        products run as many token rows as without it, its tokens' rows going to other ranks and as many coming back,
        reading (and writing gradients of) only its experts' weights (``_expert_products_s``); the dispatch and the
        combine are one all-to-all each in the forward and one each in the backward (their gradients), twice more where
        full recomputation runs the forward again. The ep ranks are consecutive data-parallel ranks: tp apart. With a
        routing imbalance f (``space.experts.ROUTING_IMBALANCE_META``) the busiest rank, which every other waits for,
        receives, computes and keeps f x the average rows: its expert products' work and kept tensors and the rows it
        receives (the dispatched tokens, kept for the products' backward) grow by f. While the copy's backward runs it
        also holds the exchange's buffers, the gradient rows it sends back and those it receives (two tokens x top-k
        x hidden buffers beside the captured forward's, ``runtime.parallel.expert_parallel``), and it keeps two int64
        row orders more than the captured forward (the regrouping of the rows it received and its inverse, which the
        backward's gathers read)."""
        f = self.imbalance
        exchanges = 6 if strategy.recompute == "full" else 4
        exchange_s = exchanges * all_to_all_s(self.dispatch_bytes * micro_batch * f, ep, tp, self.cluster)
        forward_s, backward_s = self._expert_products_s(micro_batch, ep, f)
        extra_kept = (f - 1) * micro_batch * (float(self._expert_arrays.saved_bytes.sum()) + self.dispatch_bytes) + \
            2 * 8 * self.dispatch_rows * micro_batch * f
        full = strategy.recompute == "full"
        exchange_bytes = 2 * self.dispatch_bytes * micro_batch * f
        return replace(layer, forward_s=layer.forward_s + forward_s, backward_s=layer.backward_s + backward_s,
                       recompute_s=layer.recompute_s + (forward_s if full else 0.0),
                       activation_bytes=layer.activation_bytes + (0.0 if full else extra_kept),
                       transient_bytes=layer.transient_bytes + (extra_kept if full else 0.0) + exchange_bytes,
                       parameters=layer.parameters - self.expert_params * (1 - 1 / ep), ep_comm_s=exchange_s)

    def _expert_products_s(self, micro_batch: int, ep: int, imbalance: float) -> tuple[float, float]:
        """(forward, backward) seconds an expert-parallel copy's expert products take beyond the balanced,
        unsharded price in ``layer``: they read (and write the gradients of) only the rank's experts / ep of the
        weights, which saves time where the roofline makes them memory-bound at a small micro-batch (every expert's
        weights read for few rows each), run each local expert's product on ep x the rows (the tokens of ep ranks),
        a larger product at a higher efficiency, and run ``imbalance`` x the rows, priced as ``imbalance`` x their
        balanced time (not at the larger shapes: the efficiency curve would make a busier rank faster on small
        products). Measured ops keep their measured times."""
        arrays, prof = self._expert_arrays, self.cluster.profile
        shard = np.ones(len(arrays.forward_flops))
        whole_f, whole_b = op_times(arrays, shard, micro_batch, prof)
        # the rank's experts / ep groups share the rows all its ep group's tokens send them: ep x the rows per group,
        # larger products (the grouped products' per-group efficiency, ``ops.product_groups``)
        local = replace(arrays, parameter_bytes=arrays.parameter_bytes / ep, groups=np.maximum(arrays.groups / ep, 1.0))
        part_f, part_b = op_times(local, shard, micro_batch, prof)
        return float((imbalance * part_f - whole_f).sum()), float((imbalance * part_b - whole_b).sum())

    def prepare(self, keys) -> None:
        """Compute the shared sums (``_ops``) of many (tp, branches, sequence parallelism, micro-batch, cp) keys at
        once (a key without cp: 1): ``op_times`` is elementwise, so one call over a (keys x ops) array gives each
        key's row the very floats its own call gives, for a fraction of the numpy calls (the search asks for every
        key it prices)."""
        todo = [key for key in dict.fromkeys(k if len(k) == 5 else (*k, 1) for k in keys) if key not in self._op_cache]
        if not todo:
            return
        shard = np.stack([self.shards(tp, branches, sp) for tp, branches, sp, _, _ in todo])
        # under context parallelism each op runs on S / cp tokens of each sample: mb / cp samples' worth
        micro_batch = np.array([[mb / cp if cp > 1 else mb] for *_, mb, cp in todo])
        fwd, bwd = op_times(self.arrays, shard, micro_batch, self.cluster.profile)
        saved = self.arrays.saved_bytes * micro_batch / shard
        for k, key in enumerate(todo):
            self._op_cache[key] = self._shared(key, fwd[k], bwd[k], saved[k])

    def _ops(self, tp: int, tp_branches: tuple[str, ...], sp: bool, micro_batch: int, cp: int = 1) -> _Shared:
        """What every recomputation choice of a (tp, branches, sequence parallelism, micro-batch, cp) shares: the
        per-op (forward s, backward s, saved bytes) summed as each strategy needs them, the tensor- and
        context-parallel communication of one copy, and the parameters."""
        key = (tp, tp_branches, sp, micro_batch, cp)
        self.prepare([key])
        return self._op_cache[key]

    def sp_copies_s(self, tp: int, tp_branches: tuple[str, ...], micro_batch: int, cp: int = 1) -> tuple[float, float]:
        """(copies beside ``tp_comm_s``'s collectives, beside the backward's gathers again) of one sequence-parallel
        copy (``cost.tp_copies``): none for Megatron-LM's sequence-first stream."""
        if tp == 1:
            return 0.0, 0.0
        branches = [(self._branch_bytes(b), self._gathered_nbytes[b], b.name in tp_branches)
                    for b in self.space.branches]
        return tp_copies.sp_copies_s(branches, micro_batch, micro_batch / cp, self.compiled, self.cluster.profile,
                                     self.runtime)

    def reduce_copies_s(self, tp: int, tp_branches: tuple[str, ...], micro_batch: int, cp: int = 1) -> float:
        """The copies of one eager tensor-parallel copy without sequence parallelism (``cost.tp_copies``): torch's
        styles' only (ours and Megatron-LM's sum in place)."""
        if tp == 1:
            return 0.0
        sharded = [self._branch_bytes(b) for b in self.space.branches if b.name in tp_branches]
        return tp_copies.reduce_copies_s(sharded, micro_batch / cp, self.compiled, self.cluster.profile,
                                         self.runtime)

    def _shared(self, key: tuple, fwd: np.ndarray, bwd: np.ndarray, saved: np.ndarray) -> _Shared:
        tp, tp_branches, sp, micro_batch, cp = key
        tokens = micro_batch / cp           # samples' worth of tokens on this rank (S / cp of each sample)
        comm = self.tp_comm_s(tp, tp_branches, sp, tokens)
        # the copies around the collectives: forward and backward alike (a full recomputation's forward again pays
        # half), under SP beside the backward's gathers again too, which no recomputation repeats
        copies, backward_copies = self.sp_copies_s(tp, tp_branches, micro_batch, cp) if sp else \
            (self.reduce_copies_s(tp, tp_branches, micro_batch, cp), 0.0)
        comm += copies
        # under sequence parallelism every copy keeps its branches' gathered inputs as the share (in ``saved``:
        # the ops that make them run on the share) and gathers them again in the backward, as Megatron-LM does:
        # without recomputation, under selective recomputation, and in a full recomputation's recomputed
        # forward (runtime.parallel.sequence_parallel composes its saved-tensor hooks with the recomputation's)
        gathered = comm + backward_copies + (sum(all_gather_s(self._gathered_nbytes[b] * tokens, tp, 1, self.cluster)
                                                 for b in self.space.branches) if sp else 0.0)
        # a sharded branch's parameters divide by tp, but for its row linears' biases (kept whole)
        whole = np.where(self._sharded_params(tp_branches), self.row_biases, self.params)
        # context parallelism: K and V are gathered over the cp ranks (stride tp in the dp x cp x tp mesh) and kept
        # as the rank's share, gathered again in the backward (``cost.context_parallel``); a rank holds its tp share
        # of their heads where tp shards the attention's branch. Their bytes are per sample: mb / heads-shard of them
        kv = micro_batch / (tp if self._attention_branch in tp_branches else 1)
        extra = self.kv.extra_saved_bytes(kv, cp)
        return _Shared(float(fwd.sum()), float(bwd.sum()), float(saved.sum()) + extra, float(fwd[self.core].sum()),
                       float(saved[self.core].sum()), comm, gathered, float(((self.params - whole) / tp + whole).sum()),
                       self.kv.gather_s(kv, cp, tp, self.cluster), self.kv.scatter_s(kv, cp, tp, self.cluster),
                       self.kv.regathered_bytes(kv, cp))

    def _layer(self, strategy, tp, tp_branches, micro_batch, cp=1) -> LayerCost:
        sp = strategy.sequence_parallel and tp > 1
        shared = self._ops(tp, tp_branches, sp, micro_batch, cp)
        comm, all_saved = shared.comm_s, shared.saved_bytes
        # context parallelism: the forward's all-gathers, the backward's gathers again of the kept shares and its
        # reduce-scatters; the gathered-again K and V are held while the copy's backward runs
        cp_comm = 2 * shared.cp_gather_s + shared.cp_scatter_s
        if strategy.recompute == "full":
            # the block's input checkpoint is the rank's S / cp tokens; its recomputed forward gathers K and V again
            kept = self.space.carried_bytes * (micro_batch / cp) / (tp if sp else 1)
            recompute, transient = shared.forward_s + comm / 2, all_saved
            cp_comm += shared.cp_gather_s
        elif strategy.recompute == "selective":
            kept = all_saved - shared.core_saved_bytes
            recompute, transient = shared.core_forward_s, shared.core_saved_bytes
        else:
            kept, recompute, transient = all_saved, 0.0, 0.0
        return LayerCost(shared.forward_s, shared.backward_s, recompute, shared.sp_comm_s, kept,
                         transient + shared.cp_regathered_bytes, shared.parameters, cp_comm)

    def _sharded_params(self, tp_branches: tuple[str, ...]) -> np.ndarray:
        out = np.zeros(len(self.ops), dtype=bool)
        for branch in self.space.branches:
            if branch.name in tp_branches:
                out[list(branch.column + branch.row)] = True
        return out

    def layout_change_s(self, tp: int, micro_batch: int) -> float:
        """Moving the carried stream between replicated and sequence-split (one way, fwd + bwd): one all-gather,
        and its layout copy where the batch dim is not 1 (``sp_copies_s``)."""
        if tp == 1:
            return 0.0
        nbytes = self.space.carried_bytes * micro_batch
        copy = tp_copies.layout_change_copy_s(nbytes, micro_batch, self.compiled, self.cluster.profile,
                                              self.runtime)
        return all_gather_s(nbytes, tp, 1, self.cluster) + copy


def tp_comm_hidden_s(stage: list[tuple[BlockCost, list[tuple[LayerStrategy, int]]]], plan,
                     overlap_slowdown: float) -> float:
    """Tensor-parallel communication of one micro-batch on one stage that overlapping it with the GEMMs
    hides (Megatron-LM ``--tp-comm-overlap``; Wang et al., ASPLOS'23, "Overlap communication with dependent
    computation via decomposition"): per copy, the collectives run beside that copy's own compute, so at most
    its compute time hides, and the compute beside them loses the profile's ``overlap_slowdown`` of the
    overlapped time (as for data-parallel overlap, ``cost.data_parallel``). ``stage``: each block's cost and the
    (strategy, copies) of one stage; ``plan``: a ``space.plan.Plan`` (its tp, branches and micro-batch)."""
    hidden = 0.0
    for cost, counts in stage:
        for strategy, n in counts:
            c = cost.layer(strategy, plan.tp, plan.tp_branches, plan.micro_batch, plan.cp, plan.ep)
            overlapped = min(c.tp_comm_s, c.forward_s + c.backward_s + c.recompute_s)
            hidden += n * (1 - overlap_slowdown) * overlapped
    return hidden


@dataclass(frozen=True)
class LooseCost:
    """The ops before the first block (first stage) or after the last one (last stage)."""

    time_s: float                    # forward + backward, vocabulary-parallel all-reduces included
    activation_bytes: float
    parameters: float
    backward_bytes: float = 0.0      # the largest working set of one op's backward (pipeline_memory)


class LooseOps:
    """The ops before the first block (first stage) or after the last one (last stage), costed at any
    (tp, micro-batch): their per-op arrays and vocabulary split are worked out once per model.

    With tp > 1 and a model whose vocabulary can be split over tp ranks (``space.vocab``: the layout the runtime
    applies, Megatron's vocabulary-parallel embedding and cross-entropy), the ops that read the embedding table
    or head weight, or produce or read vocabulary-sized tensors, divide by tp, at the cost of one all-reduce of
    the hidden state in the forward (embedding output) and one in the backward (head input gradient). Where the
    vocabulary stays replicated (the model refuses the split, or tp does not divide it) they are priced whole on
    every rank, with no vocabulary all-reduce: full logits, full table and head weights."""

    def __init__(self, ops: tuple[Op, ...], cluster: Cluster, layout: VocabLayout | None, compiled: bool = False
                 ) -> None:
        self.ops, self.cluster, self.layout = ops, cluster, layout or VocabLayout(refused="no vocabulary")
        self.vocab_split = np.zeros(len(ops), dtype=bool)   # ops that divide by tp when the vocabulary is split
        self.hidden_bytes = 0.0                              # the embedding's output: all-reduced when split
        vocab, params = self.layout.vocab, set(self.layout.params)
        if not self.layout.refused:
            for i, op in enumerate(ops):
                reads_table = any(r.kind == "param" and r.name in params for r in op.sources)
                sized = any(m.shape and m.shape[-1] == vocab for m in op.outputs + op.inputs)
                self.vocab_split[i] = reads_table or sized
                if op.kind == "embedding" and reads_table:
                    self.hidden_bytes = max(self.hidden_bytes, float(op.outputs[0].nbytes))
        self.arrays = OpArrays.of(ops, cluster.profile, compiled) if ops else None
        self.params = _param_elements(ops, range(len(ops)))
        self.backward_bytes = np.array([backward_working_bytes(op) for op in ops], dtype=float)
        # the ops from the logits to the loss (casts, views, log-softmax, nll_loss): under the lean loss, split or whole
        # (``runtime.parallel.vocab_loss``), their backward is the in-place one, the gradient the saved softmax itself
        # and its cast to the logits' dtype, all within ``torch_memory.loss_gradient_bytes``'s moment
        self.loss_path = self.vocab_split & np.array([not any(r.kind == "param" for r in op.sources) for op in ops],
                                                     dtype=bool)

    def split(self, tp: int) -> bool:
        """Whether the vocabulary is split over ``tp`` ranks (as the runtime decides: ``VocabLayout.why_not``)."""
        return self.layout.split(tp)

    def cost(self, tp: int, micro_batch: int) -> LooseCost:
        if not self.ops:
            return LooseCost(0.0, 0.0, 0.0, 0.0)
        split = self.split(tp)
        shard = np.where(self.vocab_split, float(tp), 1.0) if split else np.ones(len(self.ops))
        hidden_bytes = self.hidden_bytes if split else 0.0
        fwd, bwd = op_times(self.arrays, shard, micro_batch, self.cluster.profile)
        comm = 2 * all_reduce_s(hidden_bytes * micro_batch, tp, 1, self.cluster) if hidden_bytes else 0.0
        activations = float((self.arrays.saved_bytes * micro_batch / shard).sum())
        backward = np.where(self.loss_path & self.layout.fused_loss, 0.0, self.backward_bytes)
        return LooseCost(float((fwd + bwd).sum()) + comm, activations, float((self.params / shard).sum()),
                         float((backward * micro_batch / shard).max()))
