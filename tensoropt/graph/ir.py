"""Operator-graph IR: the planner's view of a model.

Ops are the compute-carrying ATen operators a training step's forward pass runs, in execution
order (a topological order of the data-flow graph). Pure aliasing ops (views, reshapes,
transposes) are not ops here: a consumer of a view points straight at the op that produced the
underlying storage, which is what decides where data lives and what crosses a device boundary.

Everything is a frozen dataclass so that captured graphs are hashable values, and everything
round-trips through JSON (``to_json`` / ``from_json``) with a ``schema_version``; nothing is
pickled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:          # networkx is imported where the graph is first asked for (``OpGraph.nx``): ~0.3 s of
    import networkx as nx  # every process's start (launcher, capture, each worker) that never walks the graph

GRAPH_SCHEMA_VERSION = 1

_DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
    "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype given by its short name (``"bfloat16"``)."""
    return _DTYPE_BYTES.get(dtype, 4)


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of a tensor; no data."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_bytes(self.dtype)

    def to_json(self) -> list:
        return [list(self.shape), self.dtype]

    @staticmethod
    def from_json(data: list) -> TensorMeta:
        return TensorMeta(tuple(int(d) for d in data[0]), str(data[1]))


RefKind = Literal["op", "param", "buffer", "input", "const"]


@dataclass(frozen=True)
class Ref:
    """Where one input of an op comes from.

    ``op``: output ``slot`` of op ``index``; ``param`` / ``buffer``: a module state tensor by
    ``name``; ``input``: the model's example input ``index``; ``const``: a tensor created outside
    the traced forward (e.g. a Python-level constant).
    """

    kind: RefKind
    index: int = -1
    slot: int = 0
    name: str = ""

    def to_json(self) -> list:
        return [self.kind, self.index, self.slot, self.name]

    @staticmethod
    def from_json(data: list) -> Ref:
        return Ref(data[0], int(data[1]), int(data[2]), str(data[3]))


@dataclass(frozen=True)
class Op:
    """One operator of the forward pass, with everything the cost model needs.

    ``saved_bytes`` counts this op's *outputs* that autograd keeps alive for the backward pass
    (whichever later op saved them): attributing saved activations to their producer counts each
    stored tensor exactly once, which is what peak-memory accounting needs.
    """

    index: int
    target: str                       # ATen overload, e.g. "aten.addmm.default"
    kind: str                         # coarse category: matmul, attention, norm, elementwise, ...
    module_path: str                  # qualified name of the innermost module that ran it
    inputs: tuple[TensorMeta, ...]
    outputs: tuple[TensorMeta, ...]
    sources: tuple[Ref, ...]          # one per input, same order
    attrs: tuple[tuple[str, str], ...] = ()   # non-tensor arguments, stringified
    forward_flops: int = 0
    backward_flops: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    saved_bytes: int = 0
    requires_grad: bool = False       # whether its output takes part in backward
    # per input, which features of its producer's output it reads when it reads a view of it (see
    # ``graph.views``): () for all of them in order; empty tuple for an op whose inputs all read so
    input_views: tuple[tuple[int, ...], ...] = ()

    @property
    def params(self) -> tuple[str, ...]:
        """Names of the parameters this op reads."""
        return tuple(r.name for r in self.sources if r.kind == "param")

    def signature(self) -> tuple:
        """Everything that makes two ops interchangeable for planning, minus names and position.

        Two ops with equal signatures cost the same and offer the same strategies; folding uses it.
        ``saved_bytes`` is left out: whether an output is kept for backward depends on its
        consumer (the last layer's output may feed an op that saves nothing), not on the op.
        """
        param_metas = tuple(m for m, r in zip(self.inputs, self.sources) if r.kind == "param")
        return (self.target, self.kind, self.inputs, self.outputs, self.attrs, param_metas,
                tuple(r.kind for r in self.sources), self.requires_grad, self.input_views)

    def input_view(self, k: int) -> tuple[int, ...]:
        """Which features of its producer's output input ``k`` reads (``graph.views``); () for all."""
        return self.input_views[k] if self.input_views else ()

    def key(self) -> str:
        """A stable text key of what the op computes (overload, input shapes/dtypes, attributes):
        measured op times in device profiles are stored under it."""
        inputs = ",".join(f"{m.dtype}{list(m.shape)}" for m in self.inputs)
        attrs = ",".join(f"{k}={v}" for k, v in self.attrs)
        return f"{self.target}({inputs}|{attrs})"

    def to_json(self) -> dict:
        return {
            "index": self.index, "target": self.target, "kind": self.kind,
            "module_path": self.module_path,
            "inputs": [m.to_json() for m in self.inputs],
            "outputs": [m.to_json() for m in self.outputs],
            "sources": [r.to_json() for r in self.sources],
            "attrs": [list(a) for a in self.attrs],
            "forward_flops": self.forward_flops, "backward_flops": self.backward_flops,
            "bytes_read": self.bytes_read, "bytes_written": self.bytes_written,
            "saved_bytes": self.saved_bytes, "requires_grad": self.requires_grad,
        } | ({"input_views": [list(v) for v in self.input_views]} if self.input_views else {})

    @staticmethod
    def from_json(d: dict) -> Op:
        return Op(
            index=int(d["index"]), target=d["target"], kind=d["kind"], module_path=d["module_path"],
            inputs=tuple(TensorMeta.from_json(m) for m in d["inputs"]),
            outputs=tuple(TensorMeta.from_json(m) for m in d["outputs"]),
            sources=tuple(Ref.from_json(r) for r in d["sources"]),
            attrs=tuple((str(a[0]), str(a[1])) for a in d["attrs"]),
            forward_flops=int(d["forward_flops"]), backward_flops=int(d["backward_flops"]),
            bytes_read=int(d["bytes_read"]), bytes_written=int(d["bytes_written"]),
            saved_bytes=int(d["saved_bytes"]), requires_grad=bool(d["requires_grad"]),
            input_views=tuple(tuple(int(x) for x in v) for v in d.get("input_views", ())),
        )


