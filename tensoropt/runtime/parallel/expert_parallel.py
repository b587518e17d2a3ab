"""Expert parallelism (``Plan.ep``) for the torch engine: the experts of every token-routed layer sharded over ``ep``
ranks taken from data parallelism, tokens sent to their experts' ranks and back by all-to-all.

Layout (Megatron-LM's "parallel folding", torchtitan's ``dp_shard_mod_ep x ep`` mesh): the engine's mesh is
``(edp, ep, tp)`` with ``dp = edp * ep``, so an ep group is ``ep`` consecutive data-parallel ranks (within a node).
Attention, norms, embeddings and the router keep data parallelism over all ``dp`` ranks (the mesh's ``edp`` and
``ep`` dims flattened); each rank holds ``E / ep`` experts (``Shard(0)`` DTensors on the ``ep`` dim, so
materialisation, ``full_state_dict`` and checkpoints see the whole (E, ...) tensor), replicated over the ``edp``
ranks that hold the same experts. Under tp > 1 the experts are also whole on every tp rank: each tp index runs its
own dispatch over the ep ranks of that index, on the same tokens (the stream is replicated over tp without sequence
parallelism), so the tp ranks compute the same expert outputs and gradients (tp times the expert work, no
reduction over tp).

Which modules: Hugging Face's experts classes (``transformers.integrations.moe.use_experts_implementation``:
Mixtral, Qwen3-MoE, DeepSeek, ...): ``forward(hidden (T, H), top_k_index (T, k), top_k_weights (T, k))`` with
stacked (E, out, in) weights (``is_transposed``: (E, in, out)). The router stays replicated: every rank routes its
own tokens. ``ExpertParallel.forward`` replaces the module's forward; the steps follow torchtitan's
``ExpertParallel`` (``torchtitan/distributed/expert_parallel.py``: ``_token_dispatch`` / ``_token_combine``) and
Megatron-LM's ``MoEAlltoAllTokenDispatcher`` (``megatron/core/transformer/moe/token_dispatcher.py``):

1. sort the (token, choice) rows by expert (so by owning rank), count rows per expert;
2. exchange the counts (one ``all_to_all_single`` of E integers) and read the splits on the host;
3. send the rows (``all_to_all_single`` with uneven splits, autograd-aware: its backward is the reverse exchange);
4. regroup what arrived from (source rank, local expert) order to (local expert, source rank) order and run the
   local experts with Hugging Face's own grouped kernel (``_grouped_linear``: ``torch.nn.functional.grouped_mm``,
   the kernel of ``grouped_mm_experts_forward``, the models' default), so every row meets the same kernel as alone;
5. undo the regrouping, send the rows back, weight them by ``top_k_weights`` and sum over k as
   ``grouped_mm_experts_forward`` does (``view(T, k, H).sum(1)``), so the losses are the script's alone.

Gradients (the reference loss is the mean over the global batch, ``L = (1/dp) sum_s L_s`` over the dp ranks' equal
shares): an expert weight on rank r gets, through the backward all-to-all, ``g_r = sum over the ranks s of its ep
group of dL_s/dW``; its replicas are one per ep group (the ``edp`` ranks), so ``sum over edp of g_r`` is
``sum over all s of dL_s/dW = dp * dL/dW``: expert gradients are summed over ``edp`` and divided by ``dp`` (not by
``edp``, what a data-parallel mean over the replicas would give). ZeRO 0: DDP ignores the experts' parameters and
``reduce_expert_gradients`` does that sum and division once per step before the optimizer step (one all-reduce per
dtype, as Megatron-LM's expert-data-parallel buckets). ZeRO 1-3: FSDP2 on each experts module over the ``edp`` dim
with ``set_gradient_divide_factor(dp)`` (torchtitan: ``experts.set_gradient_divide_factor``), reduced as a sum then
divided (``set_force_sum_reduction_for_comms``: gloo has no pre-multiplied sum; not over one rank, where torch 2.13
would divide twice), the rest over all ``dp`` ranks.

Checkpoints (``checkpoint.sharded``) need nothing more: torch.distributed.checkpoint stores each expert DTensor by
name as the whole (E, ...) tensor, so a run resumes under another ep or none (tests/test_expert_parallel.py: ep4
ZeRO 2 to ep2 ZeRO 0). The memory check's simulation (``memory.check``) runs on fake tensors, which carry no routing
counts to split by: there every rank's rows are spread evenly over the experts (``ExpertParallel._balanced``), the
routing the planner prices.

What a rank holds (against torchtitan's EP): expert weights, gradients and optimizer states ``/ ep`` (and ``/ edp``
more under ZeRO 3), as torchtitan; per layer in flight: the sorted rows (T k x H), the received rows, their
regrouped copy and the expert activations (each ~T k x H for balanced routing), the rows sent back and their
unpermuted copy: two more T k x H buffers than Hugging Face's forward alone (the dispatch's), as torchtitan's
(which also pads each expert's rows to an alignment). Not done: overlapping the all-to-all with compute, token
dropping / capacity, tp-sharded experts (torchtitan's ETP), sequence-parallel streams into the experts.
"""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from ...errors import TensorOptError
from ...space.plan import Plan


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The Hugging Face experts modules of ``model``, in model order: those the capture records for the planner
    (``graph.experts.experts_modules``), so that the plans it is offered shard what is found here."""
    from ...graph.experts import experts_modules as recorded
    return [(path, model.get_submodule(path)) for path in recorded(model)]


def check_plan(plan: Plan, engine: str, model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The experts modules an ep plan shards, after refusing in one line what expert parallelism does not run."""
    from ...models.transformer import MoE
    for what, refused in [("the DeepSpeed engine: launch with --engine torch", engine != "torch"),
                          ("pipeline stages: plan with --pp 1", plan.pp > 1),
                          ("context parallelism: plan with --cp 1", plan.cp > 1),
                          ("compiled blocks (data-dependent all-to-all splits): drop --compile", plan.compile),
                          ("sequence parallelism (the experts would see each tp rank's share of the tokens): plan "
                           "without sp", any(s.sequence_parallel for b in plan.blocks for s, _ in b.strategies))]:
        if refused:
            raise TensorOptError(f"plan {plan.summary()}: expert parallelism does not run with {what}")
    if any(isinstance(m, MoE) for m in model.modules()):
        raise TensorOptError("expert parallelism does not run tensoropt's DecoderLM MoE (top-1 with a capacity "
                             "computed from the tokens a rank holds): plan it with ep 1")
    found = experts_modules(model)
    if not found:
        raise TensorOptError(f"plan {plan.summary()} shards experts, but the model has no Hugging Face experts module "
                             "(use_experts_implementation): plan it with ep 1")
    for name, m in found:
        if m.num_experts % plan.ep:
            raise TensorOptError(f"{name} has {m.num_experts} experts, which do not split over ep {plan.ep}: plan an "
                                 f"ep that divides {m.num_experts}")
        if getattr(m, "has_post_expert_norm", False):
            raise TensorOptError(f"{name} normalises each expert's output (has_post_expert_norm), which expert "
                                 "parallelism does not shard: plan it with ep 1")
    return found


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows with uneven splits; backward: the same exchange reversed."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        import torch.distributed as dist
        ctx.splits, ctx.group = (in_splits, out_splits), group
        out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllToAll.apply(grad, *ctx.splits, ctx.group), None, None, None


