"""A precision's name: the variable that carries it to a script, its check, and the words the launch summary
says; imported by the launcher, which plans and starts workers without importing torch (``runtime.engines.precision``
applies a precision, with torch)."""

from __future__ import annotations

import os

from ...errors import TensorOptError
from ...space.plan import PRECISIONS, Plan

PRECISION_ENV = "TENSOROPT_PRECISION"


def checked(name: str, source: str) -> str:
    """``name`` if it is a precision, else a one-line error naming ``source`` (a flag or a variable)."""
    if name not in PRECISIONS:
        raise TensorOptError(f"{source}={name!r} is not a precision: use one of {', '.join(PRECISIONS)}")
    return name


def of_plan(plan: Plan | None) -> str | None:
    """The precision a plan trains in: its ``precision``; None for a plan without one (written
    before precisions were named: the model trains as the script built it). Run alone: ``PRECISION_ENV``."""
    if plan is None:
        name = os.environ.get(PRECISION_ENV)
        return checked(name, PRECISION_ENV) if name else None
    return checked(plan.precision, "plan precision") if plan.precision else None


def words(precision: str | None, engine: str, zero: int, grad_dtype: str = "") -> str:
    """What the engine holds and computes in under ``precision`` (and ``grad_dtype``), for the launch summary."""
    if precision is None:
        return "as the script built the model"
    if precision == "32-true":
        return "32-true: float32 weights, gradients, AdamW states and compute"
    if precision == "bf16-true":
        return "bf16-true: bf16 weights, gradients, AdamW states and compute"
    if engine == "deepspeed":
        return "bf16-mixed: DeepSpeed bf16 (bf16 weights and gradients, float32 master weights and AdamW states)"
    if zero >= 1:
        reduce = "bfloat16" if grad_dtype == "bfloat16" else "float32"
        return ("bf16-mixed: float32 weights and AdamW states; FSDP2 MixedPrecisionPolicy(param_dtype=bfloat16, "
                f"reduce_dtype={reduce}) and autocast(bfloat16) around the forward"
                + ("; gradients accumulated and reduced in bf16" if reduce == "bfloat16" else ""))
    return "bf16-mixed: float32 weights, gradients and AdamW states; autocast(bfloat16) around the forward"


__all__ = ["PRECISION_ENV", "checked", "of_plan", "words"]
