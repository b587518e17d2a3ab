"""A tensor's name as the script's own model has it. Engines wrap modules (``checkpoint_wrapper``, FSDP's
wrapper), which puts prefixes into parameter names; whatever moves values between the script's model and the
run (initialisation, feature orders, full state dicts) compares names without them; ``torch.compile``'s
wrapper of a compiled block (``runtime.engines.compile``) adds ``_orig_mod.``."""

from __future__ import annotations

_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")


def script_name(name: str) -> str:
    """A tensor's name as the script's model has it, without the engines' wrapper prefixes."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


__all__ = ["script_name"]
