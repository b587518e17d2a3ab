"""Resolve the ``--model`` argument into something that builds an ``nn.Module`` on the meta device.

Three kinds of source:
- a built-in preset name (``gpt3-175b``, ``llama2-70b``, ...);
- a JSON file: ``{"family": "gpt", "hidden_size": ...}`` or a Hugging Face ``config.json``
  (recognised by ``"model_type"``; built with ``transformers`` ``from_config``, nothing downloaded);
- ``path/to/file.py:function`` returning ``(model, example_inputs)`` for any user module.

Every source has an ``identity``: a JSON-able description that, with the capture code's version,
decides the captured graph, so the capture cache can be keyed by it.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import linecache
import os
import sys
import types
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import ModelSpecError, first_line, last_line
from .bert import BertForPreTraining
from .hf_presets import HF_PRESETS
from .identity import module_identity
from .presets import PRESETS
from .resnet import ResNetConfig, WideResNet
from .transformer import DecoderLM, TransformerConfig

MODEL_DTYPE = torch.bfloat16   # built-in and Hugging Face models are captured in bf16 (mixed precision)
FAMILIES = ("gpt", "llama", "moe", "bert", "resnet")
_GPT_REQUIRED = ("hidden_size", "num_layers", "num_attention_heads", "ffn_hidden_size", "seq_length",
                 "vocab_size")


class ModelSource(ABC):
    """Something that can build a model and example inputs on the meta device."""

    name: str

    @abstractmethod
    def identity(self, batch_size: int | None, seq_len: int | None) -> dict[str, Any]:
        """What decides the captured graph (JSON-able)."""

    @abstractmethod
    def build(self, batch_size: int | None, seq_len: int | None) -> tuple[nn.Module, tuple | dict]:
        """The model and its example inputs, on the meta device."""


class BuiltinSource(ModelSource):
    def __init__(self, name: str, family: str, config: TransformerConfig | ResNetConfig) -> None:
        self.name, self.family, self.config = name, family, config

    def _seq_len(self, seq_len: int | None) -> int:
        if isinstance(self.config, ResNetConfig):
            return self.config.image_size
        return seq_len or self.config.seq_length

    def _config_for(self, seq_len: int) -> TransformerConfig | ResNetConfig:
        cfg = self.config
        if isinstance(cfg, ResNetConfig) or seq_len <= cfg.seq_length:
            return cfg
        if cfg.position == "learned" or self.family == "bert":
            raise ModelSpecError(f"--seq-len {seq_len} exceeds {self.name}'s {cfg.seq_length} learned "
                                 f"positions; use --seq-len <= {cfg.seq_length}")
        return replace(cfg, seq_length=seq_len)

    def identity(self, batch_size, seq_len):
        seq = self._seq_len(seq_len)
        return {"kind": "builtin", "family": self.family, "config": self._config_for(seq).to_dict(),
                "batch_size": batch_size or 1, "seq_len": None if self.family == "resnet" else seq}

    def build(self, batch_size, seq_len):
        b, seq = batch_size or 1, self._seq_len(seq_len)
        cfg = self._config_for(seq)
        with torch.device("meta"):
            if self.family == "resnet":
                model = WideResNet(cfg)
                inputs = (torch.empty(b, 3, cfg.image_size, cfg.image_size, dtype=MODEL_DTYPE),
                          torch.zeros(b, dtype=torch.long))
            elif self.family == "bert":
                model = BertForPreTraining(cfg)
                ids = torch.zeros(b, seq, dtype=torch.long)
                inputs = (ids, torch.zeros_like(ids), ids, torch.zeros(b, dtype=torch.long))
            else:
                model = DecoderLM(cfg)
                ids = torch.zeros(b, seq, dtype=torch.long)
                inputs = (ids, ids)
        return model.to(MODEL_DTYPE), inputs


def tensor_parallel_local(source: ModelSource, tp: int) -> ModelSource | None:
    """A source for what one of ``tp`` tensor-parallel ranks computes, where the family's config
    allows it (built-in transformers); None otherwise."""
    if not isinstance(source, BuiltinSource) or not isinstance(source.config, TransformerConfig):
        return None
    local = source.config.tensor_parallel_local(tp)
    return None if local is None else BuiltinSource(f"{source.name}@tp{tp}", source.family, local)


class HuggingFaceSource(ModelSource):
    """A Hugging Face ``config.json``, built with ``AutoModelForCausalLM.from_config``."""

    DEFAULT_SEQ_LEN_CAP = 4096
    # where configs state how many positions the model has: most families, then GPT-2 style (n_ctx is its
    # older name for the same length)
    POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx")

    def __init__(self, name: str, config: dict[str, Any]) -> None:
        self.name, self.config = name, config

    def _seq_len(self, seq_len: int | None) -> int:
        positions = next((self.config[k] for k in self.POSITION_KEYS if self.config.get(k)), 2048)
        return seq_len or min(int(positions), self.DEFAULT_SEQ_LEN_CAP)

    def identity(self, batch_size, seq_len):
        import transformers
        return {"kind": "huggingface", "config": self.config, "transformers": transformers.__version__,
                "batch_size": batch_size or 1, "seq_len": self._seq_len(seq_len)}

    def build(self, batch_size, seq_len):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import transformers
        fields = {k: v for k, v in self.config.items() if k not in ("model_type", "transformers_version")}
        try:
            hf_config = transformers.AutoConfig.for_model(self.config["model_type"], **fields)
        except (ValueError, KeyError) as exc:
            raise ModelSpecError(f"{self.name}: transformers does not know model_type "
                                 f"{self.config['model_type']!r} ({first_line(exc)}); check the config.json") from exc
        except Exception as exc:                 # transformers' own checks of the values (several lines: keep its last)
            raise ModelSpecError(f"{self.name}: transformers refuses this config: {last_line(str(exc))}") from exc
        if hasattr(hf_config, "intermediate_size") and "intermediate_size" not in self.config:
            raise ModelSpecError(f"{self.name}: missing intermediate_size: a {self.config['model_type']} config must "
                                 "state it (TensorOpt does not fill in transformers' defaults)")
        hf_config.use_cache = False
        try:
            with torch.device("meta"):
                model = transformers.AutoModelForCausalLM.from_config(hf_config)
        except ValueError as exc:
            raise ModelSpecError(f"{self.name}: model_type {self.config['model_type']!r} has no causal-LM "
                                 "class in transformers; capture it with a file.py:function source") from exc
        b, seq = batch_size or 1, self._seq_len(seq_len)
        ids = torch.zeros(b, seq, dtype=torch.long, device="meta")
        return model.to(MODEL_DTYPE), {"input_ids": ids, "labels": ids}


class FileSource(ModelSource):
    """``path/to/file.py:function`` returning ``(model, example_inputs)``.

    The function runs with the meta device as the default device, so a model built with default
    arguments allocates no memory, and with the file's folder on ``sys.path``, so the file can import its
    neighbours. If it accepts ``batch_size`` / ``seq_len`` they are passed on. Its sequence length is the
    ``seq_len`` it was given, or its ``seq_len`` parameter's int default, or else read from the example
    inputs (``example_shape``).
    """

    def __init__(self, path: Path, function: str) -> None:
        self.path, self.function, self.name = path, function, f"{path.name}:{function}"
        self._built: dict[tuple, tuple[nn.Module, tuple | dict]] = {}

    def _call(self, batch_size, seq_len) -> tuple[nn.Module, tuple | dict, int | None]:
        """(model, example_inputs, stated sequence length or None), built once per (batch, seq)."""
        key = (batch_size, seq_len)
        if key in self._built:
            return self._built[key]
        with importable(self.path.resolve().parent):   # the builder may import its neighbours
            fn = self._function()
            kwargs = self._arguments(fn, batch_size, seq_len)
            try:
                with torch.device("meta"):
                    result = fn(**kwargs)
            except Exception as exc:
                raise ModelSpecError(f"{self.name} raised {type(exc).__name__}: {exc}") from exc
        if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module)):
            raise ModelSpecError(f"{self.name} must return (model, example_inputs), got {type(result).__name__}")
        model, inputs = result
        if isinstance(inputs, torch.Tensor):
            inputs = (inputs,)
        if not isinstance(inputs, (tuple, list, Mapping)):
            raise ModelSpecError(f"{self.name}: example_inputs must be a tensor, a tuple or a dict, "
                                 f"got {type(inputs).__name__}")
        stated = kwargs.get("seq_len", _int_default(fn, "seq_len"))
        self._built[key] = (model, inputs if isinstance(inputs, Mapping) else tuple(inputs), stated)
        return self._built[key]

    def _function(self):
        fn = getattr(self._load_module(), self.function, None)
        if not callable(fn):
            raise ModelSpecError(f"{self.path} has no function {self.function!r}; "
                                 "write FILE.py:FUNCTION with a function that returns (model, example_inputs)")
        return fn

    def _arguments(self, fn, batch_size: int | None, seq_len: int | None) -> dict[str, int]:
        """``--batch-size`` / ``--seq-len`` as keywords of the function; one it does not take is an error."""
        accepted = inspect.signature(fn).parameters
        kwargs = {}
        for flag, key_name, value in (("--batch-size", "batch_size", batch_size), ("--seq-len", "seq_len", seq_len)):
            if value is None:
                continue
            if key_name not in accepted:
                raise ModelSpecError(f"{self.name} does not take {key_name}; drop {flag} or add a "
                                     f"{key_name} parameter to {self.function}()")
            kwargs[key_name] = value
        return kwargs

    def _load_module(self) -> types.ModuleType:
        """Execute the file from its current source. Not through the import system: its bytecode
        cache trusts mtime (1 s resolution) and size, so a quick same-size edit would run stale code
        while the fingerprint, a hash of the source, already describes the new one."""
        source = self.path.read_text()
        name = f"tensoropt_user_{hashlib.sha256(str(self.path.resolve()).encode()).hexdigest()[:12]}"
        module = types.ModuleType(name)
        module.__file__ = str(self.path)
        sys.modules[name] = module            # classes must find their module (dataclasses, inspect)
        linecache.checkcache(str(self.path))  # inspect.getsource must read the new text too
        try:
            exec(compile(source, str(self.path), "exec"), module.__dict__)
        except Exception as exc:
            raise ModelSpecError(f"{self.path}: importing it failed: {type(exc).__name__}: {exc}") from exc
        return module

    def identity(self, batch_size, seq_len):
        model, inputs, stated = self._call(batch_size, seq_len)
        batch, seq = example_shape(inputs)
        return {"kind": "file", "file_sha256": hashlib.sha256(self.path.read_bytes()).hexdigest(),
                "function": self.function, "module": module_identity(model, inputs),
                "batch_size": batch, "seq_len": stated or seq}

    def build(self, batch_size, seq_len):
        return self._call(batch_size, seq_len)[:2]


@contextlib.contextmanager
def importable(folder: Path) -> Iterator[None]:
    """``folder`` first on ``sys.path`` for the duration, as ``python folder/file.py`` would have it, so a
    builder file can import the modules beside it; ``sys.path`` is restored afterwards."""
    saved = list(sys.path)
    sys.path.insert(0, str(folder))
    try:
        yield
    finally:
        sys.path[:] = saved


def _int_default(fn, name: str) -> int | None:
    """The default of ``fn``'s parameter ``name`` when it is an int (how a builder states its length)."""
    param = inspect.signature(fn).parameters.get(name)
    default = param.default if param is not None else None
    return default if isinstance(default, int) and not isinstance(default, bool) else None


