"""Built-in model families and the ``--model`` resolver."""

from .presets import PRESETS, Preset
from .sources import ModelSource, example_shape, in_dtype, module_identity, resolve_model

__all__ = ["PRESETS", "Preset", "ModelSource", "example_shape", "in_dtype", "module_identity", "resolve_model"]
