"""Which modules of a model hold Mixture-of-Experts weights, recorded at capture (graph metadata ``experts``).

A token-routed layer's experts are recognised by their weights, not by running the router on data: a module with an
integer ``num_experts`` whose own parameters are stacks with one slice per expert and which carries the interface of
Hugging Face's experts classes (``transformers.integrations.moe.use_experts_implementation``: ``gate_up_proj`` /
``up_proj`` and ``down_proj`` of shape (experts, out, in), ``has_gate``, ``is_transposed``), whose forward the runtime
replaces to shard them: the one detection both the planner (through the capture's metadata) and the runtime read, so
no plan shards experts the runtime would not find.
How many experts each token visits (top-k) is read from the routing module beside it (``top_k``) or the model's
config (``num_experts_per_tok``). The planner shards these weights over expert-parallel ranks (``Plan.ep``) and
prices the token exchange the runtime runs (``runtime.parallel.expert_parallel``); the captured products already
count the active parameters' FLOPs (every token-expert pair once, ``graph.opinfo``).
"""

from __future__ import annotations

import json

from torch import nn

from ..errors import CaptureError
from .ir import EXPERTS_META


def _top_k(model: nn.Module, path: str) -> int:
    """Experts per token of the layer holding ``path``: its parent's or a sibling router's ``top_k``, else the
    config's ``num_experts_per_tok``; 0 when neither says."""
    parent_path = path.rsplit(".", 1)[0] if "." in path else ""
    parent = model.get_submodule(parent_path) if parent_path else model
    for module in (parent, *parent.children()):
        k = getattr(module, "top_k", None)
        if isinstance(k, int) and k > 0:
            return k
    config = getattr(model, "config", None)
    k = getattr(config, "num_experts_per_tok", 0)
    return k if isinstance(k, int) else 0


# what Hugging Face's experts classes carry beside their weights (``use_experts_implementation`` sets the flags)
_INTERFACE = ("has_gate", "is_transposed", "_is_expert_parallel", "down_proj")


def experts_modules(model: nn.Module) -> dict[str, dict]:
    """{module path: {"experts", "top_k", "params"}} of every experts module of ``model``, in model order (module
    doc)."""
    out: dict[str, dict] = {}
    for path, module in model.named_modules():
        experts = getattr(module, "num_experts", None)
        own = list(module.named_parameters(recurse=False))
        if not isinstance(experts, int) or experts < 2 or not own or not all(hasattr(module, a) for a in _INTERFACE):
            continue
        # one slice per expert of every parameter, matrices among them (a router's (experts, hidden) weight is none)
        if all(p.dim() >= 2 and p.shape[0] == experts for _, p in own) and any(p.dim() >= 3 for _, p in own):
            out[path] = {"experts": experts, "top_k": _top_k(model, path),
                         "params": [f"{path}.{name}" if path else name for name, _ in own]}
    return out


def check_experts(model: nn.Module) -> None:
    """A one-line ``CaptureError`` for a layer routing each token to more experts than it has (its router's top-k
    would fail on the meta device with torch's own words)."""
    for path, found in experts_modules(model).items():
        if found["top_k"] > found["experts"]:
            raise CaptureError(f"{path} routes each token to {found['top_k']} experts and has {found['experts']}: "
                               f"give num_experts_per_tok (top-k) <= {found['experts']}")


def experts_metadata(model: nn.Module) -> str:
    """The ``experts`` metadata of ``model``: "" for a dense model."""
    found = experts_modules(model)
    return json.dumps(found, sort_keys=True) if found else ""


__all__ = ["EXPERTS_META", "check_experts", "experts_metadata", "experts_modules"]
