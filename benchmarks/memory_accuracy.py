"""Is the analytic memory model an upper bound of what the engines hold? (issue 19 part 5)

For every plan family the providers below offer, the cost model's predicted peak tensor memory
(``tensoropt.cost.model.estimate`` less the profile's ``runtime_overhead_bytes``, the CUDA context, libraries
and fragmentation that no tensor count sees) is compared with the peak tensor bytes of the same plan, simulated on
fake tensors (``tensoropt.runtime.memory.check.simulate``) or measured in a real CPU run
(``TENSOROPT_MEMORY_OUT``). Target, every row: 0 <= predicted / actual - 1 <= 0.05.

Providers (each ``rows(quick=False) -> list[dict]``, imported when present, so this runs with any of them):
``_memory_torch`` (DDP, FSDP2 ZeRO 1-3, TP with and without SP, recomputation, precisions),
``_memory_deepspeed`` (DeepSpeed ZeRO 0-3 and offload), ``_memory_pipeline`` (a pipeline stage in 1F1B).

    python benchmarks/memory_accuracy.py [--quick [PROVIDER ...]] [--simulate PROVIDER ...] [--family NAME] [--check]

Providers whose peaks are stored (``_memory_torch``: results/memory_torch.json; ``_memory_deepspeed``:
results/memory_deepspeed.json) re-price them with the current cost model, in a minute or two: the peaks depend on
the runtime, not on the prices. ``--simulate PROVIDER ...`` simulates (or measures) those providers' rows again
and stores them: after a change to the runtime. ``--check`` exits non-zero when a row misses the target;
``--quick`` runs each provider's small cases (~2 min for the torch rows). Results: ``results/memory_accuracy.json``
and ``.md`` (not written for ``--family``).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import memory_error as error  # noqa: E402
from _common import write_results  # noqa: E402

PROVIDERS = ("_memory_torch", "_memory_deepspeed", "_memory_pipeline", "_memory_recipes")
UPPER = 0.05                   # at most 5% above; never below


def providers() -> dict[str, Callable]:
    """{module name: its ``rows``} of the providers that exist."""
    out = {}
    for name in PROVIDERS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        out[name] = module.rows
    return out


def meets(row: dict) -> bool:
    return 0 <= error(row) <= UPPER


def collect(quick: bool | set[str], family: str | None, fresh: frozenset[str] = frozenset()) -> list[dict]:
    """Every provider's rows; ``quick``: all providers' small cases, or the set of providers to run small;
    ``fresh``: the providers whose stored simulations or measurements are made again (``rows(simulate=True)`` or
    ``rows(measure=True)``) rather than re-priced."""
    rows = []
    for name, rows_of in providers().items():
        kwargs = {"quick": quick is True or (isinstance(quick, set) and name in quick)}
        accepts = inspect.signature(rows_of).parameters
        if family and "family" in accepts:
            kwargs["family"] = family                         # a provider that can skip the other families' runs
        if name in fresh:
            kwargs |= {flag: True for flag in ("simulate", "measure") if flag in accepts}
        print(f"{name}:", file=sys.stderr, flush=True)
        rows += [r for r in rows_of(**kwargs) if not family or r["family"] == family]
    return rows


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def table(rows: list[dict]) -> str:
    """One markdown table per family."""
    out = []
    for family in dict.fromkeys(r["family"] for r in rows):
        out += [f"### {family}", "",
                "| model | plan | precision | how | predicted GiB | actual GiB | predicted / actual - 1 | target |",
                "|---|---|---|---|---:|---:|---:|---|"]
        for r in (r for r in rows if r["family"] == family):
            out.append(f"| {r['model']} | {r['plan']} | {r['precision']} | {r['how']} | "
                       f"{_gib(r['predicted_tensor_bytes'])} | {_gib(r['actual_bytes'])} | {error(r):+.1%} | "
                       f"{'met' if meets(r) else 'MISSED'} |")
        out.append("")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", nargs="*", metavar="PROVIDER",
                        help="small cases: of every provider, or of the providers named (e.g. _memory_pipeline)")
    parser.add_argument("--family", help="only this family's rows (results not written)")
    parser.add_argument("--simulate", nargs="+", default=[], metavar="PROVIDER",
                        help="simulate (or measure) these providers' rows again instead of re-pricing their stored "
                             "peaks (results/memory_torch.json, memory_deepspeed.json); needed after a runtime change")
    parser.add_argument("--check", action="store_true", help="exit non-zero when a row misses the target")
    args = parser.parse_args()
    unknown = (set(args.quick or ()) | set(args.simulate)) - set(PROVIDERS)
    if unknown:
        raise SystemExit(f"memory_accuracy: --quick/--simulate name no provider {sorted(unknown)}: use "
                         f"{', '.join(PROVIDERS)}")
    quick = True if args.quick == [] else set(args.quick or ())
    rows = collect(quick, args.family, frozenset(args.simulate))
    text = table(rows)
    print(text)
    missed = [r for r in rows if not meets(r)]
    print(f"{len(rows) - len(missed)} of {len(rows)} rows within 0 .. +{UPPER:.0%}")
    if not args.family:
        notes = ("predicted: `tensoropt.cost.model.estimate` of the plan less the profile's runtime_overhead_bytes "
                 "(tensors only); actual: the tracker's peak tensor bytes (rank 0 unless a row says otherwise). "
                 f"Target: 0 <= predicted / actual - 1 <= {UPPER:.0%} for every row.\n")
        write_results("memory_accuracy" + ("_quick" if quick is True else ""), rows, text, notes,
                      {"target": {"lower": 0.0, "upper": UPPER},
                       "quick": True if quick is True else sorted(quick)})
    if args.check and missed:
        raise SystemExit(f"memory_accuracy: {len(missed)} row(s) miss the target: "
                         + ", ".join(f"{r['family']} {r['plan']} {error(r):+.1%}" for r in missed))


if __name__ == "__main__":
    main()
