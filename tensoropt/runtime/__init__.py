"""Apply a plan inside a training script: ``tensoropt.parallelize``.

The one call a training script makes, and the one call per step::

    model, optimizer, run = tensoropt.parallelize(model, lambda params: torch.optim.AdamW(params, lr=1e-3),
                                                  example_inputs=one_micro_batch, global_batch=32)
    for batch in batches:                       # global batches; the model's forward returns the loss
        loss = run.train_step(batch)

- Run by hand (no launcher): the model is unchanged and ``train_step`` is forward, backward and an
  optimizer step in one process, so the same script can be debugged alone.
- Under ``tensoropt launch`` in capture mode (``TENSOROPT_CAPTURE_OUT`` set): the model is captured
  on fake tensors from ``example_inputs``, the graph is written for the launcher, and the script ends at
  its first ``run.train_step`` (captured again there when it runs under an autocast, so the graph has the
  precision the script trains in); nothing trains. A forward that does not return the loss is a one-line
  error here, before any worker starts (``graph.loss``). This is how the launcher learns the model from
  the script itself.
- Under ``tensoropt launch`` with a plan (``TENSOROPT_PLAN`` set, workers started by torchrun): plan.json
  is read once into a typed ``RunPlan`` (``space.run_plan``; a bad field is a one-line error), the
  process binds to its device (``cuda:LOCAL_RANK`` for a GPU plan, see ``device``), joins the process
  group, and the engine the plan names (``torch_engine``, ``deepspeed_engine``) applies the plan and puts
  the model there; ``train_step`` moves every micro-batch to the device.

A model built on the meta device (``tensoropt.meta_init()`` or ``torch.device("meta")``) is sharded first
and only then given storage, this rank's shard only, initialised to the values of the model built for real
and then ``model.apply(init_fn)`` (see ``materialize``). Run alone, it is materialised whole on this process's
device (a GPU where one is visible).
"""

from __future__ import annotations

import importlib

# the variables the launcher sets for a script's process: named here, with nothing heavy imported, so that the
# launcher plans and starts workers without importing torch (``parallelize`` and the engines load on first use)
CAPTURE_ENV, PLAN_ENV = "TENSOROPT_CAPTURE_OUT", "TENSOROPT_PLAN"
CAPTURE_FRESH_ENV = "TENSOROPT_CAPTURE_FRESH"     # a capture that reads no cached block verdicts (launch --no-cache)
CHECKPOINT_DIR_ENV, CHECKPOINT_EVERY_ENV = "TENSOROPT_CHECKPOINT_DIR", "TENSOROPT_CHECKPOINT_EVERY"
CHECKPOINT_KEEP_ENV = "TENSOROPT_CHECKPOINT_KEEP"
RUN_DIR_ENV, SIMULATED_MEMORY_ENV = "TENSOROPT_RUN_DIR", "TENSOROPT_SIMULATED_MEMORY_BYTES"

# public name -> the module that defines it, imported on first use (PEP 562)
_EXPORTS = {"ENGINES": "..search.engines", "choose_engine": "..search.engines", "unsupported": "..search.engines",
            "PRECISION_ENV": ".engines.precision_names", "Run": ".run", "meta_init": ".entry", "parallelize": ".entry"}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


__all__ = ["CAPTURE_ENV", "CHECKPOINT_DIR_ENV", "CHECKPOINT_EVERY_ENV", "CHECKPOINT_KEEP_ENV", "ENGINES", "PLAN_ENV",
           "PRECISION_ENV", "RUN_DIR_ENV", "Run", "SIMULATED_MEMORY_ENV", "choose_engine", "meta_init", "parallelize",
           "unsupported"]
