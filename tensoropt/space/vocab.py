"""Whether a model's vocabulary can be split over tensor-parallel ranks, read from its captured graph.

Megatron-LM splits the vocabulary with tensor parallelism (Shoeybi et al. 2019, sec. 3): each rank holds
1/tp of the embedding table's rows and of the LM head's output features, and the cross-entropy is computed on
the rank's slice of the logits (torch's ``loss_parallel``), so the full logits never exist on one rank. That
holds only when the logits go straight into the loss. This module finds, in the graph:

- the *head*: the matmul whose output has the vocabulary as its last dim and feeds the cross-entropy
  (``_log_softmax`` over that dim, then ``nll_loss``), possibly through dtype casts; it must run inside an
  ``nn.Linear`` (checked on the model at capture time, ``check_vocab_modules``);
- the *embedding*: the ``embedding`` op whose table has the vocabulary's rows; tied to the head when the head
  reads the same parameter (one weight, sharded once on dim 0 for both uses).

Anything else reading the logits (a second loss term, label smoothing's sum, the logits returned and used) or
the table, an embedding or head that is not an ``nn.Embedding`` / ``nn.Linear``, or a degree that does not
divide the vocabulary, leaves the vocabulary replicated: every rank holds the whole table and head and
computes the full logits. The cost model prices that (``cost.layer.LooseOps``) and the runtime runs it
(``runtime.parallel.vocab_parallel``), from this one analysis, written into plan.json by the launcher as
``vocab_parallel``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from ..graph.ir import CROSS_ENTROPY_CALLS, Op, OpGraph, dtype_bytes

VOCAB_META = "vocab_check"          # graph metadata: {"refused": why} when the model's modules cannot be sharded
VOCAB_PARALLEL_KEY = "vocab_parallel"   # plan.json: the layout the workers apply (``VocabLayout.for_tp``)
CASTS = ("aten._to_copy.default", "aten.to.dtype", "aten.to.dtype_layout", "aten.clone.default")


@dataclass(frozen=True)
class VocabLayout:
    """The vocabulary's modules, or why the vocabulary stays replicated (``refused``)."""

    vocab: int = 0
    embedding: str = ""              # module path of the nn.Embedding holding the table
    head: str = ""                   # module path of the nn.Linear producing the logits
    tied: bool = False               # the head reads the embedding's weight
    params: tuple[str, ...] = ()     # the (captured) names of the table and head weights
    refused: str = ""
    # the loss is the model's one call of torch's cross-entropy entry point on rows of logits, without class weights:
    # it runs on the runtime's lean cross-entropy (``runtime.parallel.vocab_loss``), split or whole; else on torch's
    # (``loss_parallel`` when split)
    fused_loss: bool = False
    logit_bytes: int = 4             # bytes per element of the head's output (the logits' gradient is cast to it)

    def why_not(self, tp: int) -> str:
        """Why the vocabulary is not split over ``tp`` ranks; '' when it is."""
        if self.refused:
            return self.refused
        if self.vocab % tp:
            return f"tp {tp} does not divide the vocabulary of {self.vocab}"
        return ""

    def split(self, tp: int) -> bool:
        """Whether the vocabulary is split over ``tp`` ranks (as the runtime decides: ``why_not``)."""
        return tp > 1 and not self.why_not(tp)

    def for_tp(self, tp: int) -> dict:
        """plan.json's ``vocab_parallel`` entry for a plan of ``tp`` ranks."""
        why = self.why_not(tp)
        if why:
            return {"enabled": False, "reason": why}
        return {"enabled": True, "embedding": self.embedding, "head": self.head, "tied": self.tied,
                "vocab": self.vocab}


def vocab_layout(graph: OpGraph) -> VocabLayout:
    """The vocabulary layout of ``graph`` (module doc); refused with a reason when it cannot be split."""
    recorded = json.loads(graph.meta(VOCAB_META) or "{}")
    loss = [op for op in graph.ops if op.target.startswith("aten.nll_loss")]
    if len(loss) != 1:
        return VocabLayout(refused=f"the loss is not one cross-entropy ({len(loss)} nll_loss ops)")
    head, why = _head_of(graph.ops, loss[0])
    if head is None:
        return VocabLayout(refused=why)
    vocab = head.outputs[0].shape[-1]
    head_weight = _weight(head, vocab)
    if head_weight is None:
        return VocabLayout(refused=f"the logits' matmul ({head.module_path or 'the model'}) reads no "
                                   f"{vocab}-row weight")
    # the logits' users come after the head: the ops from it on are all that needs a consumer map
    if why := _only_feeds_loss(graph.ops, _consumers(graph.ops[head.index:]), head):
        return VocabLayout(refused=why)
    tables = [op for op in graph.ops if op.kind == "embedding" and op.inputs[0].shape[0] == vocab
              and op.sources[0].kind == "param"]
    if len(tables) != 1:
        return VocabLayout(refused=f"{len(tables)} embedding lookups of a {vocab}-row table (the runtime "
                                   "shards exactly one)")
    table = tables[0]
    params = tuple(sorted({table.sources[0].name, head_weight}))
    readers = list({id(op): op for op in graph.ops for r in op.sources if r.kind == "param" and r.name in params}
                   .values())
    if others := [op for op in readers if op is not table and op is not head]:
        return VocabLayout(refused=f"the vocabulary's weights are also read by {others[0].target} in "
                                   f"{others[0].module_path or 'the model'}")
    if not head.module_path or not table.module_path:
        return VocabLayout(refused="the embedding or the LM head is not called as a module")
    # one call of the entry point on rows of logits (``nll_loss_forward``: 2-D, not ``nll_loss2d``), no class weights
    fused = graph.meta(CROSS_ENTROPY_CALLS) == "1" and len(loss[0].inputs) == 2 and \
        loss[0].target.startswith("aten.nll_loss_forward")
    layout = VocabLayout(vocab, table.module_path, head.module_path, table.sources[0].name == head_weight, params,
                         fused_loss=fused, logit_bytes=dtype_bytes(head.outputs[0].dtype))
    return replace(layout, refused=recorded.get("refused", ""))


