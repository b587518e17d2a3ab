"""``python -m tensoropt.runtime.capture_run SCRIPT [ARGS...]``: run a training script in capture mode
with every tensor on the meta device.

The launcher learns the model by running the script up to ``tensoropt.parallelize``. A script that builds
its model for real (``DecoderLM(cfg)``, ``from_config``) would allocate and initialise every weight on the
host first: 280 GB for a 70B model in float32. Here nothing is allocated: tensors made without a device go
to meta (``torch.device("meta")`` as the default device), tensors asked for on a device (``device="cuda"``,
``.to(device)``, ``.cuda()``) go to meta too, so a script that moves its model to its GPU before
``parallelize`` captures unchanged and no GPU memory is touched. Tensors the script reads from outside
torch (``torch.from_numpy``, files) stay real; they are data, small next to a model. A script whose code
before ``parallelize`` needs tensor values (``.item()`` on a weight) cannot be captured this way. A CUDA
autocast the script enters is a CPU autocast of the same dtype here (``graph.precision``), so the capture
records the precision the script trains in on any machine.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from ..errors import TensorOptError
from ..graph.capture import tracing_device
from ..graph.precision import cuda_autocast_on_cpu
from . import CAPTURE_ENV, capture_args

META = torch.device("meta")
_MOVES = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu}


class _EverythingOnMeta(TorchFunctionMode):
    """Rewrites every device a tensor is asked for to meta (see module doc); during the model's capture, to
    the device its fake tensors are on (the CPU under autocast, see ``graph.precision``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        target = tracing_device() or META
        if func in _MOVES:
            return _move_to(target, func, args, kwargs)
        if kwargs.get("device") is not None:
            kwargs["device"] = target
        return func(*args, **kwargs)


def _move_to(target: torch.device, func, args: tuple, kwargs: dict) -> torch.Tensor:
    """``t.to(...)`` / ``t.cuda()`` / ``t.cpu()`` with the device replaced by ``target``; the dtype still applies."""
    tensor, rest = args[0], args[1:]
    if func is torch.Tensor.to:
        device, dtype, _non_blocking, _memory_format = torch._C._nn._parse_to(*rest, **kwargs)
        if device is None:
            return func(*args, **kwargs)                     # a dtype change alone, where the tensor is
        return tensor.to(device=target, dtype=dtype or tensor.dtype)
    return tensor if tensor.device == target else tensor.to(device=target)


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m tensoropt.runtime.capture_run SCRIPT [ARGS...]")
    script = argv[0]
    sys.argv = list(argv)                                    # as `python SCRIPT ARGS` would see them
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    capture_args.install()                 # which options the capture read: the launcher's cache ignores the rest
    try:
        with META, _EverythingOnMeta(), cuda_autocast_on_cpu():    # the script's CUDA autocast is seen (precision)
            runpy.run_path(script, run_name="__main__")
    except TensorOptError as exc:          # the launcher shows the last line: the message alone, no traceback
        print(exc, file=sys.stderr)
        raise SystemExit(1) from None
    finally:                               # the capture has ended (graph written, or none)
        if out := os.environ.get(CAPTURE_ENV):
            capture_args.write_report(Path(out))


if __name__ == "__main__":
    main(sys.argv[1:])
