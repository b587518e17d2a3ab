"""Leave-one-source-out validation of the constants ``public_h100.py`` fits (issue 35): the prices a source's rows get
from constants fitted on every *other* source, the figure that says how the prices hold on runs they were not
fitted to.

What is fitted, on the same grid for every fit: the matmul-efficiency curve of each H100 profile scaled by one factor
(h100-80gb: Megatron-LM's and fms-fsdp's rows; h100-96gb-500w: torchtitan's), and the memory-bound kernels' share of
HBM bandwidth (``memory_efficiency``, shared by both profiles): the three numbers the committed profiles were chosen
with, on all public rows at once. A fit picks the grid point with the least sum of |log(predicted / measured)| over
its rows (a median-like loss: one far row does not drag the rest). A profile none of the fitting rows ran on keeps
its committed curve (factor 1), and the table says so. A row on a profile the fits are not given (``names``) never
enters a fit: it is priced on that profile as committed. Sources named ``never_fitted``
(this project's own runs; ``public_h100.py`` says which) are validation only: their held-out prices are those of the
fit on every other source.

Each row is priced once per (curve factor, memory efficiency) of its own profile: ~190 prices a row, on a grid of
0.025 in the factor and 0.05 in memory efficiency (at 0.05 and 0.1 a held-out fit hinged on where the grid points fell
relative to the committed curve: Megatron's held-out median moved by 2 points when the committed curve it is relative
to moved by 0.1); the fits are then sums over a table."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable

CURVE_FACTORS = tuple(round(0.75 + 0.025 * i, 3) for i in range(21))    # 0.75 .. 1.25 x the committed matmul curve
MEMORY_EFFICIENCIES = tuple(round(0.4 + 0.05 * i, 2) for i in range(9))   # 0.4 .. 0.8


def varied(profile, factor: float, memory_efficiency: float):
    """``profile`` with its matmul curve scaled by ``factor`` (capped at the peak) and ``memory_efficiency``."""
    curve = tuple((flops, min(1.0, e * factor)) for flops, e in profile.matmul_efficiency)
    return dataclasses.replace(profile, matmul_efficiency=curve, memory_efficiency=memory_efficiency)


def error_table(rows: list[dict], priced: Callable[[dict, object], float], profiles: dict[str, object],
                profile_of: Callable[[dict], str], names: tuple[str, ...] | None = None
                ) -> list[dict[tuple[float, float], float]]:
    """For each row, {(curve factor, memory efficiency): predicted / measured - 1} on its own profile's variants, and
    under ``"committed"`` on the profile as committed; ``priced(row, profile)`` gives the relative error of one row on
    one profile. Rows on a profile outside ``names`` (the fitted ones; None: all) are priced as committed only: no
    fit reads their variants."""
    return [({(f, m): priced(row, varied(profiles[profile_of(row)], f, m))
              for f in CURVE_FACTORS for m in MEMORY_EFFICIENCIES}
             if names is None or profile_of(row) in names else {})
            | {"committed": priced(row, profiles[profile_of(row)])} for row in rows]


def fit(indices: list[int], table: list[dict], profile_of_row: list[str], names: tuple[str, ...]) -> dict:
    """The grid point (a factor per profile, one memory efficiency) with the least sum of |log(1 + error)| over the
    rows ``indices``; a profile without rows there keeps factor 1.0 (``"unfitted"`` names it)."""
    best = None
    for m in MEMORY_EFFICIENCIES:
        factors, loss = {}, 0.0
        for name in names:          # the profiles' factors are independent once m is fixed
            mine = [i for i in indices if profile_of_row[i] == name]
            if not mine:
                factors[name] = 1.0
                continue
            cost = {f: sum(abs(math.log1p(table[i][f, m])) for i in mine) for f in CURVE_FACTORS}
            factors[name] = min(cost, key=cost.get)
            loss += cost[factors[name]]
        if best is None or loss < best[0]:
            best = (loss, m, factors)
    _, m, factors = best
    unfitted = [n for n in names if not any(profile_of_row[i] == n for i in indices)]
    return {"memory_efficiency": m, "curve_factors": factors, "unfitted": unfitted}


def error_at(i: int, table: list[dict], profile_of_row: list[str], constants: dict) -> float:
    """Row ``i``'s error at ``constants``; a row on a profile the fits are not given, on that profile as committed."""
    if profile_of_row[i] not in constants["curve_factors"]:
        return table[i]["committed"]
    return table[i][constants["curve_factors"][profile_of_row[i]], constants["memory_efficiency"]]


