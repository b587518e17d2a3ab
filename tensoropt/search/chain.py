"""Chains of a block's copies for frontier tracking (search/ft.py): the Pareto sets of k consecutive copies.

Split from ``search.ft`` (which enumerates the global choices and prices the candidates); see ``Chain``.
"""

from __future__ import annotations

import numpy as np

from ..cost.layer import BlockCost
from ..space.plan import LayerStrategy
from .pareto import ParetoSet, ParetoSets, combine_sets, union_sets

Key = tuple[int, int, tuple[str, ...], int, int, int]  # a chain's (tp, copies per group, branches, micro-batch, cp, ep)


def _layer_sets(cost: BlockCost, options: list[LayerStrategy], keys: list[Key], rows: list[list[int]]) -> ParetoSets:
    """One step of the chains: a group of consecutive copies running one strategy (for each key, one of the
    ``options`` listed in its ``rows``), one Pareto set per key; layout changes are added when a chain is closed."""
    values = [[size * c.time_s, size * c.activation_bytes, c.transient_bytes]
              for (tp, size, branches, micro_batch, cp, ep), mine in zip(keys, rows)
              for c in (cost.layer(options[i], tp, branches, micro_batch, cp, ep) for i in mine)]
    eye = np.eye(len(options), dtype=np.int64)
    counts = np.concatenate([size * eye[mine] for (_, size, *_), mine in zip(keys, rows)])
    group = np.repeat(np.arange(len(keys)), [len(mine) for mine in rows])
    return ParetoSets.of(np.array(values, dtype=float).reshape(-1, 3), counts, group, len(keys))


