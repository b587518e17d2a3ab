"""How a published training row (``benchmarks/data/public_h100.json``) becomes what ``public_h100.py`` prices: which
rows can be priced and why not, the family a row belongs to, the hardware profile it ran on, the model shape it
trained (as a model JSON) and the plan it ran (mesh, micro-batches, recomputation, precision, engine, kernels), and
its measured step time. Split from ``public_h100.py``, which prices the rows and writes the tables."""

from __future__ import annotations

import dataclasses

import numpy as np

from tensoropt.cost.comm import all_gather_s
from tensoropt.cost.layer import LooseOps
from tensoropt.cost.model import ModelCost
from tensoropt.cost.ops import op_times
from tensoropt.cost.tp_copies import copy_s
from tensoropt.graph.ir import dtype_bytes
from tensoropt.space.plan import BlockPlan, LayerStrategy, Plan
from tensoropt.space.vocab import CASTS

# torchtitan's H100s (Grand Teton: 96 GB HBM2e, 500 W cap) are another part than the 700 W SXM5 80 GB HBM3 of
# DGX H100 that Megatron-LM's, fms-fsdp's and FlagPerf's rows ran on, and KempnerForge's ran on H200s; each row is
# priced on its own hardware's profile
PROFILES = {"torchtitan": "h100-96gb-500w", "h200": "h200-141gb-4gpu", "a100": "a100-80gb", "other": "h100-80gb"}
# the profiles whose constants the fits choose (the committed ones were chosen on these rows); rows on others
# enter no fit and are priced on their profile as committed
FITTED_PROFILES = ("h100-80gb", "h100-96gb-500w")
GPUS_PER_NODE = 8                        # unless a row says otherwise (KempnerForge's nodes hold 4 H200s)
ONE_H100 = "one H100 (eager torch / DeepSpeed)"
TORCH_3D = "fsdp+tp+pp-eager"
# one process on one GPU, the Hugging Face model trained in bf16 by torch.optim.AdamW; which H100 (SXM, PCIe, NVL)
# and what its "Sec/step" times are not stated: priced and shown, never fitted on
ONE_GPU_PUBLIC = ("universal_llm_trainer_gpu_test",)
ONE_GPU_UNFITTED = "one H100, Hugging Face (part and timing unstated; not fitted)"
A100_EAGER = "fsdp-zero3-eager on A100s (not fitted)"
# KempnerForge's compiled runs on 1 to 32 H200s (torch.compile of the whole model), without and with tensor
# parallelism: two families, since the prices miss them in opposite directions
H200_COMPILED = "compiled, one GPU or FSDP2, on H200s (not fitted)"
H200_COMPILED_TP = "compiled, TP (+ FSDP2), on H200s, nodes of 4 (not fitted)"
FAMILIES = ("megatron-3d-fused", "fsdp-zero3-eager", "fsdp-zero3-compiled", "deepspeed-zero3-eager", TORCH_3D,
            ONE_H100, ONE_GPU_UNFITTED, A100_EAGER, H200_COMPILED, H200_COMPILED_TP)
FSDP_ZERO3 = ("fsdp-zero3-eager", "fsdp-zero3-compiled")
OWN = "tensoropt_issue12_h100"           # this project's own two single-H100 runs (issue 12), not a public source
# Megatron-LM runs: fused kernels (priced as compiled blocks), bf16 with float32 main weights, distributed optimizer
MEGATRON = ("megatron_lm_readme_h100", "flagperf_megatron_llama3")
# sources whose rows state every shape switch (issue 35's additions), captured as stated
OWN_SHAPE = ("kempnerforge_mfu_scaling", "kempnerforge_config_validation", "universal_llm_trainer_gpu_test",
             "flagperf_megatron_llama3", "flagperf_deepspeed_chatglm3_6b")


def why_not(row: dict) -> str:
    """Why a row cannot be priced (empty: it can)."""
    p = row["parallelism"]
    if not any(part in row["gpu"] for part in ("H100", "H200", "A100-80GB")):
        return f"not an H100, H200 or A100 80GB ({row['gpu']})"
    if "float8" in row["dtype"]:
        return "float8 matmuls (no float8 peak or kernels in the cost model)"
    if (p.get("cp") or 1) > 1:
        return "context parallelism"
    if p.get("async_tp") or "asynctp" in (row.get("technique") or "").lower().replace(" ", ""):
        return "async tensor parallelism (collective matmuls, not modelled)"
    return ""


