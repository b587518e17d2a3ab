"""Why tensor parallelism in bf16-true moves the losses more than the other layouts (tests/test_precision.py).

Three runs of ``examples/train_gpt.py --layers 2 --steps 3`` in bf16-true:

- ``alone``: the script by hand, one process;
- ``roundings``: the same process, but each linear computes as tp2 would on 2 ranks: a row-parallel one (attention
  output, MLP down) as two halves of its input features, each rounded to bf16, then added (the bf16 all-reduce of
  the partial outputs); a column-parallel one (QKV, MLP up, the vocabulary-split head) gets its input gradient as
  two such halves. Nothing else changes;
- ``tp2``: ``tensoropt launch`` on 2 CPU workers under dp1 tp2 (both branches and the vocabulary split).

If the launched run's deviation from ``alone`` is of the size the added roundings alone cause (and its first
step, one forward, lands where theirs does), the deviation is the layout's arithmetic, as Megatron-LM's bf16 tensor
parallelism does it too, and not a precision applied wrongly. Run: ``python benchmarks/tp_bf16_roundings.py``.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "examples" / "train_gpt.py")
ARGS = ["--steps", "3", "--layers", "2"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TENSOROPT_PRECISION": "bf16-true",
       "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def _row_forward(self, x):
    import torch.nn.functional as F
    k = self.weight.shape[1] // 2
    bias = None if self.bias is None else self.bias / 2
    return F.linear(x[..., :k], self.weight[:, :k], bias) + F.linear(x[..., k:], self.weight[:, k:], bias)


def _column_forward(self, x):
    import torch
    import torch.nn.functional as F
    n = self.weight.shape[0] // 2
    bias = (None, None) if self.bias is None else (self.bias[:n], self.bias[n:])
    return torch.cat([F.linear(x, self.weight[:n], bias[0]), F.linear(x, self.weight[n:], bias[1])], dim=-1)


def run_with_roundings(argv: list[str]) -> None:
    """In this process: the script, its linears replaced as described above before ``tensoropt.parallelize``."""
    import tensoropt
    original = tensoropt.parallelize

    def parallelize(model, *args, **kwargs):
        for name, module in model.named_modules():
            last = name.rsplit(".", 1)[-1]
            if last in ("proj", "down"):
                module.forward = types.MethodType(_row_forward, module)
            elif last in ("qkv", "up", "head"):
                module.forward = types.MethodType(_column_forward, module)
        return original(model, *args, **kwargs)
    tensoropt.parallelize = parallelize
    sys.argv = [SCRIPT, *argv]
    runpy.run_path(SCRIPT, run_name="__main__")


def losses(folder: Path, name: str, command: list[str]) -> list[float]:
    out = folder / f"{name}.json"
    subprocess.run([*command, "--out", str(out)], check=True, env=ENV, capture_output=True, cwd=folder, timeout=600)
    return json.loads(out.read_text())["losses"]


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from tensoropt.space.plan import BlockPlan, LayerStrategy, Plan
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        plan = Plan(devices=2, dp=1, tp=2, pp=1, micro_batch=4, global_batch=8, zero=0, master_weights=False,
                    blocks=(BlockPlan("layers.*", ((LayerStrategy("none"), 2),)),), tp_branches=("attn", "mlp"),
                    precision="bf16-true")
        (folder / "plan.json").write_text(json.dumps(plan.to_json()))
        runs = {
            "alone": losses(folder, "alone", [sys.executable, SCRIPT, *ARGS]),
            "roundings": losses(folder, "roundings", [sys.executable, __file__, "--roundings", *ARGS]),
            "tp2": losses(folder, "tp2", [sys.executable, "-m", "tensoropt", "launch", SCRIPT, "--device", "cpu",
                                          "--gpus", "2", "--plan", str(folder / "plan.json"), "--engine", "torch",
                                          "--run-dir", str(folder / "run"), "--", *ARGS]),
        }
    alone = np.array(runs["alone"])
    for name, values in runs.items():
        deviation = np.abs(np.array(values) / alone - 1)
        print(f"{name:10s} losses {values}  vs alone: largest {deviation.max():.2e}, first step {deviation[0]:.2e}")
    first = abs(runs["tp2"][0] / runs["roundings"][0] - 1)
    print(f"tp2 vs roundings, first step: {first:.2e}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--roundings"]:
        run_with_roundings(sys.argv[2:])
    else:
        main()
