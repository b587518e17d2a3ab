"""Block names that find a block's copies among a model's modules (plan.json's ``blocks[].block``).

A folded block is named by a module-path pattern, ``layers.*``: its copies are the modules at the pattern's depth
that it matches, in model order. A model whose first layers differ from the rest (DeepSeek-V3's three dense layers
before 58 MoE ones, Qwen3-MoE's ``mlp_only_layers``) folds into two blocks of one pattern; each is then named by the
pattern and the copies it holds among those the pattern matches, as slices: ``model.layers.*[0:3]`` and
``model.layers.*[3:61]``, or ``layers.*[0:2,5:7]`` for copies apart. Module names cannot hold ``[``, so the suffix
never reads as part of a name. Copies with unrelated names (``self.alpha``, ``self.beta``, ...) are named by their
first and last, ``alpha..delta``: the modules at that depth from the one to the other (a module name has no empty
part, so ``..`` never reads as one). The fold (``graph.fold``) writes these names from the captured graph's module
paths, the runtime (``runtime.blocks``) reads them against the model's modules; both match patterns here, so they agree.

No torch here: the planner names blocks from a cached graph without importing it.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Sequence

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


__all__ = ["in_range", "matching", "picked", "sliced", "split_name"]
