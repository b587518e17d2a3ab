"""Pure argv builders: what the launcher runs, with no side effects (DeepSpeed's runner style)."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def torchrun_argv(script: str, script_args: Sequence[str], nproc_per_node: int, nnodes: int = 1,
                  node_rank: int = 0, master_addr: str | None = None, master_port: int | None = None,
                  log_dir: str | None = None, rendezvous_timeout_s: int | None = None) -> list[str]:
    """torchrun (``python -m launcher.torchrun``: ``torch.distributed.run`` less a cost of its rendezvous, see
    ``launcher.torchrun``) for one node of the job: a standalone rendezvous on one
    node, the static master address and port across nodes, where a node waits for the others at most
    ``rendezvous_timeout_s`` (torch's default is 600 s). With ``log_dir`` each worker's stderr is also written
    there and echoed with its rank (``launcher.workers``)."""
    argv = [sys.executable, "-m", "launcher.torchrun", "--nproc-per-node", str(nproc_per_node)]
    if nnodes == 1 and master_addr is None:
        argv.append("--standalone")
    else:
        argv += ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--master-addr", master_addr or "127.0.0.1",
                 "--master-port", str(master_port or 29500)]
        if rendezvous_timeout_s is not None:
            argv += ["--rdzv-conf", f"timeout={rendezvous_timeout_s}"]
    if log_dir is not None:
        argv += ["--log-dir", str(log_dir), "--redirects", "2", "--tee", "2"]
    return argv + [script, *script_args]


def capture_argv(script: str, script_args: Sequence[str]) -> list[str]:
    """Run the script once in one process, every tensor on the meta device (nothing allocated, see
    ``tensoropt.runtime.capture_run``); ``tensoropt.parallelize`` captures the model and exits."""
    return [sys.executable, "-m", "tensoropt.runtime.capture_run", script, *script_args]
