"""What a probe run under torchrun hands back (``workers.probe_under_torchrun``): rank 0 writes its findings as JSON
to the file its first argument names, after every rank is done with the process group."""

from __future__ import annotations

import json
import sys

import torch.distributed as dist


def write_from_rank_0(out: dict) -> None:
    """``out`` to ``sys.argv[1]`` from rank 0; then every rank leaves the process group."""
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()