def regroup_order(counts: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """For rows that arrived grouped (source rank, local expert), ``counts`` (ranks, local experts) rows each: the
    row order grouped (local expert, source rank) instead, each block's rows in their order. ``rows``: their number,
    where known (fake tensors carry no counts to size the result by)."""
    ranks, local = counts.shape
    block = torch.repeat_interleave(torch.arange(ranks * local, device=counts.device), counts.reshape(-1),
                                    output_size=rows)
    return torch.sort((block % local) * ranks + block // local, stable=True).indices


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    from torch.distributed.tensor import DTensor
    return t.to_local() if isinstance(t, DTensor) else t


class ExpertParallel:
    """An experts module's forward over ``group`` (its ep ranks; this rank holds experts
    ``[rank * local, (rank + 1) * local)``): module doc, steps 1-5."""

    def __init__(self, module: nn.Module, group, ep: int, rank: int) -> None:
        self.module, self.group, self.ep, self.rank = module, group, ep, rank
        self.local = module.num_experts // ep

    def _balanced(self, rows: int, device: torch.device) -> tuple[torch.Tensor, tuple[list[int], list[int]]]:
        """(rows received per (source rank, local expert), (rows received, rows sent) per rank) under balanced
        routing, which ``memory.check`` simulates as the planner prices it (``cost.layer``): each rank's ``rows``
        (tokens x top-k) spread evenly over the experts, the first ``rows % E`` experts one more."""
        experts = self.module.num_experts
        per_expert = [rows // experts + (e < rows % experts) for e in range(experts)]
        mine = per_expert[self.rank * self.local:(self.rank + 1) * self.local]
        sent = [sum(per_expert[r * self.local:(r + 1) * self.local]) for r in range(self.ep)]
        received = torch.tensor([mine] * self.ep, device=device)
        return received, ([sum(mine)] * self.ep, sent)

    def _linear(self, rows: torch.Tensor, weight: str, offsets: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        from transformers.integrations.moe import _grouped_linear
        m = self.module
        bias = _local(getattr(m, f"{weight}_bias"))[expert] if m.has_bias else None
        return _grouped_linear(rows, _local(getattr(m, weight)), offsets, bias=bias, is_transposed=m.is_transposed)

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist
        m, ep, local = self.module, self.ep, self.local
        tokens, k = top_k_index.shape
        experts = top_k_index.reshape(-1)
        order = torch.sort(experts, stable=True).indices                      # 1. rows by expert, so by rank
        rows = hidden[order // k]
        if is_fake(experts):             # the memory check's simulation: no counts, the planner's balanced routing
            received_counts, splits = self._balanced(tokens * k, hidden.device)
        else:
            counts = torch.bincount(experts, minlength=m.num_experts)
            received_counts = torch.empty_like(counts)                        # 2. (source rank, local expert)
            dist.all_to_all_single(received_counts, counts, group=self.group)
            received_counts = received_counts.view(ep, local)
            splits = received_counts.sum(1).tolist(), counts.view(ep, local).sum(1).tolist()
        received = _AllToAll.apply(rows, *splits, self.group)                 # 3. rows to their experts' ranks
        total = sum(splits[0])
        regroup = regroup_order(received_counts, total)                       # 4. (local expert, source rank)
        per_expert = received_counts.sum(0)
        offsets = torch.cumsum(per_expert, 0, dtype=torch.int32)
        expert = torch.repeat_interleave(torch.arange(local, device=hidden.device), per_expert, output_size=total)
        x = received[regroup]
        if m.has_gate:
            x = m._apply_gate(self._linear(x, "gate_up_proj", offsets, expert))
        else:
            x = m.act_fn(self._linear(x, "up_proj", offsets, expert))
        x = self._linear(x, "down_proj", offsets, expert)
        back = torch.empty_like(regroup)                                      # 5. undo, send back, combine
        back[regroup] = torch.arange(regroup.numel(), device=regroup.device)
        out = _AllToAll.apply(x[back], *reversed(splits), self.group)
        weighted = out * top_k_weights.reshape(-1)[order].unsqueeze(-1)
        unsort = torch.empty_like(order)
        unsort[order] = torch.arange(order.numel(), device=order.device)
        return weighted[unsort].view(tokens, k, -1).sum(dim=1).to(hidden.dtype)


def shard_experts(model: nn.Module, plan: Plan, ep_mesh, engine: str = "torch") -> list[nn.Module]:
    """Keep this rank's ``E / ep`` experts of every experts module (``Shard(0)`` DTensors over ``ep_mesh``, on the
    meta device too: materialisation then gives each rank its slice of the values the script alone would have) and
    run their forward over the ep group; returns the modules."""
    from torch.distributed.tensor import Shard, distribute_tensor
    found = check_plan(plan, engine, model)
    group, rank = ep_mesh.get_group(), ep_mesh.get_local_rank()
    for _, module in found:
        for name, param in list(module.named_parameters(recurse=False)):   # one slice per expert (graph.experts)
            shard = distribute_tensor(param.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
            module.register_parameter(name, nn.Parameter(shard, requires_grad=param.requires_grad))
        module.forward = ExpertParallel(module, group, plan.ep, rank).forward
    return [m for _, m in found]


def expert_parameters(modules: list[nn.Module]) -> list[nn.Parameter]:
    return [p for m in modules for p in m.parameters()]


def ignore_in_ddp(model: nn.Module, modules: list[nn.Module]) -> None:
    """Keep DDP (ZeRO 0) away from the experts' parameters: their gradients are reduced over ``edp`` only
    (``reduce_expert_gradients``)."""
    from torch.nn.parallel.distributed import DistributedDataParallel  # the class itself (the memory check stands
    ids = {id(p) for p in expert_parameters(modules)}                    # another in for nn.parallel's name)
    names = [n for n, p in model.named_parameters() if id(p) in ids]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)


def reduce_expert_gradients(params: list[nn.Parameter], edp_group, dp: int) -> None:
    """ZeRO 0: every expert gradient summed over the ``edp`` ranks that hold the same experts and divided by ``dp``
    (module doc: the single process's gradient of the global batch's mean loss); one all-reduce per dtype."""
    import torch.distributed as dist
    buckets: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            local = _local(p.grad)
            buckets.setdefault(local.dtype, []).append(local)
    for grads in buckets.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        if dist.get_world_size(edp_group) > 1:
            dist.all_reduce(flat, group=edp_group)
        flat /= dp
        for g, summed in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(summed.view_as(g))


def reduce_before_step(optimizer: torch.optim.Optimizer, modules: list[nn.Module], edp_group, dp: int) -> None:
    """Run ``reduce_expert_gradients`` once per step, after the last micro-batch's backward (an optimizer step
    pre-hook: whatever the number of micro-batches, the gradients are whole by then)."""
    params = expert_parameters(modules)
    optimizer.register_step_pre_hook(
        lambda _opt, _args, _kwargs: reduce_expert_gradients(params, edp_group, dp))


def shard_experts_fsdp(modules: list[nn.Module], plan: Plan, edp_mesh) -> None:
    """ZeRO 1-3: FSDP2 on each experts module over the ``edp`` ranks, its gradients summed and divided by ``dp``
    (module doc), before the blocks and the root take the rest over all ``dp`` ranks
    (``data_parallel.shard``)."""
    from torch.distributed.fsdp import fully_shard

    from ..engines.precision import fsdp_kwargs
    from ..engines.precision_names import of_plan
    precision = fsdp_kwargs(of_plan(plan), plan.grad_dtype)
    for module in modules:
        fully_shard(module, mesh=edp_mesh, reshard_after_forward=plan.zero == 3, **precision)
        module.set_gradient_divide_factor(float(plan.dp))
        # over one rank FSDP2 divides the copy by the factor and then post-divides by it again under a forced sum
        # (torch 2.13 ``foreach_reduce``): the forced sum only where there is a reduce-scatter
        module.set_force_sum_reduction_for_comms(edp_mesh.size() > 1)


__all__ = ["ExpertParallel", "check_plan", "experts_modules", "ignore_in_ddp", "reduce_before_step",
           "reduce_expert_gradients", "regroup_order", "shard_experts", "shard_experts_fsdp"]
