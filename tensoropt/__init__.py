"""TensorOpt: plan and launch distributed PyTorch training on the time/memory Pareto frontier."""

__version__ = "0.1.0"

from .api import Captured, capture  # noqa: E402
from .graph.fold import FoldedGraph, fold  # noqa: E402
from .graph.ir import Op, OpGraph  # noqa: E402

__all__ = ["Captured", "FoldedGraph", "Op", "OpGraph", "capture", "fold", "__version__"]
