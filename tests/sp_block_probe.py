"""Run by tests/test_sequence_parallel.py under torchrun (2 CPU workers): one block copy of the built-in model,
whole, tensor-parallel and sequence-parallel; rank 0 writes what it measured to the JSON file argv[1]."""

import copy
import gc
import weakref

import torch
import torch.distributed as dist
from probe_output import write_from_rank_0
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tensoropt.errors import TensorOptError
from tensoropt.models.transformer import DecoderLM, TransformerConfig
from tensoropt.runtime.engines.param_groups import build_optimizer
from tensoropt.runtime.memory.selective import selective_wrapper
from tensoropt.runtime.parallel.tp_guard import _check_sequence_parallel
from tensoropt.runtime.parallel.tp_styles import shard_copy
from tensoropt.space.run_plan import TPBranch

LAYOUT = (TPBranch("attn", ("attn.qkv",), ("attn.proj",), 4), TPBranch("mlp", ("mlp.up",), ("mlp.down",), 64))
BATCH, SEQ, HIDDEN = 2, 32, 64


def local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class Made(TorchDispatchMode):
    """The storages of every tensor made while it is on, in order (a storage freed and another made at its address
    is another one)."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: list[tuple[StorageWeakRef, int]] = []
        self._by_address: dict[int, StorageWeakRef] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = local(t).untyped_storage()
                ref = StorageWeakRef(storage)
                known = self._by_address.get(ref.cdata)
                if known is None or known.expired():
                    self._by_address[ref.cdata] = ref
                    self.storages.append((ref, storage.nbytes()))
        return out

    def live_bytes(self, besides: set, since: int = 0) -> int:
        return sum(n for ref, n in self.storages[since:] if not ref.expired() and ref not in besides)


# What a forward leaves alive is read READINGS times, each after a forward of its own, and the least reading kept: a
# tensor the forward no longer holds can outlive it by a moment, held by a collective's work (gloo's worker thread
# marks a work done before it drops it; seen in loaded CI runs even after 16 barriers, and after one barrier on a
# one-thread group: an all_reduce's output, about 1 reading in 500, gone 0.4 s later). A late release only adds
# bytes, and nothing the backward needs is ever below what autograd holds, so the least of three is the truth unless
# all three were late.
READINGS = 3


def kept_bytes(block, x: torch.Tensor, mask) -> int:
    """Bytes the forward leaves alive for the backward (its output, input and parameters not counted)."""
    return min(_kept_once(block, x, mask) for _ in range(READINGS))


def _kept_once(block, x: torch.Tensor, mask) -> int:
    held = {StorageWeakRef(local(p).untyped_storage()) for p in block.parameters()}
    with Made() as made:
        y = block(x, mask)
    held |= {StorageWeakRef(local(y).untyped_storage()), StorageWeakRef(x.untyped_storage())}
    return settled(lambda: made.live_bytes(held))


def settled(live_bytes) -> int:
    """The live bytes once reference cycles are collected and the collectives queued before a few barriers (the same
    number on every rank) are done."""
    gc.collect()
    for _ in range(4):
        dist.barrier()
    return live_bytes()


def recomputed_bytes(block, x: torch.Tensor, mask, grad: torch.Tensor) -> int:
    """Bytes a fully recomputed copy's recomputation in the backward holds for the rest of that backward (the
    tensors it saves; its output, input and parameters not counted), read where its forward ends; the recomputation
    runs to its end (no early stop), so that nothing a stopping exception holds is counted. The least of READINGS
    backwards."""
    return min(_recomputed_once(block, x, mask, grad) for _ in range(READINGS))


def _recomputed_once(block, x: torch.Tensor, mask, grad: torch.Tensor) -> int:
    inner, made, seen = block._checkpoint_wrapped_module, Made(), {}

    def start(_module, _args):
        if torch._C._current_graph_task_id() != -1:             # the recomputation, in the backward
            seen["from"] = len(made.storages)

    def end(_module, _args, output):
        if "from" in seen:
            held = {StorageWeakRef(local(t).untyped_storage()) for t in (output, x, *inner.parameters())}
            seen["bytes"] = settled(lambda: made.live_bytes(held, seen["from"]))
    hooks = (inner.register_forward_pre_hook(start, prepend=True), inner.register_forward_hook(end, always_call=True))
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        y = block(x, mask)
    with made:
        y.backward(grad)
    for hook in hooks:
        hook.remove()
    return seen["bytes"]


def keeping_whole(block):
    """The reference the share-keeping copies must match bitwise: an identity pair of saved-tensor hooks entered
    inside the copy's forward, after sequence parallelism's, shadows it, so autograd keeps every saved tensor as it
    is (the gathered inputs whole, as SP copies did under recomputation before)."""
    pairs = []

    def enter(_module, _args):
        pairs.append(torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
        pairs[-1].__enter__()

    def leave(_module, _args, _output):
        pairs.pop().__exit__(None, None, None)
    block.register_forward_pre_hook(enter)
    block.register_forward_hook(leave, prepend=True, always_call=True)
    return block


def gradients(block, x, mask, grad) -> list[torch.Tensor]:
    x = x.detach().requires_grad_()
    y = block(x, mask)
    y.backward(grad)
    params = sorted((n.replace("_checkpoint_wrapped_module.", ""), p) for n, p in block.named_parameters())
    return [y.detach(), x.grad] + [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for _, p in params]


def optimizer_collectives(mesh) -> dict:
    """Collectives of an AdamW step of a 3-copy SP GPT (its norms' gradients partial sums over tp), with the
    optimizer as the engine builds it (``param_groups.build_optimizer``: those summed once, in one bucket) and as the
    script alone builds it (DTensor sums a partial gradient where AdamW reads it); and whether both give the same
    parameters, bitwise."""
    torch.manual_seed(0)
    model = DecoderLM(TransformerConfig(hidden_size=HIDDEN, num_layers=3, num_attention_heads=4, ffn_hidden_size=256,
                                        seq_length=SEQ, vocab_size=128))
    relay: dict = {}
    for i, layer in enumerate(model.layers):
        shard_copy(layer, LAYOUT, mesh, LAYOUT, f"layers.{i}", (i > 0, i < 2), relay)
    ids = torch.randint(0, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    out, params = {}, {}
    for how in ("engine", "plain"):
        run = copy.deepcopy(model)
        make = lambda p: torch.optim.AdamW(p, lr=1e-2)  # noqa: E731
        optimizer = build_optimizer(make, run.parameters()) if how == "engine" else make(run.parameters())
        for _ in range(2):
            optimizer.zero_grad(set_to_none=True)
            run(ids, ids).backward()
            out["partial_gradients"] = sum(isinstance(p.grad, DTensor) and p.grad.placements[0].is_partial()
                                           for p in run.parameters())
            with CommDebugMode() as comm:
                optimizer.step()
        out[how] = {str(op): n for op, n in comm.get_comm_counts().items() if n}
        params[how] = [p.full_tensor() if isinstance(p, DTensor) else p for p in run.parameters()]
    out["same_parameters"] = all(torch.equal(a, b) for a, b in zip(params["engine"], params["plain"]))
    return out


class _Concatenations(TorchDispatchMode):
    """Every concatenation into a tensor of ``numel`` elements (a whole stream: the chunks of a reduce-scatter's
    input put rank by rank)."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.seen = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.cat.default and out.numel() == self.numel:
            self.seen.append(("concatenate", True, out.numel() * out.element_size()))
        return out


def layout_copies(block, mesh, rank: int, batch: int) -> dict:
    """The layout copies made in one forward and backward of an SP copy (both branches sharded, its stream arriving
    and leaving as the rank's share): each call of torch's helpers that move the ranks' shares between dim 0 and the
    sequence dim (``_maybe_view_chunk_cat`` after an all-gather, ``_chunk_or_narrow_cat`` before a reduce-scatter),
    with whether it made a new tensor, and its bytes; and every concatenation of a whole stream (the runtime's own
    reduce-scatter inputs past batch 1)."""
    import torch.distributed._functional_collectives as funcol
    seen: list[tuple[str, bool, int]] = []
    originals = funcol._maybe_view_chunk_cat, funcol._chunk_or_narrow_cat

    def gathered(res, group_size, gather_dim):
        if isinstance(res, funcol.AsyncCollectiveTensor):
            res = res.wait()        # the gathered tensor itself (funcol may hand on its wrapper where a view will do)
        out = originals[0](res, group_size, gather_dim)
        seen.append(("all_gather", out.untyped_storage().data_ptr() != res.untyped_storage().data_ptr(),
                     out.numel() * out.element_size()))
        return out

    def scattered(tensor, num_chunks, narrow_dim, cat_dim=0):
        out = originals[1](tensor, num_chunks, narrow_dim, cat_dim)
        seen.append(("reduce_scatter", out.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr(),
                     out.numel() * out.element_size()))
        return out

    x = torch.randn(batch, SEQ, HIDDEN, generator=torch.Generator().manual_seed(2))
    share = x[:, rank * SEQ // 2:(rank + 1) * SEQ // 2].contiguous().requires_grad_()
    sp = copy.deepcopy(block)
    shard_copy(sp, LAYOUT, mesh, LAYOUT, "layers.1", (True, True), {id(share): weakref.ref(share)})
    funcol._maybe_view_chunk_cat, funcol._chunk_or_narrow_cat = gathered, scattered
    concatenations = _Concatenations(x.numel())
    try:
        with concatenations:
            y = sp(share, None)
            local(y).backward(torch.ones_like(local(y)))
    finally:
        funcol._maybe_view_chunk_cat, funcol._chunk_or_narrow_cat = originals
    counts: dict = {}
    for kind, copied, nbytes in seen + concatenations.seen:
        key = f"{kind} {'copy' if copied else 'view'} {nbytes}"
        counts[key] = counts.get(key, 0) + 1
    return counts


def in_place(block, mesh, rank: int, batch: int) -> dict:
    """An eager SP copy's collectives run per sample on views (``runtime.parallel.sequence_collectives``): its output
    and its input's and parameters' gradients against the whole copy's (max difference), and against the same SP copy
    run through torch's own redistribution (bitwise)."""
    from tensoropt.runtime.parallel import sequence_collectives
    x = torch.randn(batch, SEQ, HIDDEN, generator=torch.Generator().manual_seed(4))
    grad = torch.randn(batch, SEQ, HIDDEN, generator=torch.Generator().manual_seed(5))
    part = slice(rank * SEQ // 2, (rank + 1) * SEQ // 2)

    def run(views: bool) -> list[torch.Tensor]:
        share = x[:, part].contiguous().requires_grad_()
        sp = copy.deepcopy(block)
        shard_copy(sp, LAYOUT, mesh, LAYOUT, "layers.1", (True, True), {id(share): weakref.ref(share)})
        original = sequence_collectives.runs_in_place
        sequence_collectives.runs_in_place = original if views else (lambda t: False)
        try:
            y = local(sp(share, None))
            y.backward(grad[:, part].contiguous())
        finally:
            sequence_collectives.runs_in_place = original
        params = sorted((n, p) for n, p in sp.named_parameters())
        return [y.detach(), share.grad] + [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                                           for _, p in params]

    ours, torchs = run(True), run(False)
    whole = copy.deepcopy(block)
    xw = x.clone().requires_grad_()
    yw = whole(xw, None)
    yw.backward(grad)
    reference = [yw.detach()[:, part], xw.grad[:, part]] + [p.grad for _, p in sorted(whole.named_parameters())]
    return {"max_difference": max(float((a - b).abs().max()) for a, b in zip(ours, reference)),
            "bitwise_torchs_path": all(torch.equal(a, b) for a, b in zip(ours, torchs))}


def reduce_copies(block, mesh) -> dict:
    """The all-reduces of one forward and backward of a tensor-parallel copy without sequence parallelism (both
    branches sharded): torch's functional ones, with whether each wrote into a new tensor, and c10d's in-place ones,
    with their bytes; and how far the input's gradient is from the whole block's."""
    import torch.distributed._functional_collectives as funcol
    seen: dict = {}
    original, in_place = funcol.all_reduce, dist.all_reduce

    def reduced(tensor, *args, **kwargs):
        out = original(tensor, *args, **kwargs)
        made = out.wait() if isinstance(out, funcol.AsyncCollectiveTensor) else out
        copied = made.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()
        key = f"all_reduce {'copy' if copied else 'in place'} {made.numel() * made.element_size()}"
        seen[key] = seen.get(key, 0) + 1
        return out

    def reduced_in_place(tensor, *args, **kwargs):
        key = f"c10d all_reduce {tensor.numel() * tensor.element_size()}"
        seen[key] = seen.get(key, 0) + 1
        return in_place(tensor, *args, **kwargs)

    tp = copy.deepcopy(block)
    shard_copy(tp, LAYOUT, mesh)
    x = torch.randn(BATCH, SEQ, HIDDEN, generator=torch.Generator().manual_seed(3), requires_grad=True)
    funcol.all_reduce, dist.all_reduce = reduced, reduced_in_place
    try:
        y = tp(x, None)
        local(y).backward(torch.ones_like(local(y)))
    finally:
        funcol.all_reduce, dist.all_reduce = original, in_place
    whole_x = x.detach().clone().requires_grad_(True)
    block(whole_x, None).backward(torch.ones_like(local(y)))
    return {"collectives": seen, "grad_difference": float((x.grad - whole_x.grad).abs().max()),
            "grad_scale": float(whole_x.grad.abs().max())}


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
    # what exists now (the imports: torch, and in the suite's warm-started processes transformers, DeepSpeed and
    # inductor too) is never garbage: out of the collector's reach, each of the 30 gc.collect() calls of ``settled``
    # scans only what the probe made since (0.28 s a call otherwise, 40% of the probe's CPU)
    gc.collect()
    gc.freeze()
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    out = {}
    rank = dist.get_rank()
    for attention in ("flash", "eager"):
        model = DecoderLM(TransformerConfig(hidden_size=HIDDEN, num_layers=1, num_attention_heads=4,
                                            ffn_hidden_size=256, seq_length=SEQ, vocab_size=128, attention=attention))
        block, mask = model.layers[0], getattr(model, "causal_mask", None)
        x, grad = torch.randn(BATCH, SEQ, HIDDEN), torch.randn(BATCH, SEQ, HIDDEN)
        # activations: copies between two SP copies, so that their stream arrives as a share and leaves as one
        share, grad_share = (t[:, rank * SEQ // 2:(rank + 1) * SEQ // 2].contiguous() for t in (x, grad))
        tp = copy.deepcopy(block)
        shard_copy(tp, LAYOUT, mesh)
        kept = {"tp": kept_bytes(tp, x, mask)}
        for wrap in (None, checkpoint_wrapper, selective_wrapper):
            sp = copy.deepcopy(block)
            shard_copy(sp, LAYOUT, mesh, LAYOUT, "layers.1", (True, True), {id(share): weakref.ref(share)})
            kept[wrap.__name__ if wrap else "none"] = kept_bytes(wrap(sp) if wrap else sp, share, mask)
        sp = copy.deepcopy(block)
        shard_copy(sp, LAYOUT, mesh, LAYOUT, "layers.1", (True, True), {id(share): weakref.ref(share)})
        kept["recomputed"] = recomputed_bytes(checkpoint_wrapper(sp), share, mask, grad_share)
        out.setdefault("kept_bytes", {})[attention] = kept
        whole = gradients(copy.deepcopy(block), x, mask, grad)
        for branches in (LAYOUT, LAYOUT[1:]):
            reference = copy.deepcopy(block)
            shard_copy(reference, branches, mesh, LAYOUT, "layers.0", (False, False))
            reference = gradients(keeping_whole(reference), x, mask, grad)
            for wrap in (None, checkpoint_wrapper, selective_wrapper):
                sp = copy.deepcopy(block)
                shard_copy(sp, branches, mesh, LAYOUT, "layers.0", (False, False))
                got = gradients(wrap(sp) if wrap else sp, x, mask, grad)
                key = f"{attention} {'+'.join(b.branch for b in branches)} {wrap.__name__ if wrap else 'none'}"
                out.setdefault("max_difference", {})[key] = max(float((a - b).abs().max()) for a, b in zip(got, whole))
                out.setdefault("equal_to_keeping_whole", {})[key] = all(torch.equal(a, b)
                                                                        for a, b in zip(got, reference))
    out["optimizer_collectives"] = optimizer_collectives(mesh)
    model = DecoderLM(TransformerConfig(hidden_size=HIDDEN, num_layers=1, num_attention_heads=4, ffn_hidden_size=256,
                                        seq_length=SEQ, vocab_size=128, attention="flash"))
    out["layout_copies"] = {batch: layout_copies(model.layers[0], mesh, rank, batch) for batch in (1, BATCH)}
    out["reduce_copies"] = reduce_copies(model.layers[0], mesh)
    out["in_place"] = {batch: in_place(model.layers[0], mesh, rank, batch) for batch in (1, BATCH)}
    try:
        layout = (TPBranch("mlp", ("up",), ("down",), 64),)
        _check_sequence_parallel(MixesPositions(), "mixes.0", layout, layout, mesh, (torch.randn(2, SEQ, HIDDEN),), {})
        out["refused"] = None
    except TensorOptError as exc:
        out["refused"] = str(exc)
    write_from_rank_0(out)


if __name__ == "__main__":
    main()
