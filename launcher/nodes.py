"""One plan for every node of a multi-node launch.

Each node runs its own ``tensoropt launch``; left alone, each would plan with its own free memory and
profile, and node ranks could start workers of different plans. So node 0 plans and shares its plan.json
through a ``torch.distributed.TCPStore`` it serves on the master address at ``--master-port + 1`` (torchrun's
static rendezvous takes ``--master-port`` itself), and every other node runs that plan, priced again for its
own model and devices. A node given ``--plan`` runs that instead (give every node the same one).
"""

from __future__ import annotations

import json
import os
import socket
import time
from datetime import timedelta

from tensoropt.errors import TensorOptError

DEFAULT_MASTER_PORT = 29500              # torchrun's default, as launcher.argv passes it
PLAN_KEY = "tensoropt/plan"
PLAN_TIMEOUT_ENV = "TENSOROPT_PLAN_TIMEOUT_S"
# node 0 captures its model and searches before it can share a plan: minutes for the largest models
DEFAULT_PLAN_TIMEOUT_S = 900.0
POLL_S = 0.5
# how long a node's torchrun waits for the others once every node has the plan (they start within seconds of
# each other then); torch's own default is 600 s
DEFAULT_RENDEZVOUS_TIMEOUT_S = 300


def check_nodes(nnodes: int, node_rank: int, master_addr: str | None, dry_run: bool) -> None:
    """A multi-node launch names its master (127.0.0.1 would make each node meet only itself) and a node
    rank below ``--nnodes``; a dry run may plan without a master."""
    problems = []
    if node_rank >= nnodes:
        problems.append(f"--node-rank {node_rank} must be below --nnodes {nnodes}")
    if nnodes > 1 and not master_addr and not dry_run:
        problems.append(f"--nnodes {nnodes} needs --master-addr: the address of node 0, which every node can reach")
    if problems:
        raise TensorOptError("; ".join(problems))


def plan_port(master_port: int | None) -> int:
    return (master_port or DEFAULT_MASTER_PORT) + 1


def timeout_s() -> float:
    try:
        return float(os.environ.get(PLAN_TIMEOUT_ENV, DEFAULT_PLAN_TIMEOUT_S))
    except ValueError:
        raise TensorOptError(f"{PLAN_TIMEOUT_ENV} must be a number of seconds") from None


def publish(master_addr: str, master_port: int | None, plan: dict):
    """Serve node 0's plan to the other nodes; the returned store serves it as long as it is referenced
    (keep it until the workers exit)."""
    from torch.distributed import TCPStore
    port = plan_port(master_port)
    try:
        store = TCPStore(master_addr, port, None, True, timedelta(seconds=timeout_s()), wait_for_workers=False)
        store.set(PLAN_KEY, json.dumps(plan))
    except RuntimeError as exc:
        raise TensorOptError(f"node 0 cannot serve its plan on port {port} (--master-port + 1): "
                             f"{_first_line(exc)}; choose another --master-port") from None
    return store


def fetch(master_addr: str, master_port: int | None, node_rank: int) -> dict:
    """Node 0's plan.json, waited for up to ``$TENSOROPT_PLAN_TIMEOUT_S`` (default 900 s)."""
    from torch.distributed import TCPStore
    port, wait_s = plan_port(master_port), timeout_s()
    deadline = time.monotonic() + wait_s
    try:
        _wait_for_server(master_addr, port, deadline)
        store = TCPStore(master_addr, port, None, False, timedelta(seconds=max(deadline - time.monotonic(), 1.0)))
        return json.loads(store.get(PLAN_KEY))
    except (OSError, RuntimeError, ValueError) as exc:
        raise TensorOptError(f"node {node_rank} got no plan from node 0 at {master_addr}:{port} within {wait_s:.0f} s "
                             f"({_first_line(exc)}): start node 0 with the same command and --node-rank 0, or give "
                             "every node the same --plan") from None


def _wait_for_server(host: str, port: int, deadline: float) -> None:
    """Wait until node 0 serves (it shares its plan as soon as its store listens). Tried here rather than by
    TCPStore's own retries, which print a C++ stack trace to stderr when they give up."""
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(min(deadline - time.monotonic(), 5.0), 0.1)):
                return
        except OSError:
            if time.monotonic() >= deadline:
                raise TimeoutError("nothing listens there") from None
            time.sleep(POLL_S)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


__all__ = ["DEFAULT_RENDEZVOUS_TIMEOUT_S", "check_nodes", "fetch", "plan_port", "publish"]