def _consumers(ops: tuple[Op, ...]) -> dict[int, list[Op]]:
    out: dict[int, list[Op]] = {}
    for op in ops:
        for ref in op.sources:
            if ref.kind == "op":
                out.setdefault(ref.index, []).append(op)
    return out


def _producer(ops: tuple[Op, ...], op: Op, k: int = 0) -> Op | None:
    ref = op.sources[k] if len(op.sources) > k else None
    return ops[ref.index] if ref is not None and ref.kind == "op" else None


def _head_of(ops: tuple[Op, ...], loss: Op) -> tuple[Op | None, str]:
    """The matmul whose output the cross-entropy reads (through a log-softmax over its last dim and casts)."""
    softmax = _producer(ops, loss)
    if softmax is None or not softmax.target.startswith("aten._log_softmax"):
        return None, "the loss's nll_loss does not read a log_softmax (not F.cross_entropy on the logits)"
    dim = int(dict(softmax.attrs).get("dim", -1))
    if dim not in (-1, len(softmax.inputs[0].shape) - 1):
        return None, "the cross-entropy's class dim is not the logits' last dim"
    head = _producer(ops, softmax)
    while head is not None and head.target in CASTS:
        head = _producer(ops, head)
    if head is None or head.kind != "matmul":
        return None, "the cross-entropy's input is not the output of a linear layer (the LM head)"
    return head, ""


def _weight(head: Op, vocab: int) -> str | None:
    """The 2-D parameter of the head with the vocabulary as one of its dims (the weight, maybe transposed)."""
    return next((r.name for m, r in zip(head.inputs, head.sources)
                 if r.kind == "param" and len(m.shape) == 2 and vocab in m.shape), None)


def _only_feeds_loss(ops: tuple[Op, ...], consumers: dict[int, list[Op]], head: Op) -> str:
    """Why the logits are used for more than one cross-entropy; '' when they are not."""
    frontier = [head]
    while frontier:
        op = frontier.pop()
        for user in consumers.get(op.index, []):
            if user.target in CASTS or user.target.startswith("aten._log_softmax"):
                frontier.append(user)
            elif not user.target.startswith("aten.nll_loss"):
                return (f"the logits are also used by {user.target} in {user.module_path or 'the model'} "
                        "(only a plain cross-entropy runs on vocabulary-split logits)")
    return ""


def check_vocab_modules(model, graph: OpGraph) -> dict:
    """At capture time, with the model at hand: {} when the graph's embedding and head are an ``nn.Embedding``
    and an ``nn.Linear`` (what ``RowwiseParallel`` / ``ColwiseParallel`` shard), else {"refused": why}."""
    from torch import nn  # capture time only: the planner reads the recorded check without torch

    layout = vocab_layout(graph)
    if layout.refused:
        return {}
    modules = dict(model.named_modules())
    for path, kind in ((layout.embedding, nn.Embedding), (layout.head, nn.Linear)):
        module = modules.get(path)
        if not isinstance(module, kind):
            return {"refused": f"{path} is a {type(module).__name__}, not an {kind.__name__} (the runtime shards "
                               "the vocabulary of nn.Embedding and nn.Linear modules)"}
    return {}


def with_vocab_check(graph: OpGraph, check: dict) -> OpGraph:
    """``graph`` with the capture-time check recorded in its metadata."""
    meta = dict(graph.metadata) | {VOCAB_META: json.dumps(check, sort_keys=True)}
    return replace(graph, metadata=tuple(sorted(meta.items())))


__all__ = ["VOCAB_META", "VOCAB_PARALLEL_KEY", "VocabLayout", "check_vocab_modules", "vocab_layout",
           "with_vocab_check"]
