"""Pure argv builders: what the launcher runs, with no side effects (DeepSpeed's runner style)."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def torchrun_argv(script: str, script_args: Sequence[str], nproc_per_node: int, nnodes: int = 1,
                  node_rank: int = 0, master_addr: str | None = None, master_port: int | None = None) -> list[str]:
    """``python -m torch.distributed.run`` for one node of the job: a standalone rendezvous on one
    node, the static master address and port across nodes."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc_per_node)]
    if nnodes == 1 and master_addr is None:
        argv.append("--standalone")
    else:
        argv += ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--master-addr", master_addr or "127.0.0.1",
                 "--master-port", str(master_port or 29500)]
    return argv + [script, *script_args]


def capture_argv(script: str, script_args: Sequence[str]) -> list[str]:
    """Run the script once in one process, every tensor on the meta device (nothing allocated, see
    ``tensoropt.runtime.capture_run``); ``tensoropt.parallelize`` captures the model and exits."""
    return [sys.executable, "-m", "tensoropt.runtime.capture_run", script, *script_args]
