"""Collective communication measured in real worker processes through ``torch.distributed``
(gloo on CPU, nccl on CUDA): all-reduce, all-gather, reduce-scatter, all-to-all and point-to-point
over message sizes, for every group size from 2 to the number of workers.

Workers are started (``worker_context``) on a free local port; rank 0 reports each timing (the maximum over ranks of
the median over repeats, since a collective ends when its slowest rank does).

Every tensor a collective runs on, the timings' own reduction included, sits on the device the group's
backend serves (``group_device``): an NCCL group has no backend for CPU tensors ("No backend type
associated with device type cpu").
"""

from __future__ import annotations

import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..collective_api import all_gather_single, reduce_scatter_single

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_device(group=None, prefer: str = "cpu") -> torch.device:
    """The device type a collective on ``group`` (default: every rank) can take tensors on: ``prefer``
    (the device the worker runs on) where one of the group's backends serves it, else the first type
    its backends serve. An NCCL group serves only ``cuda``; gloo serves ``cpu`` and ``cuda``."""
    types = [d.type for d in (group or dist.group.WORLD)._device_types]
    return torch.device(prefer if prefer in types or not types else types[0])


def slowest_s(seconds: float, device: torch.device) -> float:
    """The largest of every rank's ``seconds`` (a collective ends when its slowest rank does), reduced
    over the default group on its ``device``."""
    elapsed = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def _run_op(op: str, x: torch.Tensor, group, group_size: int, rank: int) -> None:
    if op == "all_reduce":
        dist.all_reduce(x, group=group)
    elif op == "all_gather":
        all_gather_single(torch.empty(x.numel() * group_size, dtype=x.dtype, device=x.device), x, group=group)
    elif op == "reduce_scatter":
        reduce_scatter_single(torch.empty(x.numel() // group_size, dtype=x.dtype, device=x.device), x, group=group)
    elif op == "all_to_all":
        dist.all_to_all_single(torch.empty_like(x), x, group=group)
    elif rank == 0:
        dist.send(x, 1)
        dist.recv(x, 1)
    elif rank == 1:
        dist.recv(x, 0)
        dist.send(x, 0)


def _worker(rank: int, world: int, port: int, device: str, sizes: list[int], repeats: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    world_device = group_device(prefer=device)
    results = []
    for group_size in range(2, world + 1):
        group = dist.new_group(list(range(group_size)))
        member = rank < group_size
        tensor_device = group_device(group, prefer=device) if member else world_device    # outside it: no group object
        for op in OPS:
            if op == "p2p" and group_size != 2:
                continue
            for nbytes in sizes:
                numel = max(group_size, nbytes // 4 // group_size * group_size)
                x = torch.ones(numel, device=tensor_device)
                samples = []
                for i in range(repeats + 1):
                    dist.barrier()
                    start = time.perf_counter()
                    if member:
                        _run_op(op, x, group, group_size, rank)
                        if device == "cuda":
                            torch.cuda.synchronize()
                    elapsed = slowest_s(time.perf_counter() - start, world_device)
                    if i:                                 # the first run warms the group up
                        samples.append(elapsed)
                # p2p runs a round trip: report one direction
                seconds = statistics.median(samples) / (2 if op == "p2p" else 1)
                results.append({"op": op, "group_size": group_size, "bytes": numel * 4, "seconds": seconds})
                if rank == 0:
                    queue.put(("step", op, group_size, numel * 4))
    if rank == 0:
        queue.put(("done", results))
    dist.barrier()
    dist.destroy_process_group()


def worker_context():
    """Where the workers start: a fork server that imports torch and this module once and forks each worker from
    itself (Linux, macOS), instead of spawning workers that each import them (~2.5 CPU-s a worker, on the cores the
    other workers are already measuring with). The server never initialises CUDA, so its children may."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", __name__])   # read when the server first starts
    return context


def measure(nproc: int, device: str, sizes: list[int], repeats: int, on_step=None) -> list[dict]:
    """Start ``nproc`` workers (``worker_context``) and return every measurement; ``on_step`` is called per
    timing."""
    context = worker_context()
    queue = context.SimpleQueue()
    port = free_port()
    procs = [context.Process(target=_worker, args=(r, nproc, port, device, sizes, repeats, queue), daemon=True)
             for r in range(nproc)]
    for p in procs:
        p.start()
    results = None
    try:
        while results is None:
            if queue.empty():
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError("a collective-benchmark worker failed")
                time.sleep(0.01)
                continue
            kind, *payload = queue.get()
            if kind == "step" and on_step:
                on_step(*payload)
            elif kind == "done":
                results = payload[0]
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
    return results


def steps(nproc: int, sizes: list[int]) -> int:
    """How many timings ``measure`` reports (for a progress bar)."""
    return sum(len(sizes) * (len(OPS) if g == 2 else len(OPS) - 1) for g in range(2, nproc + 1))
