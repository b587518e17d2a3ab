"""Run by tests/test_vocab_loss.py under torchrun (2 CPU workers): the lean vocabulary-parallel cross-entropy
(``runtime.parallel.vocab_loss``) against torch's ``F.cross_entropy`` on the whole logits, and what its backward
allocates against torch's ``loss_parallel``. Writes ``<out>.<rank>.json``."""

import contextlib
import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils._python_dispatch import TorchDispatchMode

from tensoropt.runtime.parallel.vocab_loss import fused_loss
from tensoropt.runtime.run import Run

TOKENS, VOCAB, IGNORE = 24, 32, -1


class ShareSizedOutputs(TorchDispatchMode):
    """The new (not in-place, not view) outputs of the size of a rank's logit share, by dtype."""

    def __init__(self, share_numel: int):
        super().__init__()
        self.share_numel, self.made = share_numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name
        inplace = func._schema.is_mutable or name.endswith("_")
        made = _local(out)                   # a DTensor's ops run on its shard inside this call: their result
        if isinstance(made, torch.Tensor) and made.numel() == self.share_numel and not inplace and \
                not any(isinstance(a, torch.Tensor) and _local(a).untyped_storage().data_ptr() ==
                        made.untyped_storage().data_ptr() for a in args):
            self.made.append(f"{name}:{str(made.dtype).removeprefix('torch.')}")
        return out


def _local(t):
    return t._local_tensor if isinstance(t, DTensor) else t


def reference_inputs(dtype, reduction):
    """The compared logits (``dtype``), targets (every fifth ignored) and upstream gradient, and torch's loss on a
    float32 copy of the logits, not yet backpropagated: (whole, target, upstream, reference logits, expected)."""
    torch.manual_seed(1)
    whole = (3 * torch.randn(TOKENS, VOCAB)).to(dtype)
    target = torch.randint(0, VOCAB, (TOKENS,))
    target[::5] = IGNORE
    upstream = torch.rand(TOKENS) if reduction == "none" else torch.tensor(0.75)
    reference = whole.clone().requires_grad_()
    expected = F.cross_entropy(reference.float(), target, ignore_index=IGNORE, reduction=reduction)
    return whole, target, upstream, reference, expected


def case(mesh, dtype, reduction, lean: bool, through_module: bool) -> dict:
    """One comparison: loss and logit gradient, and the share-sized tensors the backward made."""
    whole, target, upstream, reference, expected = reference_inputs(dtype, reduction)
    expected.backward(upstream)

    logits = distribute_tensor(whole, mesh, [Shard(1)]).requires_grad_()
    with loss_parallel(), fused_loss() if lean else contextlib.nullcontext():
        if through_module:
            loss = torch.nn.CrossEntropyLoss(ignore_index=IGNORE, reduction=reduction)(logits, target)
        else:
            loss = F.cross_entropy(logits, target, ignore_index=IGNORE, reduction=reduction)
        watch = ShareSizedOutputs(TOKENS * VOCAB // 2)
        with watch:
            loss.backward(distribute_tensor(upstream, mesh, loss.placements))
        twice = ""
        try:
            loss.backward(distribute_tensor(upstream, mesh, loss.placements))
        except RuntimeError as exc:
            twice = str(exc)
    got_loss = loss.to_local()
    return {"loss_error": float((got_loss - expected.detach()).abs().max()),
            "loss_scale": float(expected.detach().abs().max()),
            "grad_error": float((logits.grad.full_tensor().float() - reference.grad.float()).abs().max()),
            "grad_scale": float(reference.grad.float().abs().max()), "grad_dtype": str(logits.grad.dtype),
            "made": watch.made, "twice": twice}


def main(out: str) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        for reduction in ("mean", "sum", "none"):
            for lean in (True, False):
                key = f"{str(dtype).removeprefix('torch.')}/{reduction}/{'lean' if lean else 'loss_parallel'}"
                results[key] = case(mesh, dtype, reduction, lean, through_module=False)
    results["module"] = case(mesh, torch.float32, "mean", True, through_module=True)
    with open(f"{out}.{dist.get_rank()}.json", "w") as f:
        json.dump(results, f)
    Run(rank=dist.get_rank(), world_size=2).close()


if __name__ == "__main__":
    main(sys.argv[1])
