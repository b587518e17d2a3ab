"""Block names that find a block's copies among a model's modules (plan.json's ``blocks[].block``).

A folded block is named by a module-path pattern, ``layers.*``: its copies are the modules at the pattern's depth
that it matches, in model order. A model whose first layers differ from the rest (DeepSeek-V3's three dense layers
before 58 MoE ones, Qwen3-MoE's ``mlp_only_layers``) folds into two blocks of one pattern; each is then named by the
pattern and the copies it holds among those the pattern matches, as slices: ``model.layers.*[0:3]`` and
``model.layers.*[3:61]``, or ``layers.*[0:2,5:7]`` for copies apart. Module names cannot hold ``[``, so the suffix
never reads as part of a name. Copies with unrelated names (``self.alpha``, ``self.beta``, ...) are named by their
first and last, ``alpha..delta``: the modules at that depth from the one to the other (a module name has no empty
part, so ``..`` never reads as one). The fold (``graph.fold``) names its blocks here (``block_name``,
``distinct_names``) from the captured graph's module paths, the runtime (``runtime.blocks``) reads the names against
the model's modules; both match patterns here, so they agree.

No torch here: the planner names blocks from a cached graph without importing it.
"""

from __future__ import annotations

import fnmatch
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .fold import Block
    from .ir import Op

_SLICED = re.compile(r"(?P<pattern>.*)\[(?P<spans>\d+:\d+(?:,\d+:\d+)*)\]")


def matching(names: Iterable[str], pattern: str) -> list[str]:
    """The names ``pattern`` matches at its own depth (``layers.*`` matches layers.0, not layers.0.mlp), each once,
    in the order given."""
    depth = pattern.count(".")
    found = (n for n in names if n.count(".") == depth and fnmatch.fnmatchcase(n, pattern))
    return list(dict.fromkeys(found))


def sliced(pattern: str, picks: Sequence[int]) -> str:
    """The name of the copies at indices ``picks`` (increasing) of those ``pattern`` matches: runs of consecutive
    indices as ``start:stop`` slices, ``layers.*[0:2,5:7]``."""
    spans: list[list[int]] = []
    for i in picks:
        if spans and spans[-1][1] == i:
            spans[-1][1] = i + 1
        else:
            spans.append([i, i + 1])
    return f"{pattern}[{','.join(f'{a}:{b}' for a, b in spans)}]"


def split_name(name: str) -> tuple[str, tuple[int, ...] | None]:
    """(pattern, the indices of the copies ``name`` picks among those the pattern matches); None: all of them.
    A ``ValueError`` for slices that are empty, overlap or go backwards (a hand-edited name)."""
    found = _SLICED.fullmatch(name)
    if found is None:
        return name, None
    picks: list[int] = []
    for span in found["spans"].split(","):
        start, stop = map(int, span.split(":"))
        if start >= stop or (picks and start <= picks[-1]):
            raise ValueError(f"block {name!r}: slice {span} is empty or not after the one before it")
        picks.extend(range(start, stop))
    return found["pattern"], tuple(picks)


def in_range(names: Iterable[str], name: str) -> list[str] | None:
    """The copies of a block named ``first..last`` (copies with unrelated names, ``alpha..delta``): the modules at
    ``first``'s depth from ``first`` to ``last`` in model order; None for a name of another form. A ``ValueError``
    when ``first`` or ``last`` is not among ``names`` in that order (the name was made for another model)."""
    first, dots, last = name.partition("..")
    if not dots or not first or not last or any(c in name for c in "*[#") or first.count(".") != last.count("."):
        return None
    depth = first.count(".")
    level = list(dict.fromkeys(n for n in names if n.count(".") == depth))
    if first not in level or last not in level or level.index(last) < level.index(first):
        raise ValueError(f"block {name!r}: no modules {first!r} to {last!r} in this model, in that order: the name "
                         "was made for another model")
    return level[level.index(first):level.index(last) + 1]


def picked(names: Iterable[str], name: str) -> list[str]:
    """The names of the copies block ``name`` holds among ``names`` (a model's modules, in model order): a pattern's
    matches, a slice of them, or a ``first..last`` range. A ``ValueError`` when it picks more copies than the pattern
    matches (the name was made for another model)."""
    names = list(names)
    ranged = in_range(names, name)
    if ranged is not None:
        return ranged
    pattern, picks = split_name(name)
    matched = matching(names, pattern)
    if picks is None:
        return matched
    if picks and picks[-1] >= len(matched):
        raise ValueError(f"block {name!r} picks copy {picks[-1]} of {pattern!r}, which matches {len(matched)} "
                         "modules here: the name was made for another model")
    return [matched[i] for i in picks]


