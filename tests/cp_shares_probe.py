"""Run by tests/test_context_parallel.py under torchrun (2 CPU workers, cp 2): the built-in model's forward and
backward on each rank's share of the sequence, once with the runtime's saved-tensor hooks (the gathered keys and
values kept as the rank's share, gathered again in the backward) and once with autograd keeping them; rank 0
writes to the JSON file argv[1], per attention kind: the bytes autograd was handed to keep (an outer pair of hooks
sees every tensor, a gathered one as the share the runtime's pair passes on), the all-gathers in the forward and in
the backward, and whether every gradient is bitwise the same both ways."""

import contextlib
import dataclasses

import torch
import torch.distributed as dist
from probe_output import write_from_rank_0

from tensoropt.models import sequence
from tensoropt.models.transformer import DecoderLM, TransformerConfig
from tensoropt.runtime.parallel.context_parallel import install, shard_batch

SEQ, LAYERS = 64, 2
GATHERS = [0]
# the function tensoropt.collective_api calls on this torch (2.13 renamed it), counted by wrapping it
GATHER_NAME = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
_all_gather = getattr(dist, GATHER_NAME)


def counted_all_gather(*args, **kwargs):
    GATHERS[0] += 1
    return _all_gather(*args, **kwargs)


def step(model: DecoderLM, batch, shard) -> dict:
    """Forward and backward under ``shard``: kept bytes, gathers in each pass, the gradients."""
    sequence.use_shard(shard)
    kept = [0]

    def pack(t):
        kept[0] += t.nbytes
        return t
    model.zero_grad()
    GATHERS[0] = 0
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(*batch)
    forward = GATHERS[0]
    loss.backward()
    sequence.use_shard(None)
    return {"kept_bytes": kept[0], "forward_gathers": forward, "backward_gathers": GATHERS[0] - forward,
            "grads": [p.grad.clone() for p in model.parameters()]}


def main() -> None:
    dist.init_process_group("gloo")
    setattr(dist, GATHER_NAME, counted_all_gather)
    rank, out = dist.get_rank(), {}
    for attention in ("eager", "flash"):
        torch.manual_seed(0)
        cfg = TransformerConfig(hidden_size=32, num_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                ffn_hidden_size=64, seq_length=SEQ, vocab_size=50, attention=attention)
        model = DecoderLM(cfg)
        ids, labels = torch.randint(0, 50, (2, SEQ)), torch.randint(0, 50, (2, SEQ))
        batch = shard_batch((ids, labels), SEQ, 2, rank)
        shard = install(dist.group.WORLD, 2, rank, SEQ)
        shares = step(model, batch, shard)
        whole = step(model, batch, dataclasses.replace(shard, saving=contextlib.nullcontext))
        out[attention] = {"shares": {k: v for k, v in shares.items() if k != "grads"},
                          "whole": {k: v for k, v in whole.items() if k != "grads"},
                          "same_gradients": all(torch.equal(a, b) for a, b in zip(shares["grads"], whole["grads"])),
                          "kv_bytes_per_layer": 2 * 2 * 2 * SEQ * 8 * 4}     # K and V: batch, kv heads, seq, dim
    write_from_rank_0(out)


if __name__ == "__main__":
    main()
