"""Limits the user puts on the search space (``--tp``, ``--max-tp``, ``--pp``, ``--cp``, ``--zero``, ``--no-offload``,
``--recompute``, ``--grad-dtype`` of ``tensoropt frontier`` and ``tensoropt launch``).

``--cp`` names the context-parallel degrees searched (1: none), any the model runs: without it the search tries the
degrees that leave each rank at least 4096 tokens (``space.context_parallel.default_degrees``) beside 1.

A limit narrows a ``SearchSpace``; it never widens one, but for ``--grad-dtype``: the space holds both gradient
layouts the torch engine runs in bf16-mixed, and without the flag only the precision's own (float32) is searched,
so ``--grad-dtype bf16`` (or ``fp32,bf16``) opts in to bf16 gradients. The launcher searches one space per engine
(each engine's part of the space), so the limits are intersected with each part, and a part they
empty is not searched at all.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..cost.states import state_bytes
from .ft import SearchSpace

# the dtypes gradients may be accumulated and reduced in, by the names ``--grad-dtype`` gives them, and their widths
GRAD_DTYPE_FLAGS = {"fp32": "float32", "bf16": "bfloat16"}
_WIDTHS = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class Limits:
    """What the user allows; None (or True for ``offload``) leaves that dimension as the space has it."""

    tensor_parallel: tuple[int, ...] | None = None   # allowed tp degrees (1: no tensor parallelism)
    max_tp: int | None = None
    pipeline_stages: tuple[int, ...] | None = None   # allowed pipeline stage counts
    zero_stages: tuple[int, ...] | None = None
    offload: bool = True                             # False: never offload the optimizer
    recompute: tuple[str, ...] | None = None         # allowed recomputation strategies
    grad_dtypes: tuple[str, ...] | None = None       # dtypes the gradients may be reduced in (float32, bfloat16)
    context_parallel: tuple[int, ...] | None = None  # context-parallel degrees searched (1: none)
    expert_parallel: tuple[int, ...] | None = None   # expert-parallel degrees searched (1: none)

    def _parts(self) -> list[tuple[str, str]]:
        """(flag, words) of each limit given."""
        def listed(values):
            return ",".join(map(str, values))
        flags = {dtype: flag for flag, dtype in GRAD_DTYPE_FLAGS.items()}
        grads = self.grad_dtypes and tuple(flags[d] for d in self.grad_dtypes)
        parts = [("--tp", "tp", self.tensor_parallel), ("--max-tp", "tp <=", self.max_tp and (self.max_tp,)),
                 ("--pp", "pp", self.pipeline_stages), ("--cp", "cp", self.context_parallel),
                 ("--ep", "ep", self.expert_parallel),
                 ("--zero", "ZeRO", self.zero_stages),
                 ("--recompute", "recompute", self.recompute), ("--grad-dtype", "gradients in", grads)]
        out = [(f"{flag} {listed(v)}", f"{words} {listed(v)}") for flag, words, v in parts if v]
        return out + ([("--no-offload", "no offload")] if not self.offload else [])

    def __bool__(self) -> bool:
        return bool(self._parts())

    def flags(self) -> str:
        """The limits as the flags that gave them (``--tp 1 --no-offload``), for error messages."""
        return " ".join(flag for flag, _ in self._parts())

    def describe(self) -> str:
        """The limits in words (``limited to tp 1, no offload``), for the reasons a plan was chosen."""
        return "limited to " + ", ".join(words for _, words in self._parts()) if self else ""

    def restrict(self, space: SearchSpace) -> SearchSpace | None:
        """``space`` with every limit applied, or None when a limit leaves one of its dimensions empty."""
        tp = _allowed(space.tensor_parallel, self.tensor_parallel, self.max_tp)
        pp = _allowed(space.pipeline_stages, self.pipeline_stages, None)
        zero = _allowed(space.zero_stages, self.zero_stages, None)
        recompute = tuple(r for r in space.recompute if self.recompute is None or r in self.recompute)
        # without --grad-dtype each engine keeps its precision's own gradients (float32 under FSDP2 in bf16-mixed, as
        # Megatron-LM and torchtitan train bf16 by default; DeepSpeed's bf16 mode its bf16 ones); naming bf16 offers
        # the torch engine's bf16 gradients too
        grads = tuple(g for g in space.grad_dtypes if (not g if self.grad_dtypes is None
                                                       else _reduced_in(space, g) in self.grad_dtypes))
        if grads == ("bfloat16",) and zero is not None:     # bf16 gradients are a ZeRO 1-3 layout (``ft.contexts``)
            zero = tuple(z for z in zero if z >= 1)
        if any(values == () for values in (tp, pp, zero, recompute, grads)):
            return None
        cp = _allowed(space.context_parallel, self.context_parallel, None)
        ep = _allowed(space.expert_parallel, self.expert_parallel, None)
        if cp == () or ep == ():
            return None
        return dataclasses.replace(space, tensor_parallel=tp, pipeline_stages=pp, zero_stages=zero,
                                   recompute=recompute, offload=space.offload and self.offload, grad_dtypes=grads,
                                   context_parallel=cp, expert_parallel=ep)


def _reduced_in(space: SearchSpace, grad_dtype: str) -> str:
    """The dtype a plan of ``space`` with gradient layout ``grad_dtype`` reduces its gradients in, as its engine
    holds them (``cost.states``: DeepSpeed's bf16 mode reduces bf16 gradients with no ``grad_dtype`` named)."""
    width = state_bytes(space.dtype, space.master_weights, space.precision, 1, grad_dtype).reduced_bytes
    return next((dtype for dtype, size in _WIDTHS.items() if size == width), "")


def _allowed(current: tuple[int, ...] | None, wanted: tuple[int, ...] | None,
             most: int | None) -> tuple[int, ...] | None:
    """The values both allow (None: no restriction on either side); ``most`` caps them."""
    if current is None and wanted is None:
        return None if most is None else tuple(range(1, most + 1))
    values = current if wanted is None else tuple(v for v in wanted if current is None or v in current)
    return tuple(v for v in values if most is None or v <= most)


NO_LIMITS = Limits()
