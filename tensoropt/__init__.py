"""TensorOpt: plan and launch distributed PyTorch training on the time/memory Pareto frontier."""

__version__ = "0.1.0"

from .api import Captured, capture  # noqa: E402
from .graph.fold import FoldedGraph, fold  # noqa: E402
from .graph.ir import Op, OpGraph  # noqa: E402

__all__ = ["Captured", "FoldedGraph", "Op", "OpGraph", "capture", "fold", "meta_init", "parallelize", "__version__"]


def __getattr__(name: str):
    """``tensoropt.parallelize`` and ``tensoropt.meta_init`` live in the runtime, imported only when a
    training script asks: planning never imports the runtime."""
    if name in ("parallelize", "meta_init"):
        from . import runtime
        return getattr(runtime, name)
    raise AttributeError(f"module 'tensoropt' has no attribute {name!r}")