def family(row: dict) -> str:
    if row["source"] == OWN:
        return ONE_H100
    if row["source"] in ONE_GPU_PUBLIC:
        return ONE_GPU_UNFITTED
    if row["source"] in MEGATRON:
        return "megatron-3d-fused"
    if "A100" in row["gpu"]:
        return A100_EAGER
    if row.get("engine") == "deepspeed":
        return "deepspeed-zero3-eager"
    if (row["parallelism"]["pp"] or 1) > 1:
        return TORCH_3D
    if "H200" in row["gpu"] and compiled(row):
        return H200_COMPILED_TP if (row["parallelism"]["tp"] or 1) > 1 else H200_COMPILED
    return "fsdp-zero3-compiled" if compiled(row) else "fsdp-zero3-eager"


def compiled(row: dict) -> bool:
    """Whether the run's kernels are fused: Megatron-LM's fused kernels (priced as compiled blocks), or
    torch.compile. The 405B bf16 row of docs/performance.md does not say; its train config at that commit
    compiles by default (the data file's note)."""
    return row["source"] in MEGATRON or row["compile"] is not False


def model_config(row: dict) -> dict:
    m = row["model"]
    sizes = {"hidden_size": m["hidden"], "num_layers": m["layers"], "num_attention_heads": m["heads"],
             "ffn_hidden_size": m["ffn"], "seq_length": row["seq_len"], "vocab_size": m["vocab"]}
    llama = {"num_key_value_heads": m["kv_heads"], "rope_theta": 500000.0 if m["vocab"] == 128256 else 10000.0}
    if row["source"] in OWN_SHAPE:
        # the row's own shape (FlagPerf's Megatron runs: learned positions, tied
        # embeddings and linear biases, by Megatron's defaults), fused (flash / SDPA) attention
        return {"family": "llama" if m["arch"] == "llama" else "gpt", **sizes, **llama, "norm": m["norm"],
                "activation": m["activation"], "position": m["position"], "bias": m["bias"],
                "tie_embeddings": m["tied_embeddings"], "attention": "flash", "dropout": 0.0}
    if m["arch"] == "llama":
        return {"family": "llama", **sizes, **llama}
    if row["source"] == OWN:
        # tensoropt's gpt family as it ran at f8f685f (TransformerConfig defaults): LayerNorm, GELU, biases, learned
        # positions, tied embeddings, explicit-softmax ("eager") attention; dropout 0 (the data file's note)
        return {"family": "gpt", **sizes, "dropout": m["dropout"], "tie_embeddings": m["tied_embeddings"],
                "attention": m["attention"]}
    # Megatron GPT: LayerNorm, GeLU, biases, untied embeddings (the README's sizes match 12 L h^2 + 2 V h), fused
    # (flash) attention; dropout and position embedding not stated: none, learned
    return {"family": "gpt", **sizes, "dropout": 0.0, "tie_embeddings": False, "attention": "flash"}


def recompute_mix(row: dict, layers: int, sp: bool) -> tuple[tuple[LayerStrategy, int], ...]:
    """(strategy, copies) of the row's activation checkpointing.

    - torchtitan ``full``: every block; ``selective`` op-level (its default policy saves every other matmul's
      output and recomputes the rest of the block, about half a forward) and ``layer`` (every other block
      checkpointed): full recomputation on half the blocks.
    - fms-fsdp ``selective``: a fraction f of blocks fully checkpointed, not stated; derived from its HFU / MFU
      (recomputing f of the forward adds f x 2 to the 6 FLOPs per parameter and token: f = 3 (HFU/MFU - 1)).
    torchtitan's tensor parallelism runs its norms sequence-parallel (``sp``).
    - Megatron: not stated; none."""
    text = (row.get("recompute") or "none").lower()
    if text.startswith("full"):
        full = layers
    elif text.startswith("selective (block"):
        m = row["measured"]
        full = round(min(1.0, 3 * (m["hfu"] / m["mfu"] - 1)) * layers)
    elif text.startswith("selective"):
        full = layers // 2
    else:
        full = 0
    return tuple((s, n) for s, n in ((LayerStrategy("none", sp), layers - full), (LayerStrategy("full", sp), full))
                 if n)


