"""Run by tests/test_expert_parallel.py under torchrun (2 CPU workers, ep 2): a Hugging Face Mixtral experts module's
forward and backward through ``ExpertParallel`` (each rank its own tokens, half the experts) against Hugging Face's
own ``grouped_mm_experts_forward`` on every rank's tokens with all experts, for routings that leave an expert
without tokens and one that sends no row at all to rank 1. Rank 0 writes to the JSON file argv[1], per routing,
the largest relative deviation of the outputs and of the gradients of the tokens, the routing weights and the
expert weights."""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from transformers import MixtralConfig
from transformers.integrations.moe import grouped_mm_experts_forward
from transformers.models.mixtral.modeling_mixtral import MixtralExperts

from tensoropt.runtime.parallel.expert_parallel import ExpertParallel

TOKENS, HIDDEN, EXPERTS, K = 12, 16, 4, 2


def routings(generator: torch.Generator) -> dict[str, torch.Tensor]:
    """(ranks x TOKENS, K) expert choices, distinct per token: random, without expert 3, only rank 0's experts."""
    def pick(allowed: list[int]) -> torch.Tensor:
        scores = torch.rand(2 * TOKENS, len(allowed), generator=generator)
        return torch.tensor(allowed)[scores.topk(K, dim=1).indices]
    return {"random": pick([0, 1, 2, 3]), "expert 3 idle": pick([0, 1, 2]), "rank 1 idle": pick([0, 1])}


def relative(got: torch.Tensor | None, want: torch.Tensor) -> float:
    """The largest deviation relative to the largest value (absolute where ``want`` is all zero: no row arrived)."""
    want = want.detach()
    got = torch.zeros_like(want) if got is None else got.detach()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1.0 if not want.any() else 0.0))


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    config = MixtralConfig(hidden_size=HIDDEN, intermediate_size=24, num_local_experts=EXPERTS, num_experts_per_tok=K)
    torch.manual_seed(0)
    whole = MixtralExperts(config)
    for p in whole.parameters():
        torch.nn.init.normal_(p, std=0.2)
    sharded = MixtralExperts(config)
    for name, p in whole.named_parameters():
        shard = distribute_tensor(p.detach().clone(), mesh, [Shard(0)], src_data_rank=None)
        sharded.register_parameter(name, torch.nn.Parameter(shard))
    sharded.forward = ExpertParallel(sharded, mesh.get_group(), 2, rank).forward
    generator = torch.Generator().manual_seed(1)
    out = {}
    for label, index in routings(generator).items():
        hidden = torch.randn(2 * TOKENS, HIDDEN, generator=generator)
        weights = torch.rand(2 * TOKENS, K, generator=generator)
        upstream = torch.randn(2 * TOKENS, HIDDEN, generator=generator)      # d loss / d output
        mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
        x, w = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
        whole.zero_grad()
        want = grouped_mm_experts_forward(whole, x, index, w)
        (want * upstream).sum().backward()
        xs, ws = hidden[mine].clone().requires_grad_(), weights[mine].clone().requires_grad_()
        sharded.zero_grad()
        got = sharded(xs, index[mine], ws)
        (got * upstream[mine]).sum().backward()
        experts = slice(rank * EXPERTS // 2, (rank + 1) * EXPERTS // 2)
        out[label] = {
            "output": relative(got, want[mine]), "tokens": relative(xs.grad, x.grad[mine]),
            "routing weights": relative(ws.grad, w.grad[mine]),
            # rank r's experts got every rank's rows: their gradient is the whole batch's
            **{name: relative(p.grad.to_local() if p.grad is not None else None,
                              whole.get_parameter(name).grad[experts]) for name, p in sharded.named_parameters()},
            "rows received": int(sum(e in range(experts.start, experts.stop) for e in index.reshape(-1).tolist())),
        }
    gathered = [None, None]
    dist.all_gather_object(gathered, out)
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
