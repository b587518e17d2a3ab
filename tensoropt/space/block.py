"""Where tensor parallelism can apply inside a block, found from its data flow.

Megatron-LM's layout (Shoeybi et al., 2019): a *branch* is a set of column-parallel linears (their
weight split by output features), the ops between them, and the row-parallel linears that
consume them (weight split by input features, output a partial sum that one all-reduce, or a
reduce-scatter under sequence parallelism, completes). Attention (QKV -> core -> output
projection) and the MLP (up/gate -> activation -> down) are such branches. Everything else in the
block (norms, residual adds, dropouts after the branch) is the *stream*: replicated over the
tensor-parallel group, or split by sequence under sequence parallelism (Korthikanti et al., 2022).

The analysis is structural, so every block that has this shape gets tensor parallelism, whatever
its module names; a block without it (a convolution, an MoE router) stays replicated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..graph.fold import common_scope
from ..graph.ir import Op
from .fused import FeatureLayout, feature_layout
from .sp_check import SP_CHECK_KEY, sequence_refusal


@dataclass(frozen=True)
class Branch:
    name: str
    column: tuple[int, ...]      # template op indices
    row: tuple[int, ...]
    inner: tuple[int, ...]       # ops between column and row linears (sharded by heads/features)
    max_tp: int                  # every TP degree must divide this (heads, kv heads, features)
    layouts: tuple[FeatureLayout, ...] = ()   # per column linear, how its output features are read

    @property
    def ops(self) -> tuple[int, ...]:
        return tuple(sorted(self.column + self.inner + self.row))


@dataclass(frozen=True)
class BlockSpace:
    branches: tuple[Branch, ...]
    stream: tuple[int, ...]          # ops outside every branch
    attention_core: tuple[int, ...]  # ops with an s x s output: what selective recomputation drops
    carried_bytes: int               # bytes entering the block from the previous copy (its checkpoint)
    refused: tuple[tuple[str, str], ...] = ()   # (branch, why) of branches that cannot be sharded
    sequence_refused: str = "not analysed"       # why the stream cannot be split by sequence ("" if it can)
    seq_len: int | None = None
    sp_max_tp: int = 0              # sequence parallelism's degrees divide it (run at capture); 0: not run

    def tp_allowed(self, tp: int) -> bool:
        return tp == 1 or (bool(self.branches) and all(b.max_tp % tp == 0 for b in self.branches))

    def sp_allowed(self, tp: int) -> bool:
        """Whether a copy may run sequence-parallel over ``tp`` ranks: a per-token stream (``space.sp_check``) whose
        sequence ``tp`` divides."""
        return tp > 1 and not self.sequence_refused and bool(self.seq_len) and self.seq_len % tp == 0 \
            and (not self.sp_max_tp or self.sp_max_tp % tp == 0)


def _weight(op: Op):
    """The 2-D weight a linear reads, if any."""
    for meta, ref in zip(op.inputs, op.sources):
        if ref.kind == "param" and len(meta.shape) == 2:
            return meta
    return None


def _activation_inputs(op: Op) -> list[int]:
    return [r.index for r in op.sources if r.kind == "local"]


def analyse_block(ops: tuple[Op, ...], seq_len: int | None, carried_bytes: int = 0,
                  checks: dict | None = None) -> BlockSpace:
    """Branches, stream and attention core of a block template (sources coded local/prev).

    ``checks`` are the capture-time runs of each branch on one rank's share (``space.tp_check``:
    {branch: {"max_tp": m} | {"refused": why}}, joined by the runtime's own runs where the launcher captured the
    model, ``runtime.parallel.layout_probe``, with the block's sequence-parallel run under ``SP_CHECK_KEY``): a refused
    branch stays replicated, a checked one is planned up to its checked degree. None (a graph captured without
    them) plans what the data flow allows.

    Tensors are labelled as Megatron-LM treats them: the stream (replicated) starts at the
    block's inputs; a linear reading the stream is column-parallel and its output is sharded; a
    linear reading a sharded tensor is row-parallel and its output (after the all-reduce) is
    stream again; other ops propagate the label. Sharded ops connected through edges form one
    branch. A branch is invalid, and stays replicated, if one of its ops also reads a stream
    activation (e.g. an MoE dispatch mixing routing weights with tokens) or if a sharded value
    leaves the block.
    """
    n = len(ops)
    sharded = [False] * n
    role = [""] * n                  # "column", "row" or ""
    parent = list(range(n))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    # constant: computed from parameters, buffers or tensors made once before the block (masks,
    # rotary tables); such tensors broadcast into a branch like parameters do
    constant = [False] * n
    conflicts, consumed = set(), set()
    for op in ops:
        inputs = _activation_inputs(op)
        consumed.update(inputs)
        shard_in = [i for i in inputs if sharded[i]]
        stream_in = [i for i in inputs if not sharded[i] and not constant[i]]
        reads_stream = bool(stream_in) or any(r.kind in ("prev", "input") for r in op.sources)
        constant[op.index] = not reads_stream and not shard_in
        if op.kind == "matmul" and _weight(op) is not None:
            role[op.index] = "row" if shard_in else "column"
            sharded[op.index] = not shard_in
        else:
            sharded[op.index] = bool(shard_in)
            if shard_in and reads_stream:
                conflicts.add(op.index)
        for i in shard_in:
            parent[find(i)] = find(op.index)
    escaped = {find(i) for i in range(n) if sharded[i] and i not in consumed}
    groups: dict[int, list[int]] = {}
    for i in range(n):
        if sharded[i] or role[i] == "row":
            groups.setdefault(find(i), []).append(i)
    candidates = []
    for root, members in groups.items():
        cols = tuple(i for i in members if role[i] == "column")
        rows = tuple(i for i in members if role[i] == "row")
        if rows and root not in escaped and not conflicts.intersection(members):
            candidates.append((cols, rows, tuple(i for i in members if not role[i])))
    branches, refused = [], []
    for (cols, rows, inner), name in zip(candidates, _branch_names(ops, [c + r for c, r, _ in candidates])):
        if held := _inner_parameters(ops, cols + rows, inner, constant):
            refused.append((name, f"the ops between its linears read {', '.join(held)}: each rank would compute a "
                                  "partial sum of their gradients over its share, which the runtime does not add up"))
            continue
        layouts = [feature_layout(ops, c, out_features(ops[c])) for c in cols]
        if why := next((f"{ops[c].module_path or 'a linear'}: {lay}" for c, lay in zip(cols, layouts)
                        if isinstance(lay, str)), None):
            refused.append((name, why))
            continue
        max_tp = _max_tp(ops, cols, rows, inner, seq_len, layouts)
        if checks is not None:
            checked = checks.get(name, {"refused": "it was not run on one rank's share at capture"})
            if "refused" in checked:
                refused.append((name, checked["refused"]))
                continue
            max_tp = math.gcd(max_tp, int(checked["max_tp"]))
        branches.append(Branch(name, cols, rows, inner, max_tp, tuple(layouts)))
    branches.sort(key=lambda b: b.column[0])
    in_branch = {i for b in branches for i in b.ops}
    stream = tuple(i for i in range(n) if i not in in_branch)
    core = tuple(sorted({i for b in branches for i in _attention_core(ops, b)}))
    sequence_refused = sequence_refusal(ops, in_branch, seq_len)
    # the runtime's run at capture (``runtime.parallel.layout_probe``)
    probed = (checks or {}).get(SP_CHECK_KEY, {})
    if not sequence_refused and "refused" in probed:
        sequence_refused = probed["refused"]
    return BlockSpace(tuple(branches), stream, core, carried_bytes, tuple(sorted(refused)), sequence_refused, seq_len,
                      int(probed.get("max_tp", 0)))


def _inner_parameters(ops: tuple[Op, ...], linears: tuple[int, ...], inner: tuple[int, ...],
                      constant: list[bool]) -> list[str]:
    """Parameters other than the branch's linears' own that its inner ops read, directly or through constant ops (a
    cast): Qwen3's per-head ``q_norm``/``k_norm`` weights. Each rank uses the whole of such a weight on its share of
    the heads, so its gradient there is a partial sum that the runtime would have to add over the ranks."""
    owners = {r.name.rpartition(".")[0] for i in linears for r in ops[i].sources if r.kind == "param"}
    memo: dict[int, set[str]] = {}

    def read(i: int) -> set[str]:
        if i not in memo:
            memo[i] = {r.name for r in ops[i].sources if r.kind == "param"}
            for r in ops[i].sources:
                if r.kind == "local" and constant[r.index]:
                    memo[i] |= read(r.index)
        return memo[i]
    return sorted({name for i in inner for name in read(i) if name.rpartition(".")[0] not in owners})


def _attention_core(ops: tuple[Op, ...], branch: Branch) -> set[int]:
    """Ops from a product of two activations (Q K^T) up to, not including, the next one (P V):
    the scores, mask, softmax and dropout that selective recomputation drops (Korthikanti et
    al., 2022, sec. 5). Fused attention has no such pair, and keeps no scores anyway."""
    inner = set(branch.inner)
    products = [i for i in branch.inner if ops[i].kind == "matmul"
                and not any(r.kind == "param" for r in ops[i].sources)]
    forward: dict[int, set[int]] = {}
    for i in sorted(inner):
        for j in _activation_inputs(ops[i]):
            if j in inner:
                forward.setdefault(j, set()).add(i)
    core = set()
    for first in products:
        reach, todo = set(), [first]
        while todo:
            for nxt in forward.get(todo.pop(), ()):
                if nxt not in reach:
                    reach.add(nxt)
                    if nxt not in products:
                        todo.append(nxt)
        for second in products:
            if second in reach:
                core |= {first} | {i for i in reach if i != second and i not in products and second in
                                   _downstream(forward, i)}
    return core


def _downstream(forward: dict[int, set[int]], start: int) -> set[int]:
    seen, todo = set(), [start]
    while todo:
        for nxt in forward.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _branch_names(ops: tuple[Op, ...], linears: list[tuple[int, ...]]) -> list[str]:
    """A name per branch: the innermost module holding all of its linears (``attn``, ``mlp``; branches of
    same-named modules share it, e.g. both attentions of a two-layer block, and a plan shards them together),
    or, where that module is the block itself (linears straight in a layer), its linears' own names
    (``q+k+v+proj``)."""
    out = []
    for group in linears:
        name = common_scope([ops[i] for i in group]).rsplit(".", 1)[-1]
        if not name or name.isdigit():
            name = "+".join(dict.fromkeys(owner_module(ops[i], "").rsplit(".", 1)[-1] for i in group))
        out.append(name)
    return out


def _max_tp(ops, cols, rows, inner, seq_len: int | None, layouts=()) -> int:
    """The gcd of everything a TP degree must divide: column output features, row input features, the
    segments and groups of fused outputs, and the heads of (batch, heads, seq, dim) tensors the branch
    computes or reads from its own sharded values (key/value heads too)."""
    sizes = [out_features(ops[c]) for c in cols]
    sizes += [in_features(ops[r]) for r in rows]
    sizes += [u for layout in layouts for u in layout.units]
    sharded = set(cols) | set(inner)
    heads = [m for i in inner for m in ops[i].outputs]
    heads += [m for i in inner for m, r in zip(ops[i].inputs, ops[i].sources)
              if r.kind == "local" and r.index in sharded]
    sizes += [m.shape[1] for m in heads if seq_len and len(m.shape) == 4 and m.shape[2] == seq_len]
    return math.gcd(*sizes) if sizes else 1


def out_features(op: Op) -> int:
    """A linear's output features."""
    return _weight(op).shape[1] if is_transposed(op) else _weight(op).shape[0]


def in_features(op: Op) -> int:
    """A linear's input features."""
    return _weight(op).shape[0] if is_transposed(op) else _weight(op).shape[1]


def is_transposed(op: Op) -> bool:
    """Whether the product reads its weight as an (in, out) matrix: ``nn.Linear`` reaches ATen as x @ W^T
    (a transposed view of its (out, in) weight), ``transformers``' ``Conv1D`` as x @ W of its stored (in, out)
    weight; which of the two a module is, the runtime reads from the module."""
    x = next(m for m, r in zip(op.inputs, op.sources) if r.kind != "param")
    return _weight(op).shape[0] == x.shape[-1]


def owner_module(op: Op, scope: str) -> str:
    """The module owning a linear's 2-D weight, relative to the block copy ``scope``: the weight's owner
    rather than the op's module, since a weight, not a call, is what gets sharded."""
    weight = next(r.name for m, r in zip(op.inputs, op.sources) if r.kind == "param" and len(m.shape) == 2)
    owner = weight.rpartition(".")[0]
    prefix = scope + "." if scope else ""
    return owner[len(prefix):] if owner.startswith(prefix) else owner