class Chain:
    """Pareto sets of k consecutive copies of one block, entered and left with a replicated stream, for every
    (tp, copies per group, branches, micro-batch, cp, ep) key the search needs at once: one set per key, all held in one
    ``ParetoSets``, so each step below is one numpy pass over every key.

    Times, kept activations and parameters add over a chain's copies and the transient takes their max, whatever
    their order; only the layout changes depend on it, and a chain with sequence-parallel copies pays exactly two
    of them (in and out) when those copies run together, the fewest any order pays (``space.plan.chain_order``
    runs them so). So the k-copy set is the multisets of k strategies: those without sequence parallelism
    (``plain``) as they are, the others (``any``, restricted to the sums holding a sequence-parallel copy) plus two
    changes. Each of the two is a single Pareto set per key, composed by repeated doubling: powers 2^i are kept, so
    every pipeline depth (k = copies / pp) costs only the sums its binary digits need; each key is carried only as
    far as the chain lengths it is needed for (``needs``: key -> the (k, chains) asked of it). A product of two sets
    is one Minkowski sum, where a matrix over the stream's layouts (the DP's states) took eight.

    The counts (provenance) have a column per strategy of ``options`` (every tp's options of the block);
    ``set`` gives a key's set with its tp's columns only."""

    def __init__(self, cost: BlockCost, options: dict[int, list[LayerStrategy]], needs: dict[Key, set[tuple[int, int]]],
                 eps: float = 0.0) -> None:
        self.eps, self.index = eps, {key: g for g, key in enumerate(needs)}
        self.options = list(dict.fromkeys(o for tp in sorted(options) for o in options[tp]))
        self.columns = {tp: [self.options.index(o) for o in opts] for tp, opts in options.items()}
        self.needs = list(needs.values())
        keys = list(needs)
        self.change = np.array([cost.layout_change_s(tp, mb) for tp, _, _, mb, *_ in keys], dtype=float)
        self.split = np.array([o.sequence_parallel for o in self.options])       # the strategies' columns
        rows = [self.columns[tp] for tp, *_ in keys]
        plain = [[i for i in mine if not self.split[i]] for mine in rows]
        self.has_split = np.array([len(p) < len(r) for p, r in zip(plain, rows)])
        self.powers = {"any": [_layer_sets(cost, self.options, keys, rows)]}
        if self.has_split.any():
            self.powers["plain"] = [_layer_sets(cost, self.options, keys, plain)]
        self._copies: dict[tuple[int, bool], ParetoSets] = {}            # (k, doubling): every key asking k
        self._devices: dict[tuple[int, int, bool], ParetoSets] = {}      # (k, chains, doubling)
        self._sets: dict[tuple, ParetoSet] = {}                           # (key, k, chains, doubling)
        self._pairs: dict[tuple[int, bool], ParetoSets] = {}              # (k, doubling): two chains of k

    def _power(self, kind: str, i: int) -> ParetoSets:
        powers = self.powers[kind]
        while len(powers) <= i:
            wanted = np.array([max(k for k, _ in ks).bit_length() > len(powers) for ks in self.needs])
            half = _restrict(powers[-1], wanted & (self.has_split if kind == "plain" else True))
            powers.append(combine_sets([(half, half)], self.eps))
        return powers[i]

    def _multisets(self, kind: str, k: int, wanted: np.ndarray, doubling: bool) -> ParetoSets:
        """The sets of k copies' strategies drawn from ``kind`` (wanted keys only)."""
        result = None
        for i in range(k.bit_length()) if doubling else range(k):
            if doubling and not k >> i & 1:
                continue
            step = _restrict(self._power(kind, i if doubling else 0), wanted)
            result = step if result is None else combine_sets([(result, step)], self.eps)
        return result

    def copies(self, k: int, doubling: bool = True) -> ParetoSets:
        """The sets of k copies (only the keys that asked for k are filled)."""
        if (k, doubling) not in self._copies:
            wanted = np.array([any(n == k for n, _ in ks) for ks in self.needs])
            every = self._multisets("any", k, wanted, doubling)
            if "plain" in self.powers and (wanted & self.has_split).any():
                holds = (every.counts[:, self.split] > 0).any(axis=1)
                rows = holds | ~self.has_split[every.group]       # the plain sums of a split key come from plain
                values = every.values[rows]
                values[:, 0] += np.where(holds[rows], 2 * self.change[every.group[rows]], 0.0)
                every = union_sets([ParetoSets(values, every.counts[rows], every.group[rows], every.size),
                                    self._multisets("plain", k, wanted & self.has_split, doubling)], self.eps)
            self._copies[(k, doubling)] = every
        return self._copies[(k, doubling)]

    def device(self, k: int, chains: int, doubling: bool = True) -> ParetoSets:
        """The sets of ``chains`` chains of k copies run one after another (a device's virtual stages, see
        ``device_split``): Minkowski sums of the k-copy sets, every key asking for them at once."""
        if (k, chains, doubling) not in self._devices:
            wanted = np.array([(k, chains) in ks for ks in self.needs])
            one = _restrict(self.copies(k, doubling), wanted)
            if chains == 1:
                total = one
            elif chains <= 4:           # 2, 3 and 4 chains of k all start from one sum of two, made once
                two = _restrict(self._pair(k, doubling), wanted)
                total = two if chains == 2 else combine_sets([(two, one if chains == 3 else two)], self.eps)
            else:
                total = _chains_sum(one, chains, self.eps)
            self._devices[(k, chains, doubling)] = total
        return self._devices[(k, chains, doubling)]

    def _pair(self, k: int, doubling: bool) -> ParetoSets:
        """Two chains of k copies, for every key asking for 2 to 4 of them (the sums are per key, so a key's set is
        the one it would get alone)."""
        if (k, doubling) not in self._pairs:
            wanted = np.array([any(n == k and 2 <= c <= 4 for n, c in ks) for ks in self.needs])
            one = _restrict(self.copies(k, doubling), wanted)
            self._pairs[(k, doubling)] = combine_sets([(one, one)], self.eps)
        return self._pairs[(k, doubling)]

    def set(self, key: Key, k: int, chains: int = 1, doubling: bool = True) -> ParetoSet:
        """The set of ``chains`` chains of k copies for ``key``, its counts in the key's tp's strategies."""
        if (key, k, chains, doubling) not in self._sets:
            found = self.device(k, chains, doubling).set(self.index[key])
            self._sets[(key, k, chains, doubling)] = ParetoSet(found.values, found.counts[:, self.columns[key[0]]])
        return self._sets[(key, k, chains, doubling)]


def _chains_sum(one: ParetoSets, chains: int, eps: float) -> ParetoSets:
    """``chains`` copies of ``one`` summed, one at a time (more virtual stages than doubling covers)."""
    total = one
    for _ in range(chains - 1):
        total = combine_sets([(total, one)], eps)
    return total


def _restrict(sets: ParetoSets, wanted: np.ndarray) -> ParetoSets:
    """The sets of the wanted keys only (the others empty)."""
    if wanted.all():
        return sets
    rows = wanted[sets.group]
    return ParetoSets(sets.values[rows], sets.counts[rows], sets.group[rows], sets.size)


__all__ = ["Chain", "Key"]