def example_shape(inputs: tuple | Mapping) -> tuple[int | None, int | None]:
    """(batch size, sequence length) of one example batch: dims 0 and 1 of the first tensor input with at
    least 2 dims (the first tensor if none has). The sequence is read only from token ids (batch, seq) or
    embeddings (batch, seq, features); an image (batch, channels, height, width) has none. One rule for
    every source (``tensoropt.capture``, builder files, the launcher's capture of a script): the sequence
    length lets head counts limit tensor parallelism (``space.block``)."""
    values = inputs.values() if isinstance(inputs, Mapping) else inputs
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    first = next((t for t in tensors if t.dim() >= 2), tensors[0] if tensors else None)
    if first is None or first.dim() == 0:
        return None, None
    return int(first.shape[0]), int(first.shape[1]) if first.dim() in (2, 3) else None


def in_dtype(model: nn.Module, inputs: tuple | Mapping, dtype: str | None) -> tuple[nn.Module, tuple | Mapping]:
    """The model and its floating-point inputs in ``dtype`` (``float32``...); unchanged for None."""
    if dtype is None:
        return model, inputs
    target = getattr(torch, dtype, None)
    if not isinstance(target, torch.dtype) or not target.is_floating_point:
        raise ModelSpecError(f"dtype {dtype!r} is not a floating-point torch dtype (float32, bfloat16, float16)")

    def cast(x):
        return x.to(target) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
    inputs = {k: cast(v) for k, v in inputs.items()} if isinstance(inputs, Mapping) else tuple(map(cast, inputs))
    return model.to(target), inputs


