"""Fold repeated substructures of an op graph (the TAPAS idea, Shi et al., arXiv 2302.00247).

Repeats are found from the graph itself, not from module names: every op gets a label from its
signature (kind, shapes, dtypes, attributes, parameter shapes), and a repeated block is a
*tandem repeat* of the label sequence (execution order) whose data-flow edges also repeat: each
input of an occurrence comes from the same relative op of the same occurrence, from the previous
occurrence (the carried state, e.g. the residual stream), or from one fixed op before the run
(a shared input such as an attention mask). Layers of different shapes get different labels and
never fold together; identical layers fold whatever their module names.

Search: for each period L, one vectorised comparison of the label array with itself shifted by
L gives the runs; the run covering most ops wins (shortest period on ties), is verified edge by
edge and cut where an edge breaks the pattern; the segments left of and right of it are folded
recursively. Runs of identical blocks anywhere in the graph merge into one unique block.

A block is named by the module-path pattern of its copies (``layers.*``); two blocks of one pattern (a model whose
first layers differ from the rest) are told apart by the copies each holds (``layers.*[0:3]``, ``graph.block_names``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .block_names import block_name, distinct_names
from .ir import Op, OpGraph, Ref

MIN_BLOCK_OPS = 2
MIN_OPS_SAVED = 4      # fold a repeat only if it removes at least this many ops from the search


@dataclass(frozen=True)
class Occurrence:
    """One copy of a block: where it starts in the original op order and its module scope.

    ``renames`` turns the template's names (module paths, parameters, buffers: those of the
    block's first copy) into this copy's: (template prefix, this copy's prefix) pairs.
    ``entry`` binds, for the first occurrence of a run, the inputs that later occurrences take
    from their predecessor: (template op, input slot, producer op, producer slot).
    ``saved`` lists (template op, saved bytes) where this copy keeps a different amount for
    backward than the template (the consumer of a block's output decides what is kept).
    """

    start: int
    scope: str
    first_in_run: bool
    renames: tuple[tuple[str, str], ...] = ()
    entry: tuple[tuple[int, int, int, int], ...] = ()
    saved: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class Block:
    """A unique block: its template ops (sources coded ``local``/``prev``/absolute) and copies."""

    name: str
    ops: tuple[Op, ...]
    occurrences: tuple[Occurrence, ...]

    @property
    def repeats(self) -> int:
        return len(self.occurrences)

    @property
    def positions(self) -> tuple[int, ...]:
        return tuple(o.start for o in self.occurrences)


@dataclass(frozen=True)
class FoldedGraph:
    name: str
    num_ops: int
    blocks: tuple[Block, ...]
    loose_ops: tuple[Op, ...]         # ops outside every block, with their original indices

    @property
    def ops_after_folding(self) -> int:
        """Ops a search visits: each unique block once, plus the ops between blocks."""
        return sum(len(b.ops) for b in self.blocks) + len(self.loose_ops)

    def summary(self, positions: bool = False) -> dict:
        """The ``folding`` object of the CLI's JSON output."""
        blocks = [{"name": b.name, "ops": len(b.ops), "repeats": b.repeats}
                  | ({"positions": list(b.positions)} if positions else {}) for b in self.blocks]
        return {"unique_blocks": blocks, "ops_after_folding": self.ops_after_folding}

    def unfold(self) -> tuple[Op, ...]:
        """Rebuild the original ops exactly (indices, sources, names) from the folded form."""
        ops: dict[int, Op] = {op.index: op for op in self.loose_ops}
        for block in self.blocks:
            prev_start = None
            for occ in block.occurrences:
                entry = {(j, slot): Ref("op", src, src_slot) for j, slot, src, src_slot in occ.entry}
                rename, saved = _renamer(occ.renames), dict(occ.saved)
                for j, tmpl in enumerate(block.ops):
                    sources = tuple(_decode(r, occ, prev_start, entry.get((j, t)))
                                    for t, r in enumerate(tmpl.sources))
                    op = replace(tmpl, index=occ.start + j, sources=sources,
                                 saved_bytes=saved.get(j, tmpl.saved_bytes))
                    ops[occ.start + j] = _renamed(op, rename)
                prev_start = occ.start
        return tuple(ops[i] for i in range(self.num_ops))


def _renamer(renames: tuple[tuple[str, str], ...]):
    """Name mapping that replaces the longest matching dotted prefix."""
    ordered = sorted(renames, key=lambda pair: -len(pair[0]))

    def rename(name: str) -> str:
        for old, new in ordered:
            if name == old or name.startswith(old + "."):
                return new + name[len(old):]
        return name
    return rename


def _renamed(op: Op, rename) -> Op:
    return replace(op, module_path=rename(op.module_path),
                   sources=tuple(replace(r, name=rename(r.name)) if r.kind in ("param", "buffer") else r
                                 for r in op.sources))


def _prefix_pair(a: str, b: str) -> tuple[str, str] | None:
    """The differing prefixes of two dotted names with a common suffix ("layers.0.mlp",
    "layers.2.mlp" -> ("layers.0", "layers.2")); None if equal."""
    pa, pb = a.split(".") if a else [], b.split(".") if b else []
    while pa and pb and pa[-1] == pb[-1]:
        pa, pb = pa[:-1], pb[:-1]
    if not pa and not pb:
        return None
    return ".".join(pa), ".".join(pb)


def _name_pairs(op: Op) -> list[str]:
    return [op.module_path] + [r.name for r in op.sources if r.kind in ("param", "buffer")]


def _renames(template: tuple[Op, ...], copy: tuple[Op, ...]) -> tuple[tuple[str, str], ...] | None:
    """Prefix renames that turn the template's names into the copy's; None if none exist."""
    pairs: dict[str, str] = {}
    for t, c in zip(template, copy):
        for a, b in zip(_name_pairs(t), _name_pairs(c)):
            pair = _prefix_pair(a, b)
            if pair is not None and pairs.setdefault(pair[0], pair[1]) != pair[1]:
                return None
    renames = tuple(sorted(pairs.items()))
    rename = _renamer(renames)
    if any([rename(n) for n in _name_pairs(t)] != _name_pairs(c) for t, c in zip(template, copy)):
        return None
    return renames


def _decode(r: Ref, occ: Occurrence, prev_start: int | None, entry: Ref | None) -> Ref:
    if r.kind == "local":
        return Ref("op", occ.start + r.index, r.slot)
    if r.kind == "prev":
        return entry if occ.first_in_run else Ref("op", prev_start + r.index, r.slot)
    return r


# -- detection ---------------------------------------------------------------------------------

def _labels(ops: tuple[Op, ...]) -> np.ndarray:
    ids: dict[tuple, int] = {}
    return np.array([ids.setdefault(op.signature(), len(ids)) for op in ops], dtype=np.int64)


def _candidates(labels: np.ndarray, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """(start, period, span) of every maximal label tandem repeat in [lo, hi), largest first.

    ``span`` is the number of ops from ``start`` on that repeat with this period."""
    found = []
    seg = labels[lo:hi]
    n = hi - lo
    for period in range(MIN_BLOCK_OPS, n // 2 + 1):
        eq = np.concatenate(([False], seg[:-period] == seg[period:], [False]))
        edges = np.flatnonzero(np.diff(eq.astype(np.int8)))
        for start, end in zip(edges[::2], edges[1::2]):
            span = int(end - start) + period
            if span >= 2 * period and span - period >= MIN_OPS_SAVED:
                found.append((lo + int(start), period, span))
    found.sort(key=lambda c: (-(c[2] // c[1]) * c[1], c[1], c[0]))
    return found


def _code(op: Op, start: int, period: int, run_start: int, first: bool) -> tuple:
    """An occurrence's input pattern, translation-invariant; None marks an edge that breaks it."""
    code = []
    for r in op.sources:
        if r.kind != "op":
            code.append((r.kind, r.index))   # state tensors match by shape (in the signature)
        elif r.index >= start:
            code.append(("local", r.index - start, r.slot))
        elif not first and r.index >= start - period:
            code.append(("prev", r.index - (start - period), r.slot))
        elif r.index < run_start:
            code.append(("ext", r.index, r.slot))
        else:
            return None
    return tuple(code)


def _verified_repeats(ops: tuple[Op, ...], start: int, period: int, repeats: int) -> tuple[int, int]:
    """How many leading occurrences of the candidate really share one edge pattern, and how many
    tensors each occurrence takes from its predecessor (the cut between two occurrences)."""
    def pattern(k: int) -> list | None:
        s = start + k * period
        codes = [_code(ops[s + j], s, period, start, k == 0) for j in range(period)]
        return None if any(c is None for c in codes) else codes

    first, second = pattern(0), pattern(1) if repeats > 1 else None
    if first is None or second is None or not _entry_compatible(first, second):
        return 1, 0
    k = 2
    while k < repeats and pattern(k) == second:
        k += 1
    carried = {x[1:] for code in second for x in code if x[0] == "prev"}
    return k, len(carried)


def _entry_compatible(first: list, later: list) -> bool:
    """Occurrence 0 matches a later one except where the later reads its predecessor ("prev"),
    which occurrence 0 reads from before the run ("ext")."""
    for a, b in zip(first, later):
        if len(a) != len(b):
            return False
        for x, y in zip(a, b):
            if x != y and not (y[0] == "prev" and x[0] == "ext"):
                return False
    return True


def _best_run(ops, labels, lo, hi) -> tuple[int, int, int] | None:
    """The verified run covering most ops, shortest period first; among a run's phases (where a
    copy starts), the one carrying fewest tensors across copies wins, then the one whose ops share
    the deepest module scope (module boundaries are a hint, never a requirement), then the earliest."""
    best, best_key = None, None
    for start, period, span in _candidates(labels, lo, hi):
        if best_key is not None and (-(span // period) * period, period) > best_key[:2]:
            break   # candidates are sorted by this bound: none left can win
        for phase in range(min(period, span - 2 * period + 1)):
            k, carried = _verified_repeats(ops, start + phase, period, (span - phase) // period)
            if k < 2 or (k - 1) * period < MIN_OPS_SAVED:
                continue
            depth = len(common_scope(ops[start + phase:start + phase + period]).split("."))
            key = (-k * period, period, carried, -depth, start + phase)
            if best_key is None or key < best_key:
                best, best_key = (start + phase, period, k), key
    return best


def _find_runs(ops, labels, lo, hi, out: list) -> None:
    if hi - lo < 2 * MIN_BLOCK_OPS:
        return
    run = _best_run(ops, labels, lo, hi)
    if run is None:
        return
    start, period, repeats = run
    _find_runs(ops, labels, lo, start, out)
    out.append(run)
    _find_runs(ops, labels, start + period * repeats, hi, out)


# -- assembly ----------------------------------------------------------------------------------

def common_scope(ops) -> str:
    """Longest common dotted prefix of the ops' module paths."""
    parts = [op.module_path.split(".") if op.module_path else [] for op in ops]
    common = []
    for names in zip(*parts):
        if len(set(names)) != 1:
            break
        common.append(names[0])
    return ".".join(common)


def _template(ops: tuple[Op, ...], start: int, period: int) -> tuple[Op, ...] | None:
    """A run's template: its second copy with inputs coded ``local`` / ``prev`` (the second copy
    shows which inputs are carried from the predecessor), renamed to the first copy's names."""
    second = start + period
    out = []
    for j in range(period):
        op = ops[second + j]
        sources = []
        for r in op.sources:
            if r.kind == "op" and r.index >= second:
                sources.append(Ref("local", r.index - second, r.slot))
            elif r.kind == "op" and r.index >= start:
                sources.append(Ref("prev", r.index - start, r.slot))
            else:
                sources.append(r)
        out.append(replace(op, index=j, sources=tuple(sources)))
    back = _renames(tuple(out), ops[start:second])
    if back is None:
        return None
    rename = _renamer(back)
    return tuple(_renamed(op, rename) for op in out)


def _occurrences(ops, template, start, period, repeats) -> list[Occurrence] | None:
    occs = []
    for k in range(repeats):
        s = start + k * period
        copy = ops[s:s + period]
        renames = _renames(template, copy)
        if renames is None:
            return None
        entry = () if k else tuple(
            (j, t, copy[j].sources[t].index, copy[j].sources[t].slot)
            for j, op in enumerate(template) for t, r in enumerate(op.sources) if r.kind == "prev")
        saved = tuple((j, c.saved_bytes) for j, (t, c) in enumerate(zip(template, copy))
                      if c.saved_bytes != t.saved_bytes)
        occs.append(Occurrence(s, common_scope(copy), k == 0, renames, entry, saved))
    return occs


def fold(graph: OpGraph) -> FoldedGraph:
    """Fold ``graph``'s repeated substructures; ``FoldedGraph.unfold()`` gives the ops back."""
    ops = graph.ops
    runs: list[tuple[int, int, int]] = []
    _find_runs(ops, _labels(ops), 0, len(ops), runs)

    groups: dict[tuple, tuple[tuple[Op, ...], list[Occurrence]]] = {}
    covered = np.zeros(len(ops), dtype=bool)
    for start, period, repeats in runs:
        tmpl = _template(ops, start, period)
        # same ops, same wiring inside, same external producers (shared inputs): the same block
        key = None if tmpl is None else tuple(
            (t.signature(), tuple((r.kind, r.index, r.slot) for r in t.sources if r.kind in ("local", "prev", "op")))
            for t in tmpl)
        if key in groups:
            tmpl = groups[key][0]           # later runs of a known block reuse its template's names
        occs = None if tmpl is None else _occurrences(ops, tmpl, start, period, repeats)
        if occs is None:
            continue                        # names do not map copy to copy: leave the ops unfolded
        groups.setdefault(key, (tmpl, []))[1].extend(occs)
        covered[start:start + period * repeats] = True

    blocks = [Block(block_name([o.scope for o in occs], tmpl, i), tmpl, tuple(occs))
              for i, (tmpl, occs) in enumerate(groups.values())]
    blocks.sort(key=lambda b: b.positions[0])
    loose = tuple(op for op in ops if not covered[op.index])
    return FoldedGraph(graph.name, len(ops), distinct_names(blocks, ops), loose)