def leave_one_source_out(rows: list[dict], table: list[dict], profile_of_row: list[str], names: tuple[str, ...],
                         never_fitted: tuple[str, ...]) -> tuple[dict, list[dict]]:
    """(the fit on every source but those ``never_fitted``, and for each source its rows' errors priced with constants
    fitted on the other sources)."""
    public = [i for i, r in enumerate(rows) if r["source"] not in never_fitted]
    on_all = fit(public, table, profile_of_row, names)
    held = []
    for source in dict.fromkeys(r["source"] for r in rows):
        others = [i for i in public if rows[i]["source"] != source]
        constants = fit(others, table, profile_of_row, names)
        for i, row in enumerate(rows):
            if row["source"] == source:
                held.append({"source": source, "group": row["group"], "model": row["model"], "gpus": row["gpus"],
                             "family": row["family"], "fitted_error": error_at(i, table, profile_of_row, on_all),
                             "held_out_error": error_at(i, table, profile_of_row, constants),
                             "constants": constants})
    return on_all, held


def family_figures(held: list[dict], families: dict[str, Callable[[dict], bool]]) -> dict[str, dict]:
    """Per family: rows, and the median |error| and median signed error fitted (all sources) and held out."""
    out = {}
    for name, member in families.items():
        rows = [r for r in held if member(r)]
        if rows:
            out[name] = {"rows": len(rows)} | {
                f"{kind}_{stat}": fn(r[f"{kind}_error"] for r in rows)
                for kind in ("fitted", "held_out")
                for stat, fn in (("median_abs", lambda es: statistics.median(abs(e) for e in es)),
                                 ("median_signed", lambda es: statistics.median(list(es))))}
    return out


def table_lines(on_all: dict, held: list[dict], figures: dict[str, dict]) -> list[str]:
    """The Markdown section: the families' fitted and held-out errors, then each source's held-out constants."""
    names = list(on_all["curve_factors"])
    lines = ["", "Leave-one-source-out (`benchmarks/_loso.py`): each source priced with constants fitted on the "
             "other sources (the held-out figure counts), beside the fit on all public sources ("
             + ", ".join(f"{n} curve x{on_all['curve_factors'][n]}" for n in names)
             + f", memory_efficiency {on_all['memory_efficiency']}; factors relative to the committed profiles):", "",
             "| family | rows | fitted median abs | fitted median signed | held-out median abs | "
             "held-out median signed |", "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {n} | {f['rows']} | {f['fitted_median_abs']:.1%} | {f['fitted_median_signed']:+.1%} | "
              f"{f['held_out_median_abs']:.1%} | {f['held_out_median_signed']:+.1%} |" for n, f in figures.items()]
    lines += ["", "| source held out | rows | fitted on the others: " + " | ".join(f"{n} curve x" for n in names)
              + " | memory_efficiency | its rows' held-out errors |",
              "|---|---:|" + "---:|" * (len(names) + 1) + "---|"]
    for source in dict.fromkeys(r["source"] for r in held):
        mine = [r for r in held if r["source"] == source]
        c = mine[0]["constants"]
        factor = {n: f"{v}" + (" (no rows: committed)" if n in c["unfitted"] else "")
                  for n, v in c["curve_factors"].items()}
        lines.append(f"| {source} | {len(mine)} | " + " | ".join(factor[n] for n in names)
                     + f" | {c['memory_efficiency']} | " + ", ".join(f"{r['held_out_error']:+.1%}" for r in mine)
                     + " |")
    return lines


__all__ = ["error_table", "family_figures", "fit", "leave_one_source_out", "table_lines", "varied"]