def _json_source(path: Path) -> ModelSource:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelSpecError(f"{path}: not a readable JSON file ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelSpecError(f"{path}: expected a JSON object with \"family\" or \"model_type\"")
    if "model_type" in data:
        _check_hf_config(path, data)
        return HuggingFaceSource(path.name, data)
    family = data.pop("family", None)
    if family not in FAMILIES:
        raise ModelSpecError(f"{path}: \"family\" must be one of {', '.join(FAMILIES)} "
                             f"(or give a Hugging Face config with \"model_type\"), got {family!r}")
    if family == "resnet":
        allowed = set(ResNetConfig.__dataclass_fields__)
        _check_keys(path, data, allowed, ())
        if "layers" in data:
            data["layers"] = tuple(data["layers"])
        return BuiltinSource(path.stem, family, ResNetConfig(**data))
    _check_keys(path, data, set(TransformerConfig.field_names()), _GPT_REQUIRED)
    defaults = {"gpt": {"dropout": 0.1}, "moe": {"dropout": 0.1, "num_experts": 8},
                "bert": {"dropout": 0.1},
                "llama": {"norm": "rmsnorm", "activation": "swiglu", "position": "rope", "bias": False,
                          "tie_embeddings": False, "attention": "flash"}}[family]
    return BuiltinSource(path.stem, family, TransformerConfig(**{**defaults, **data}))


