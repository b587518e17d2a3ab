"""``Run.full_state_dict`` on 2 gloo workers: whole CPU copies of the parameters, gathered one at a time.

On a GPU the gathered parameters sit on the device; gathering the whole model there before copying any of it
to the host (what ``cpu_offload=False`` did) needs the whole model on every GPU. A CPU run cannot see device
memory apart from host memory, so the workers count the all-gather outputs alive at once instead (each is a
whole parameter on the device), and check that the values returned are copies of their own."""

import json
import subprocess
import textwrap

import pytest
import torch
from torch import nn
from workers import ENV, torchrun_argv

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("multiprocess")]

WORKER = textwrap.dedent("""
    import json, sys, weakref
    import torch, torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.utils._python_dispatch import TorchDispatchMode
    from tensoropt.runtime.run import Run

    class GatherWatch(TorchDispatchMode):
        '''The most all-gather outputs (whole parameters, on the device) alive at once.'''
        def __init__(self):
            super().__init__()
            self.alive, self.most = [], 0
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if "all_gather" in func.name():
                self.alive.append(weakref.ref(out))
            self.most = max(self.most, sum(ref() is not None for ref in self.alive))
            return out

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.LayerNorm(8))

    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    tp = parallelize_module(build(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fsdp = build()
    fully_shard(fsdp, mesh=mesh)
    result = {}
    for kind, model in (("tp", tp), ("fsdp", fsdp)):
        with GatherWatch() as watch:
            state = Run(rank=rank, world_size=2, model=model).full_state_dict()
        with torch.no_grad():                # the run trains on: what was returned must not change
            for p in model.parameters():
                (p.to_local() if isinstance(p, DTensor) else p).zero_()
        torch.save(state, f"{out}.{kind}.{rank}.pt")
        result[kind] = watch.most
    result["rank0_only"] = len(Run(rank=rank, world_size=2, model=fsdp).full_state_dict(ranks=(0,)))
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(result, f)
    Run(rank=rank, world_size=2).close()      # not a bare destroy_process_group: see Run.close (gloo, the GIL)
""")


def test_full_state_dict_copies_one_gathered_parameter_at_a_time(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    result = subprocess.run(torchrun_argv(str(script), [str(out)], 2), capture_output=True, text=True, env=ENV,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    torch.manual_seed(0)
    expected = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.LayerNorm(8)).state_dict()
    for rank in (0, 1):
        counts = json.loads((tmp_path / f"out.{rank}.json").read_text())
        assert (counts["tp"], counts["fsdp"]) == (1, 1)        # 3 and 6 parameters are gathered, one at a time
        assert counts["rank0_only"] == (len(expected) if rank == 0 else 0)
        for kind in ("tp", "fsdp"):
            state = torch.load(tmp_path / f"out.{kind}.{rank}.pt")
            assert sorted(state) == sorted(expected)
            for name, value in state.items():
                assert type(value) is torch.Tensor and value.device.type == "cpu", (kind, name)
                torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=f"{kind} {name}")