def megatron_flops(row: dict) -> float:
    """Megatron-Core r0.8 ``num_floating_point_operations`` for one step (dense GPT, no gating)."""
    m, s, b = row["model"], row["seq_len"], row["global_batch"]
    h, L, a, g, f, v = m["hidden"], m["layers"], m["heads"], m["kv_heads"], m["ffn"], m["vocab"]
    return 12 * b * s * L * h * h * ((1 + g / a + s / h) + f / h + v / (2 * L * h))


def build_plan(row: dict, model: ModelCost) -> Plan:
    p = row["parallelism"]
    tp, pp = p["tp"] or 1, p["pp"] or 1
    dp = row["gpus"] // (tp * pp)
    layers = row["model"]["layers"]
    block = model.blocks[0][0].name
    if row["source"] == OWN:
        return own_plan(row, block)
    if row["source"] in ONE_GPU_PUBLIC:
        mb = row["micro_batch"]
        return Plan(1, 1, 1, 1, mb, row["global_batch"], 1, 0, False, (), "bfloat16",
                    (BlockPlan(block, recompute_mix(row, layers, False)),), master_weights=False,
                    precision="bf16-true", compile=False)
    if row["source"] in MEGATRON:
        # distributed optimizer (ZeRO 1), sequence parallelism with tp (--tp-comm-overlap needs it), micro-batch 1
        # (not stated in Megatron-LM's README; FlagPerf's config), bf16 with float32 master weights
        mb = row["micro_batch"] or 1
        strategies = ((LayerStrategy("none", tp > 1), layers // pp),)
        plan = Plan(row["gpus"], dp, tp, pp, mb, row["global_batch"], 1, 1, False,
                    model.branch_names if tp > 1 else (), "bfloat16", (BlockPlan(block, strategies),))
    else:
        mb = row["local_batch"] or row["micro_batch"]
        deepspeed = row.get("engine") == "deepspeed"
        # torchtitan's tensor parallelism runs its norms sequence-parallel; a row may say it did not
        sp = tp > 1 and p.get("sequence_parallel", True)
        # FSDP2 (torch engine's bf16-mixed: float32 weights are the master) or DeepSpeed's bf16 mode (16-bit weights,
        # float32 master partitions); a row without data parallelism may say its model was bf16 itself (bf16-true)
        plan = Plan(row["gpus"], dp, tp, pp, mb, mb * dp * (row.get("gradient_accumulation") or 1), 1,
                    row.get("zero", 3), False, model.branch_names if tp > 1 else (), "bfloat16",
                    (BlockPlan(block, recompute_mix(row, layers // pp, sp)),), master_weights=deepspeed,
                    precision=row.get("precision", "bf16-mixed"), engine="deepspeed" if deepspeed else "")
    if "compile" not in {f.name for f in dataclasses.fields(Plan)}:
        return plan                  # the cost model before issue 19 (the "before" figures): no kernel modes
    return dataclasses.replace(plan, compile=compiled(row))


def vocab_replicated(row: dict) -> bool:
    """Whether the row ran its embedding, output head and loss whole on every tensor-parallel rank (KempnerForge
    under pipelining) rather than split over the vocabulary as torchtitan's and Megatron's tensor parallelism do."""
    return (row["parallelism"]["tp"] or 1) > 1 and not row["parallelism"].get("vocab_parallel", True)


def logits_gathered(row: dict) -> bool:
    """Whether the row's tensor parallelism gathered the logits whole on every rank for its loss: KempnerForge
    without a pipeline (``kempnerforge/distributed/tensor_parallel.py`` at 5666d0d: the output head is
    ``ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())``, and ``F.cross_entropy`` reads the
    replicated logits), where our runtime, Megatron-LM and torchtitan split the loss over the vocabulary."""
    return bool(row["parallelism"].get("logits_gathered"))


def gathered_logits_s(model: ModelCost, plan: Plan) -> float:
    """What a step of ``plan`` pays beyond the vocabulary-parallel loss it is priced with when its logits are gathered
    (``logits_gathered``): per micro-batch the all-gather of the logits (the head's output) over the tensor-parallel
    ranks, their concatenation along the vocabulary (torch's functional all-gather stacks the ranks' shares along
    dim 0; moving them to the last dim copies the whole), and the loss's ops (``LooseOps.loss_path``) whole on every
    rank instead of 1/tp of them. The source's ``F.cross_entropy`` reads the logits in their own dtype (bf16), where
    the captured model casts them to float32 first: the cast is left out and the loss's ops are priced at the
    logits' bytes per element. The gather's backward is a slice: not priced."""
    tail = LooseOps(model.tail_ops, model.cluster, model.vocab)
    params = set(model.vocab.params)
    heads = [op.outputs[0] for op in tail.ops if any(r.kind == "param" and r.name in params for r in op.sources)
             and op.outputs and op.outputs[0].shape and op.outputs[0].shape[-1] == model.vocab.vocab]
    loss = [int(i) for i in np.flatnonzero(tail.loss_path) if tail.ops[i].target not in CASTS]
    if plan.tp < 2 or not heads or not loss:
        return 0.0
    profile, logits = model.cluster.profile, heads[-1]
    # each op at the logits' element size instead of the float32 copy's it reads in the capture
    scale = np.array([dtype_bytes(logits.dtype) / dtype_bytes(tail.ops[i].inputs[0].dtype) for i in loss])
    arrays = tail.arrays.subset(loss)
    whole = sum(float((t * scale).sum()) for t in op_times(arrays, np.ones(len(loss)), plan.micro_batch, profile))
    share = sum(float((t * scale).sum()) for t in op_times(arrays, np.full(len(loss), float(plan.tp)),
                                                            plan.micro_batch, profile))
    nbytes = plan.micro_batch * logits.nbytes
    per_micro_batch = all_gather_s(nbytes, plan.tp, 1, model.cluster) + copy_s(nbytes, profile) + whole - share
    return plan.global_batch // (plan.dp * plan.micro_batch) * per_micro_batch


def own_plan(row: dict, block: str) -> Plan:
    """The plan of one of our single-H100 runs as it ran: one process, eager kernels. The torch engine trained the
    bf16 model itself (``bf16-true``: 2 + 2 + 4 bytes, AdamW on the GPU); DeepSpeed ZeRO 1 with optimizer offload
    kept the float32 master partition and AdamW states on the host (priced as ``bf16-mixed`` with master weights:
    16-bit weights and gradients on the GPU, the optimizer state offloaded)."""
    layers, mb = row["model"]["layers"], row["micro_batch"]
    strategies = ((LayerStrategy(row["recompute"]), layers),)
    deepspeed = row["engine"] == "deepspeed"
    return Plan(1, 1, 1, 1, mb, row["global_batch"], 1, row["zero"], row["offload_optimizer"], (), "bfloat16",
                (BlockPlan(block, strategies),), master_weights=deepspeed,
                precision="bf16-mixed" if deepspeed else "bf16-true")


def kernels(plan: Plan) -> str:
    """What the summary does not say: eager kernels, or (code before issue 19) no kernel modes at all."""
    mode = getattr(plan, "compile", None)
    return " (fused: one kernel mode before issue 19)" if mode is None else "" if mode else " eager"


def measured_step_s(row: dict) -> float:
    if row["source"] == "megatron_lm_readme_h100":
        return megatron_flops(row) / (row["measured"]["tflops_per_gpu"] * 1e12 * row["gpus"])
    return row["derived"]["step_time_s"]


def profile_name(row: dict) -> str:
    """The profile of the hardware a row ran on: torchtitan's sources state 96 GB HBM2e at 500 W; fms-fsdp's
    README says "H100 80G" (its MFU is against the SXM's 989 TFLOP/s); Megatron-LM's table is DGX H100 (SXM)."""
    if "H200" in row["gpu"]:
        return PROFILES["h200"]
    if "A100" in row["gpu"]:
        return PROFILES["a100"]
    return PROFILES["torchtitan" if row["source"].startswith("torchtitan") else "other"]