# the sizes a Hugging Face config must state, each under any of its names (GPT-2 style configs use the second):
# transformers would fill a missing one with its own default (a 32-layer model from {"model_type": "llama",
# "hidden_size": 64}), which is not the model the user has
HF_SIZES = {"hidden_size": ("hidden_size", "n_embd", "d_model"), "num_hidden_layers": ("num_hidden_layers", "n_layer"),
            "num_attention_heads": ("num_attention_heads", "n_head"), "vocab_size": ("vocab_size",)}


def _hf_size(data: dict, key: str) -> object:
    return next((data[name] for name in HF_SIZES[key] if name in data), None)


def _check_hf_config(path: Path, data: dict) -> None:
    """A Hugging Face config states the model's sizes (``HF_SIZES``) as positive integers, with a hidden size the
    heads divide and key/value heads that divide the heads; else one line naming what to add or change."""
    missing = [key for key in HF_SIZES if _hf_size(data, key) is None]
    if missing:
        raise ModelSpecError(f"{path}: missing {', '.join(missing)}: a Hugging Face config must state the model's "
                             "sizes (TensorOpt does not fill in transformers' defaults)")
    sizes = {key: _hf_size(data, key) for key in HF_SIZES} | (
        {"num_key_value_heads": data["num_key_value_heads"]} if data.get("num_key_value_heads") is not None else {})
    bad = [f"{key} {value!r}" for key, value in sizes.items()
           if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1)]
    if bad:
        raise ModelSpecError(f"{path}: {', '.join(bad)} must be positive integers")
    hidden, heads = sizes["hidden_size"], sizes["num_attention_heads"]
    if hidden % heads:
        raise ModelSpecError(f"{path}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}: "
                             "change one so that the heads divide the hidden size")
    if heads % sizes.get("num_key_value_heads", heads):
        raise ModelSpecError(f"{path}: num_key_value_heads {sizes['num_key_value_heads']} must divide "
                             f"num_attention_heads {heads}")


def _check_keys(path: Path, data: dict, allowed: set[str], required: tuple[str, ...]) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ModelSpecError(f"{path}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}")
    missing = [k for k in required if k not in data]
    if missing:
        raise ModelSpecError(f"{path}: missing required key(s) {', '.join(missing)}")


def resolve_model(spec: str) -> ModelSource:
    """Turn a ``--model`` argument into a ``ModelSource``; a bad spec is a one-line ``ModelSpecError``."""
    if spec in PRESETS:
        preset = PRESETS[spec]
        return BuiltinSource(preset.name, preset.family, preset.config)
    if spec in HF_PRESETS:
        return HuggingFaceSource(spec, HF_PRESETS[spec].config)
    path_part, _, function = spec.rpartition(":")
    if path_part.endswith(".py") and function:
        path = Path(path_part)
        if not path.is_file():
            raise ModelSpecError(f"{path}: no such file")
        return FileSource(path, function)
    if spec.endswith(".py"):
        raise ModelSpecError(f"{spec}: name the function too, as {spec}:FUNCTION")
    if spec.endswith(".json"):
        path = Path(spec)
        if not path.is_file():
            raise ModelSpecError(f"{path}: no such file")
        return _json_source(path)
    raise ModelSpecError(f"unknown model {spec!r}: use a preset ({', '.join([*PRESETS, *HF_PRESETS])}), "
                         "a JSON config file, or FILE.py:FUNCTION")
