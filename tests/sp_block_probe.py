"""Run by tests/test_sequence_parallel.py under torchrun (2 CPU workers): one block copy of the built-in model,
whole, tensor-parallel and sequence-parallel; rank 0 writes what it measured to the JSON file argv[1]."""

import copy
import json
import sys
import weakref

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tensoropt.errors import TensorOptError
from tensoropt.models.transformer import DecoderLM, TransformerConfig
from tensoropt.runtime.selective import selective_wrapper
from tensoropt.runtime.tp_guard import _check_sequence_parallel
from tensoropt.runtime.tp_styles import shard_copy
from tensoropt.space.run_plan import TPBranch

LAYOUT = (TPBranch("attn", ("attn.qkv",), ("attn.proj",), 4), TPBranch("mlp", ("mlp.up",), ("mlp.down",), 64))
BATCH, SEQ, HIDDEN = 2, 32, 64


def local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class Made(TorchDispatchMode):
    """The storages of every tensor made while it is on."""

    def __init__(self) -> None:
        super().__init__()
        self.storages = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = local(t).untyped_storage()
                self.storages.setdefault(StorageWeakRef(storage), storage.nbytes())
        return out


def kept_bytes(block, x: torch.Tensor) -> int:
    """Bytes the forward leaves alive for the backward (its output, input and parameters not counted)."""
    held = {StorageWeakRef(local(p).untyped_storage()) for p in block.parameters()}
    with Made() as made:
        y = block(x, None)
    held |= {StorageWeakRef(local(y).untyped_storage()), StorageWeakRef(x.untyped_storage())}
    return sum(n for ref, n in made.storages.items() if not ref.expired() and ref not in held)


def gradients(block, x, mask, grad) -> list[torch.Tensor]:
    x = x.detach().requires_grad_()
    y = block(x, mask)
    y.backward(grad)
    params = sorted((n.replace("_checkpoint_wrapped_module.", ""), p) for n, p in block.named_parameters())
    return [y.detach(), x.grad] + [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for _, p in params]


class MixesPositions(torch.nn.Module):
    """A pre-norm block whose stream, outside its branch, takes a running mean over the sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = torch.nn.LayerNorm(HIDDEN), torch.nn.Linear(HIDDEN, 128), \
            torch.nn.Linear(128, HIDDEN)

    def forward(self, x, mask=None):
        x = x + self.down(torch.relu(self.up(self.norm(x))))
        return x.cumsum(1) / torch.arange(1, x.shape[1] + 1).view(1, -1, 1)


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    out = {}
    for attention in ("flash", "eager"):
        model = DecoderLM(TransformerConfig(hidden_size=HIDDEN, num_layers=1, num_attention_heads=4,
                                            ffn_hidden_size=256, seq_length=SEQ, vocab_size=128, attention=attention))
        block, mask = model.layers[0], getattr(model, "causal_mask", None)
        x, grad = torch.randn(BATCH, SEQ, HIDDEN), torch.randn(BATCH, SEQ, HIDDEN)
        if attention == "flash":      # activations: a copy between two SP copies, so its stream arrives as a share
            tp = copy.deepcopy(block)
            shard_copy(tp, LAYOUT, mesh)
            sp = copy.deepcopy(block)
            share = x[:, dist.get_rank() * SEQ // 2:(dist.get_rank() + 1) * SEQ // 2].contiguous()
            shard_copy(sp, LAYOUT, mesh, LAYOUT, "layers.1", (True, True, True), {id(share): weakref.ref(share)})
            out["kept_bytes"] = {"tp": kept_bytes(tp, x), "sp": kept_bytes(sp, share)}
        whole = gradients(copy.deepcopy(block), x, mask, grad)
        for branches in (LAYOUT, LAYOUT[1:]):
            for wrap in (None, checkpoint_wrapper, selective_wrapper):
                sp = copy.deepcopy(block)
                shard_copy(sp, branches, mesh, LAYOUT, "layers.0", (False, False, wrap is None))
                got = gradients(wrap(sp) if wrap else sp, x, mask, grad)
                key = f"{attention} {'+'.join(b.branch for b in branches)} {wrap.__name__ if wrap else 'none'}"
                out.setdefault("max_difference", {})[key] = max(float((a - b).abs().max()) for a, b in zip(got, whole))
    try:
        layout = (TPBranch("mlp", ("up",), ("down",), 64),)
        _check_sequence_parallel(MixesPositions(), "mixes.0", layout, layout, mesh, (torch.randn(2, SEQ, HIDDEN),), {})
        out["refused"] = None
    except TensorOptError as exc:
        out["refused"] = str(exc)
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
