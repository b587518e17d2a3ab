"""TensorOpt: plan and launch distributed PyTorch training on the time/memory Pareto frontier.

Every public name is imported on first use (PEP 562): ``import tensoropt`` itself imports nothing heavy, so
the ``tensoropt`` command can catch a Ctrl-C while torch is still importing (``tensoropt.cli.main``), and
planning never imports the runtime.
"""

import importlib

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {"Captured": "api", "capture": "api", "plan": "planning", "FoldedGraph": "graph.fold",
            "fold": "graph.fold", "Op": "graph.ir", "OpGraph": "graph.ir", "Frontier": "frontier",
            "parallelize": "runtime.entry", "meta_init": "runtime.entry"}

__all__ = ["Captured", "FoldedGraph", "Frontier", "Op", "OpGraph", "capture", "fold", "meta_init", "parallelize",
           "plan", "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    else:                                   # a subpackage reached as an attribute (``tensoropt.graph``)
        try:
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError:
            raise AttributeError(f"module 'tensoropt' has no attribute {name!r}") from None
    globals()[name] = value
    return value
