"""The loss contract: a model's forward returns the loss.

Every engine drives a step the same way (forward, ``loss.backward()``), and a pipeline stage passes on the
last stage's output as the loss, so the forward must return one scalar tensor, or an output that carries it
(``output.loss`` as Hugging Face models do, or ``output["loss"]``). This module decides that once, for the
capture (which runs before any worker starts, on fake tensors: only shapes are read) and for the runtime's
step alike, and describes anything else in one line: ``a tuple (Tensor[4, 64, 1000], Tensor[])``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping

import torch

from ..errors import CaptureError

CONTRACT = "return only the loss (a scalar tensor, or an output with .loss)"
_MAX_ITEMS = 4          # items of a tuple/list/dict named in a description


def loss_tensor(output: object) -> torch.Tensor | None:
    """The loss ``output`` holds: the tensor itself, ``output.loss`` or ``output["loss"]``; None when it
    holds no scalar (one-element) tensor there."""
    loss = output if isinstance(output, torch.Tensor) else getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    return loss if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


def describe(value: object, top: bool = True) -> str:
    """``value`` in a few words: ``Tensor[4, 64]``, ``a tuple (Tensor[4, 64, 1000], Tensor[])``,
    ``a dict {'logits': Tensor[2, 8]}``, ``a CausalLMOutput with .loss None``."""
    article = "a " if top else ""
    if isinstance(value, torch.Tensor):
        return f"{article}Tensor[{', '.join(str(int(d)) for d in value.shape)}]"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, (tuple, list)):
        items = [describe(v, False) for v in value[:_MAX_ITEMS]] + (["..."] if len(value) > _MAX_ITEMS else [])
        brackets = "()" if isinstance(value, tuple) else "[]"
        return f"{article}{type(value).__name__} {brackets[0]}{', '.join(items)}{brackets[1]}"
    if hasattr(value, "loss"):                      # a Hugging Face ModelOutput (also a dict)
        return f"{article}{type(value).__name__} with .loss {describe(value.loss, False)}"
    if isinstance(value, Mapping):
        items = [f"{k!r}: {describe(v, False)}" for k, v in list(value.items())[:_MAX_ITEMS]]
        return f"{article}{type(value).__name__} {{{', '.join(items + (['...'] if len(value) > _MAX_ITEMS else []))}}}"
    return f"{article}{type(value).__name__}"


@contextlib.contextmanager
def wrapped_cross_entropy(wrap: Callable[[Callable], Callable]) -> Iterator[None]:
    """While inside, torch's cross-entropy entry point (``torch._C._nn.cross_entropy_loss``, which ``F.cross_entropy``
    and ``nn.CrossEntropyLoss`` look up on every call) is ``wrap(the entry point)``; restored on the way out."""
    original = torch._C._nn.cross_entropy_loss
    torch._C._nn.cross_entropy_loss = wrap(original)
    try:
        yield
    finally:
        torch._C._nn.cross_entropy_loss = original


def counting_cross_entropy(calls: list[int]) -> contextlib.AbstractContextManager:
    """Count, in ``calls[0]``, the calls of the cross-entropy entry point while inside: a loss that comes through it
    runs on the runtime's lean vocabulary-parallel cross-entropy (``runtime.parallel.vocab_loss``), one made of
    ``log_softmax`` and ``nll_loss`` called apart on torch's ``loss_parallel``, and the two are priced apart."""
    def counting(original: Callable) -> Callable:
        def counted(*args, **kwargs):
            calls[0] += 1
            return original(*args, **kwargs)
        return counted
    return wrapped_cross_entropy(counting)


def loss_problem(output: object) -> str | None:
    """What is wrong with ``output`` as a forward's loss, in words ("returns a tuple (...): return only
    the loss ..."); None when it is a loss."""
    if loss_tensor(output) is not None:
        return None
    hint = (": pass the labels in the example inputs and the batch" if hasattr(output, "loss") or
            (isinstance(output, Mapping) and "loss" in output) else f": {CONTRACT}")
    return f"returns {describe(output)}{hint}"


def check_loss(output: object, model_name: str) -> None:
    """A one-line ``CaptureError`` unless ``output`` is a loss (see ``loss_problem``)."""
    if problem := loss_problem(output):
        raise CaptureError(f"{model_name}.forward {problem}")