CROSS_ENTROPY_CALLS = "cross_entropy_calls"    # graph metadata: calls of torch's cross-entropy entry point
OUTPUT_KEY = "output"       # graph metadata: what the forward returned (graph.capture.output_kind)
# graph metadata: "" when the model runs context-parallel, else why not (graph.capture.context_parallel_refusal)
CONTEXT_PARALLEL_META = "context_parallel"
# graph metadata: JSON {module path: {"experts": E, "top_k": k, "params": [names]}} of a Mixture-of-Experts model's
# experts modules (graph.experts), absent for a dense model
EXPERTS_META = "experts"


@dataclass(frozen=True)
class OpGraph:
    """A captured model: ops in execution order plus the model's state and inputs."""

    name: str
    ops: tuple[Op, ...]
    params: tuple[tuple[str, TensorMeta], ...]     # unique parameters (tied weights once)
    buffers: tuple[tuple[str, TensorMeta], ...]
    inputs: tuple[TensorMeta, ...]
    fingerprint: str = ""
    metadata: tuple[tuple[str, str], ...] = field(default=())

    def __post_init__(self) -> None:
        for i, op in enumerate(self.ops):
            if op.index != i:
                raise ValueError(f"op {op.target} has index {op.index} at position {i}")

    # -- totals --------------------------------------------------------------------------------
    @property
    def num_parameters(self) -> int:
        return sum(m.numel for _, m in self.params)

    @property
    def parameter_bytes(self) -> int:
        return sum(m.nbytes for _, m in self.params)

    @property
    def forward_flops(self) -> int:
        return sum(op.forward_flops for op in self.ops)

    @property
    def flops_per_iteration(self) -> int:
        """Forward plus backward FLOPs of one training step (no recomputation)."""
        return sum(op.forward_flops + op.backward_flops for op in self.ops)

    @property
    def saved_activation_bytes(self) -> int:
        return sum(op.saved_bytes for op in self.ops)

    # -- structure -----------------------------------------------------------------------------
    def edges(self) -> list[tuple[int, int, int, int]]:
        """Data-flow edges as (producer, producer output slot, consumer, consumer input slot)."""
        return [(r.index, r.slot, op.index, k)
                for op in self.ops for k, r in enumerate(op.sources) if r.kind == "op"]

    @cached_property
    def nx(self) -> nx.DiGraph:
        """The graph as a networkx DiGraph: node = op index (attribute ``op``), edge attribute
        ``slots`` = [(producer slot, consumer slot), ...] (an op may read one producer twice)."""
        import networkx as nx
        g = nx.DiGraph()
        for op in self.ops:
            g.add_node(op.index, op=op)
        for src, src_slot, dst, dst_slot in self.edges():
            if g.has_edge(src, dst):
                g.edges[src, dst]["slots"].append((src_slot, dst_slot))
            else:
                g.add_edge(src, dst, slots=[(src_slot, dst_slot)])
        return g

    def meta(self, key: str, default: str = "") -> str:
        return dict(self.metadata).get(key, default)

    # -- serialisation -------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": GRAPH_SCHEMA_VERSION,
            "kind": "tensoropt.opgraph",
            "name": self.name,
            "fingerprint": self.fingerprint,
            "metadata": dict(self.metadata),
            "inputs": [m.to_json() for m in self.inputs],
            "params": [[n, m.to_json()] for n, m in self.params],
            "buffers": [[n, m.to_json()] for n, m in self.buffers],
            "ops": [op.to_json() for op in self.ops],
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> OpGraph:
        version = d.get("schema_version")
        if d.get("kind") != "tensoropt.opgraph" or version != GRAPH_SCHEMA_VERSION:
            raise ValueError(f"not a tensoropt op graph of schema_version {GRAPH_SCHEMA_VERSION} "
                             f"(kind={d.get('kind')!r}, schema_version={version!r})")
        return OpGraph(
            name=d["name"],
            ops=tuple(Op.from_json(o) for o in d["ops"]),
            params=tuple((n, TensorMeta.from_json(m)) for n, m in d["params"]),
            buffers=tuple((n, TensorMeta.from_json(m)) for n, m in d["buffers"]),
            inputs=tuple(TensorMeta.from_json(m) for m in d["inputs"]),
            fingerprint=d.get("fingerprint", ""),
            metadata=tuple(sorted((str(k), str(v)) for k, v in d.get("metadata", {}).items())),
        )