def block_name(scopes: list[str], first_copy: tuple[Op, ...], index: int) -> str:
    """``layers.*`` for one layer per copy, ``alpha..delta`` for copies with unrelated names,
    ``layers.{0,1}`` for copies spanning two children of one scope, else ``block<i>``."""
    parts = [s.split(".") for s in scopes]
    if all(scopes) and len({len(p) for p in parts}) == 1:
        pattern = [names[0] if len(set(names)) == 1 else "*" for names in zip(*parts)]
        if any(c != "*" for c in pattern) and "*" in pattern:
            return ".".join(pattern)
        if "*" in pattern:
            return f"{scopes[0]}..{scopes[-1]}"
    scope = scopes[0]
    if scope and all(s == scope for s in scopes):
        depth = len(parts[0])
        children = sorted({op.module_path.split(".")[depth] for op in first_copy
                           if op.module_path.startswith(scope + ".")}, key=lambda c: (len(c), c))
        if len(children) > 1:
            return f"{scope}.{{{','.join(children)}}}"
    return f"block{index}"


def module_names(ops: Iterable[Op]) -> list[str]:
    """Every module the ops ran in, and each one's ancestors, once each in the order the forward first entered them:
    the graph's side of what the runtime reads from ``named_modules`` (``picked`` matches a name against either)."""
    paths = dict.fromkeys(op.module_path for op in ops if op.module_path)
    return list(dict.fromkeys(".".join(parts[:k]) for parts in (p.split(".") for p in paths)
                              for k in range(1, len(parts) + 1)))


def distinct_names(blocks: list[Block], ops: tuple[Op, ...]) -> tuple[Block, ...]:
    """The blocks, each name finding its own copies and no other module: everything keyed by block name (plans, the
    cost model, the runtime's copies) would take two blocks of one name for one, and the runtime would recompute or
    shard as the block's copies every module its pattern matches. A pattern whose matches are the block's copies
    stays as it is; a block whose pattern matches more (a model whose first layers differ from the rest: DeepSeek-V3's
    dense layers, then MoE ones; one odd layer outside any block) is named by the copies it holds among those the
    pattern matches, ``layers.*[1:4]`` (``graph.block_names``); a shared name that finds no copies (``block<i>``-like
    names, copies the pattern does not list in order) gets the block's rank among them, ``name#2``: distinct, though
    the runtime finds no copies by it, as by the name alone."""
    counts = Counter(b.name for b in blocks)
    seen: Counter = Counter()
    modules = module_names(ops)
    out = []
    for block in blocks:
        seen[block.name] += 1
        name = _sliced_name(block, modules) or _unfound_range(block, modules)
        if name is None and counts[block.name] > 1:
            name = f"{block.name}#{seen[block.name]}"
        out.append(replace(block, name=name) if name else block)
    return tuple(out)


def _sliced_name(block: Block, modules: list[str]) -> str | None:
    """``block``'s pattern and the slices of its copies among the graph's ``modules`` the pattern matches (at the
    pattern's depth, in the order the forward first enters them: the model's order, which the runtime reads from
    ``named_modules``); None where the pattern matches the copies and nothing else (the name finds them as it is),
    or where its copies' scopes are not such modules in increasing order."""
    scopes = matching(modules, block.name)
    index = {scope: i for i, scope in enumerate(scopes)}
    picks = [index.get(o.scope) for o in block.occurrences]
    if None in picks or any(b <= a for a, b in zip(picks, picks[1:])) or len(picks) == len(scopes):
        return None
    return sliced(block.name, picks)


def _unfound_range(block: Block, modules: list[str]) -> str | None:
    """For a block named ``first..last`` whose range of the graph's ``modules`` is not its copies (another module
    sits between two of them): ``name#1``, a name the runtime finds no copies by, rather than one that finds the
    wrong modules; None for any other block, or a range that is its copies."""
    try:
        ranged = in_range(modules, block.name)
    except ValueError:
        ranged = []
    if ranged is None or ranged == [o.scope for o in block.occurrences]:
        return None
    return f"{block.name}#1"


__all__ = ["block_name", "distinct_names", "in_range", "matching", "module_names", "picked", "sliced",
           "split_name"]
