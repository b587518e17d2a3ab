"""Command-line options and bounds shared by ``tensoropt``'s planning commands and ``tensoropt launch``.

A layer below both command lines: ``tensoropt.cli`` (the click group, which adds the launcher's ``launch`` command)
and ``launcher.cli`` each import this module, so neither imports the other's package and the launcher can be
imported on its own."""

from __future__ import annotations

import functools

import click

from .errors import TensorOptError
from .search.limits import GRAD_DTYPE_FLAGS, Limits
from .space.plan import RECOMPUTE

# sane upper bounds on counts: far above any cluster planned today (the largest have ~10^5 GPUs), far below what
# would make a search loop for minutes over divisors (``--gpus 1000000000`` did)
MAX_DEVICES = 2**17
MAX_DEVICES_PER_NODE = 1024
MAX_GLOBAL_BATCH = 2**24


def check_counts(**counts: int | None) -> None:
    """Counts given as ``global_batch=512, gpus_per_node=8, devices=1024`` (None: not given), each >= 1 and below
    its sane upper bound, else one line naming every flag out of range."""
    bounds = {"devices": ("--gpus", MAX_DEVICES), "gpus_per_node": ("--gpus-per-node", MAX_DEVICES_PER_NODE),
              "global_batch": ("--global-batch", MAX_GLOBAL_BATCH)}
    problems = [f"{bounds[name][0]} {value} must be between 1 and {bounds[name][1]:,}"
                for name, value in counts.items() if value is not None and not 1 <= value <= bounds[name][1]]
    if problems:
        raise TensorOptError("; ".join(problems))


def limit_options(func):
    """The limits on the search space shared by ``frontier`` and ``launch``: the command receives them as one
    ``limits`` argument (a ``Limits``; bad values are a one-line error, see ``parse_limits``)."""
    @functools.wraps(func)
    def command(*args, limit_tp, limit_max_tp, limit_pp, limit_cp, limit_ep, limit_zero, limit_recompute, no_offload,
                limit_grad_dtype, **kwargs):
        limits = parse_limits(limit_tp, limit_max_tp, limit_pp, limit_zero, limit_recompute, no_offload,
                              limit_grad_dtype, limit_cp, limit_ep)
        return func(*args, limits=limits, **kwargs)
    options = [
        ("--tp", "allowed tensor-parallel degrees, e.g. 1 (none) or 2,4"),
        ("--max-tp", "largest tensor-parallel degree allowed"),
        ("--pp", "allowed pipeline stage counts, e.g. 1 (none) or 2,4"),
        ("--cp", "context-parallel degrees to search (each sequence split over cp ranks, pp 1, the torch "
                 "engine), e.g. 1 (none) or 1,2,4; default: 1 and those leaving each rank >= 4096 tokens"),
        ("--ep", "expert-parallel degrees to search for a Mixture-of-Experts model (its experts sharded over ep of "
                 "the data-parallel ranks, pp 1, the torch engine), e.g. 1 (none) or 2,4; default: 1 and every "
                 "degree dividing the experts and dp"),
        ("--zero", "allowed ZeRO stages (0-3), e.g. 2,3"),
        ("--recompute", f"allowed recomputation strategies ({', '.join(RECOMPUTE)}), e.g. none"),
        ("--grad-dtype", "allowed dtypes of gradient accumulation and reduction (fp32, bf16), e.g. fp32: bf16 "
                         "gradients (bf16-mixed on FSDP2 ZeRO 1-3, DeepSpeed's bf16 mode) hold and send half the "
                         "bytes, with bf16 rounding in the sums"),
    ]
    command = click.option("--no-offload", is_flag=True, help="never offload the optimizer to the host")(command)
    for flag, text in reversed(options):
        command = click.option(flag, f"limit_{flag[2:].replace('-', '_')}", default=None, help=text)(command)
    return command


def parse_limits(tp: str | None, max_tp: str | None, pp: str | None, zero: str | None, recompute: str | None,
                 no_offload: bool, grad_dtype: str | None = None, cp: str | None = None, ep: str | None = None
                 ) -> Limits:
    """The limits the flags give (lists are comma-separated); every bad value named in one line."""
    problems: list[str] = []
    some = "positive integers, e.g. 1 or 2,4"
    tps = _numbers(tp, "--tp", some, problems)
    most = _numbers(max_tp, "--max-tp", "one positive integer, e.g. 4", problems, single=True)
    pps = _numbers(pp, "--pp", some, problems)
    cps = _numbers(cp, "--cp", some, problems)
    eps = _numbers(ep, "--ep", some, problems)
    zeros = _numbers(zero, "--zero", "ZeRO stages 0-3, e.g. 0 or 2,3", problems, low=0, high=3)
    strategies = tuple(dict.fromkeys(x.strip() for x in recompute.split(","))) if recompute is not None else None
    if strategies is not None and not set(strategies) <= set(RECOMPUTE):
        problems.append(f"--recompute {recompute!r}: give strategies among {', '.join(RECOMPUTE)}, e.g. none,full")
    grads = tuple(dict.fromkeys(x.strip() for x in grad_dtype.split(","))) if grad_dtype is not None else None
    if grads is not None and not set(grads) <= set(GRAD_DTYPE_FLAGS):
        problems.append(f"--grad-dtype {grad_dtype!r}: give dtypes among {', '.join(GRAD_DTYPE_FLAGS)}, e.g. fp32")
        grads = None
    limits = Limits(tps, most[0] if most else None, pps, zeros, not no_offload, strategies,
                    grads and tuple(GRAD_DTYPE_FLAGS[g] for g in grads), cps, eps)
    if problems:
        raise TensorOptError("; ".join(problems))
    return limits


def _numbers(text: str | None, flag: str, example: str, problems: list[str], low: int = 1, high: int | None = None,
             single: bool = False) -> tuple[int, ...] | None:
    """Sorted distinct integers in ``text`` (``2,4``), None when not given; a bad value joins ``problems``."""
    if text is None:
        return None
    try:
        values = tuple(sorted({int(x) for x in text.split(",")}))
    except ValueError:
        values = ()
    if not values or values[0] < low or (high is not None and values[-1] > high) or (single and "," in text):
        problems.append(f"{flag} {text!r}: give {example}")
        return None
    return values


__all__ = ["MAX_DEVICES", "MAX_DEVICES_PER_NODE", "MAX_GLOBAL_BATCH", "check_counts", "limit_options", "parse_limits"]
