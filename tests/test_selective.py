"""Selective recomputation in the torch engine (``runtime.selective``): one block copy keeps all autograd
saves but its attention core, which the cost model says it drops, and trains exactly as without it."""

import copy

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import tensoropt
from tensoropt.cost.model import ModelCost
from tensoropt.cost.profile import Cluster, load_profile
from tensoropt.models.transformer import DecoderLM, TransformerConfig
from tensoropt.runtime.selective import selective_wrapper
from tensoropt.space.plan import LayerStrategy

BATCH, SEQ = 2, 64


def _model(attention="eager", dropout=0.0) -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(TransformerConfig(hidden_size=64, num_layers=2, num_attention_heads=4, ffn_hidden_size=256,
                                       seq_length=SEQ, vocab_size=128, dropout=dropout, attention=attention))


class _Made(TorchDispatchMode):
    """Every storage an op makes, weakly held: after the forward, the live ones are what the graph keeps."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[StorageWeakRef, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.storages.setdefault(StorageWeakRef(storage), storage.nbytes())
        return out

    def live_bytes(self, *besides: torch.Tensor) -> int:
        held = {StorageWeakRef(t.untyped_storage()) for t in besides}
        return sum(n for ref, n in self.storages.items() if not ref.expired() and ref not in held)


def _run(block, x, mask, grad, seed=1):
    """(bytes the block's forward leaves for its backward, x's gradient, parameter gradients)."""
    x = x.detach().requires_grad_()
    torch.manual_seed(seed)
    with _Made() as made:
        out = block(x, mask)
    kept = made.live_bytes(out)
    out.backward(grad)
    return kept, x.grad, {n: p.grad for n, p in block.named_parameters()}


def _core_bytes(model: DecoderLM) -> float:
    """What the cost model says selective recomputation drops from one block copy at micro-batch BATCH."""
    ids = torch.zeros(1, SEQ, dtype=torch.long)
    graph = tensoropt.capture(model, (ids, ids), cache=False).graph
    [(_, cost)] = ModelCost(graph, tensoropt.fold(graph), Cluster(1, 1, load_profile("h100-80gb"))).blocks
    kept = {r: cost.layer(LayerStrategy(r), 1, (), BATCH).activation_bytes for r in ("none", "selective")}
    return kept["none"] - kept["selective"]


def test_selective_block_drops_exactly_the_attention_core_and_keeps_its_gradients():
    model = _model()
    block, mask = model.layers[0], model.causal_mask
    x, grad = torch.randn(BATCH, SEQ, 64), torch.randn(BATCH, SEQ, 64)
    plain_bytes, plain_dx, plain_grads = _run(block, x, mask, grad)
    wrapped = selective_wrapper(copy.deepcopy(block))
    selective_bytes, dx, grads = _run(wrapped, x, mask, grad)
    core = _core_bytes(model)
    assert core >= BATCH * 4 * SEQ * SEQ * 4                       # at least the softmax's probabilities
    assert plain_bytes - selective_bytes == pytest.approx(core, rel=0.03)
    assert torch.equal(dx, plain_dx)
    grads = {n.replace("_checkpoint_wrapped_module.", ""): g for n, g in grads.items()}
    assert grads.keys() == plain_grads.keys() and all(torch.equal(grads[n], plain_grads[n]) for n in grads)


def test_selective_block_replays_the_dropout_of_its_core():
    """Attention dropout draws random numbers in the core: the replay draws the same, so gradients are exact."""
    model = _model(dropout=0.1)
    block, mask = model.layers[0], model.causal_mask
    x, grad = torch.randn(BATCH, SEQ, 64), torch.randn(BATCH, SEQ, 64)
    _, plain_dx, plain_grads = _run(block, x, mask, grad)
    _, dx, grads = _run(selective_wrapper(copy.deepcopy(block)), x, mask, grad)
    assert torch.equal(dx, plain_dx)
    assert all(torch.equal(g, plain_grads[n.replace("_checkpoint_wrapped_module.", "")]) for n, g in grads.items())


def test_fused_attention_has_no_core_so_selective_keeps_everything():
    model = _model(attention="flash")
    block = model.layers[0]
    x, grad = torch.randn(BATCH, SEQ, 64), torch.randn(BATCH, SEQ, 64)
    plain_bytes, plain_dx, _ = _run(block, x, None, grad)
    selective_bytes, dx, _ = _run(selective_wrapper(copy.deepcopy(block)), x, None, grad)
    assert selective_bytes == plain_bytes and torch.equal(dx, plain_dx)
