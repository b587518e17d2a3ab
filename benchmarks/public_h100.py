"""How close `tensoropt estimate`'s prices come to published H100 trainings (issue 19's calibration set, issue 35's
additions).

Data: ``benchmarks/data/public_h100.json`` (54 rows transcribed from pytorch/torchtitan, NVIDIA/Megatron-LM and
foundation-model-stack/fms-fsdp, each with repository, path and commit; two rows of our own, issue 12's runs on one
H100 at f8f685f, family "one H100 (eager torch / DeepSpeed)", step time as measured; and, since issue 35, 27 rows
from five more public sources: FlagOpen/FlagPerf's Megatron-Core and DeepSpeed runs on H100s, KempnerInstitute/
KempnerForge's eager FSDP2 and FSDP2 + TP + PP runs and its 17 compiled ones (one GPU, FSDP2, TP, TP + FSDP2) on
H200s, ljm565/universal-llm-trainer's single-H100 runs). Each
row that the cost model can price is rebuilt as it ran (model shape, dp/FSDP, tp, pp, local batch, recomputation,
bf16 mixed precision, compiled or eager kernels), priced with ``cost.model.estimate`` (what ``tensoropt estimate``
calls) on the profile of the hardware it ran on (``profile_name``: torchtitan's 96 GB HBM2e parts capped at 500 W on
``profiles/h100-96gb-500w.json``, fms-fsdp's, Megatron-LM's and FlagPerf's SXM parts on ``profiles/h100-80gb.json``,
KempnerForge's H200s, 4 to a node, on ``profiles/h200-141gb-4gpu.json``), and compared with the measured step time:
- torchtitan / fms-fsdp: tokens of one step on one data-parallel rank over its tokens/s/GPU, as the row's
  ``derived.step_time_s`` gives it (local batch x seq / (tps x tp x pp x cp), torchtitan's metric).
- Megatron-LM: the README prints TFLOP/s per GPU, counted with Megatron-Core's ``num_floating_point_operations``
  (r0.8 ``training.py``: 12 B s L h^2 ((1 + g/a + s/h) + f/h + V/(2 L h)), no recomputation counted); the step
  time is that count over (TFLOP/s x GPUs), and the same count divides our predicted step time. These rows ran
  ``--tp-comm-overlap`` and are priced with it (``estimate(..., megatron_tp_comm_overlap=True)``, an option the
  planner never offers: the torch engine does not overlap TP collectives).
- FlagPerf: its tokens/s/GPU is global batch x seq / (iteration time x GPUs), inverted; KempnerForge and
  universal-llm-trainer print seconds per step.
torchtitan's eager FSDP runs on 64 A100 80GB (docs/performance.md, the source of the 405B H100 row) are priced on
``profiles/a100-80gb.json`` since issue 35, validation only (no fit chooses that profile's constants). Rows the model
cannot price are listed with why (float8 matmuls, context parallelism, async TP).

    PYTHONPATH=$PWD python benchmarks/public_h100.py [--tag before]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
from pathlib import Path

import _loso
from _common import write_results
from _public_rows import (
    FAMILIES,
    FITTED_PROFILES,
    FSDP_ZERO3,
    GPUS_PER_NODE,
    MEGATRON,
    ONE_GPU_PUBLIC,
    OWN,
    PROFILES,
    build_plan,
    family,
    gathered_logits_s,
    kernels,
    logits_gathered,
    measured_step_s,
    model_config,
    profile_name,
    vocab_replicated,
    why_not,
)

import tensoropt
from tensoropt.cost.model import GraphFacts, ModelCost, estimate
from tensoropt.cost.profile import Cluster, load_profile
from tensoropt.cost.runtimes import Runtime

DATA = Path(__file__).resolve().parent / "data" / "public_h100.json"


NOTES = """
Constants fitted on these rows, each with a physical meaning (the profiles' `sources` say the same):
- h100-80gb (SXM5, 700 W; fms-fsdp's "H100 80G" and Megatron-LM's rows, both MFUs against the SXM's 989 TFLOP/s):
  matmul_efficiency = the earlier assumed curve x 0.9 (largest products 0.675 of the dense bf16 peak),
  memory_efficiency 0.5 (memory-bound kernels at ~1.7 of 3.35 TB/s), overlap_slowdown 0.2 (compute beside a
  collective loses 20% of the collective's time; fitted earlier on the FSDP rows, unchanged).
- h100-96gb-500w (torchtitan's Grand Teton H100s, 96 GB HBM2e, 500 W cap): the same die and peaks; matmul curve
  x 0.924 (3% above the SXM's fitted curve, which the power cap cannot explain: the two are fitted on different
  software, torchtitan here, Megatron-LM, fms-fsdp and FlagPerf there); HBM2e bandwidth 2.45 TB/s (derived: six HBM2e
  stacks at the H100 PCIe's per-stack rate); memory_efficiency and overlap_slowdown as SXM.
- copy_efficiency 0.91 on both (not fitted: NVIDIA-STREAM's Copy on an H100 80GB HBM3, KempnerInstitute's
  nvidia-hpc-benchmarks): the rate of the large contiguous copies the torch runtime makes, FSDP's flat buffers and,
  since issue 35, sequence parallelism's layout copies (``cost.layer.BlockCost.sp_copies_s``: torch's functional
  collectives gather and scatter along dim 0, so along the sequence, dim 1 of a batch-first stream, a reduce-scatter
  concatenates its input's chunks and an all-gather past batch 1 moves the shares: each a read and a write of the
  whole stream). Megatron-LM's rows are priced sequence-first (``ModelCost(..., runtime=Runtime.MEGATRON)``:
  its [s, b, h] stream gathers along dim 0), torchtitan's and KempnerForge's batch-first, as they run. Before these
  copies were priced torchtitan's TP8 rows read -4..-6% and pulled the 500 W curve down (x 0.88): its non-TP rows held
  out read +6..+11%.
The three numbers (0.9, 0.8, 0.7) were first chosen jointly on the first 20 rows from a coarse grid (steps of 0.05).
Since issue 35 every fused causal attention is priced on the work its kernel does (the key tiles on and below the
diagonal, ~half the FLOPs counted: ``cost.ops.causal_fraction``), and the committed constants are the fit on all
public H100 rows (the leave-one-source-out section's "fit on all public sources", on a grid of 0.025 and 0.05):
the SXM curve stayed, the 500 W curve went from x 0.8 to x 0.88 (x 0.924 since the layout copies), memory_efficiency
from 0.7 to 0.5. The fit's loss (the sum of |log(predicted / measured)| over the public H100 rows, each memory
efficiency with its best curve factors), with the layout copies priced: 0.784 at 0.5, 0.800 at 0.45, 0.848 at 0.55,
0.917 at 0.6, 1.104 at 0.7, 0.989 at 0.4 (2026-11-30; before them 0.893 at 0.5, 0.914 at 0.55, 1.052 at 0.7; a lower
memory efficiency goes with faster curves: 1.025 and 1.075 x at 0.45, 0.975 and 0.875 x at 0.6). This project's own
eager torch run (never fitted) reads +27.3% at 0.5 and +1.2% at 0.7: its explicit-softmax attention at 2048 tokens
is mostly memory-bound ops, the part of a step this one constant moves most. Link
efficiencies and kernel_overhead_s are unchanged. Not fitted: which rows compile (from the sources), recomputation
(stated, or fms-fsdp's fraction from its HFU/MFU), FSDP2's overlap (cost.data_parallel.fsdp_exposed_s), AdamW's
foreach traffic (80 B/param, torch/optim/adam.py), Megatron's TP overlap (cost.layer.tp_comm_hidden_s: each copy's
TP collectives beside its own compute, less overlap_slowdown).

One H100 (eager torch / DeepSpeed): this project's own two runs of issue 12 (main at f8f685f; not a public source),
priced as they ran: tensoropt's gpt family at f8f685f (explicit-softmax attention at seq 2048, eager kernels), the torch
engine with the bf16 model's own AdamW on the GPU (bf16-true) and DeepSpeed ZeRO 1 with optimizer offload (bf16 weights
on the GPU, float32 master and AdamW states on the host). Nothing was fitted on them. The offloaded step is priced as
DeepSpeed 0.19.8 runs it (cost.offload.offload_step_s: float32 gradients to the host, torch.optim.AdamW there, a host
cast into a pinned 16-bit buffer and the copy back), at h100-80gb's host rate, which is derived (profiles/h100-80gb.json
sources: 16 cores' share of a DGX H100 host's DRAM bandwidth at the AdamW/copy ratio measured on cpu-2core), not
measured; the DeepSpeed row implies about half of that rate. The memory table compares tensors only (the profile's
runtime_overhead_bytes taken off the prediction) with max_memory_allocated. At f8f685f DeepSpeed ran without a bf16
section (its float32 mode: a float32 gradient buffer the size of the model on the GPU), which today's engine no
longer does; that buffer is not in the prediction (the engine's bf16 mode is priced).

Megatron-LM's micro-batch, interleaving and recomputation are not stated, and Megatron-LM has no default micro-batch
(--micro-batch-size defaults to None: it must be given); priced: micro-batch 1, no interleaving and no recomputation
(Megatron's defaults: --num-layers-per-virtual-pipeline-stage and --recompute-granularity default to None),
distributed optimizer as ZeRO 1 (--overlap-param-gather requires it). torchtitan's vanilla-TP rows do not overlap
TP communication and are priced without the option. fms-fsdp's 7B row ran HSDP (sharded in a node, replicated
across), priced as ZeRO 3 over all 96 GPUs; its "800 Gbps" cannot be per node (the 13B row's FSDP traffic alone
needs ~46 GB/s per GPU), so its inter-node links are priced as h100-80gb's 400 Gb/s per GPU.

Issue 35's additions (found in public repositories; the data file's ``sources`` say where and what each states):
- FlagPerf's Megatron-Core 0.6 runs (Llama-3-shaped 8B on 8 and 16 H100s at tp2, 70B on 64 at tp8 pp4, micro-batch 1,
  global batch 512, seq 8192): a second Megatron source. Their launch script sets no rope, untied-embedding or
  bias-free flags, so the model is Megatron's default GPT-style one (learned positions, tied embeddings, linear biases)
  with RMSNorm, SwiGLU and GQA, priced so; no recomputation flag either (the README lists recompute-activations among
  its optimisations: a conflict the notes of the data keep); no --tp-comm-overlap.
- FlagPerf's DeepSpeed 0.11.1 ZeRO 3 run of ChatGLM3-6B on 8 H100s (micro-batch 1, seq 4096), priced as a
  Llama-shaped model of its sizes (2 key/value groups) on the DeepSpeed engine: its half-head rotary and QKV bias
  are left out, and its small buckets (prefetch 1e7, reduce 1e7) are DeepSpeed's of 2023, not ours.
- KempnerForge on H200s (nodes of 4): the one eager FSDP2 run of its MFU table (13B, 8 GPUs, micro-batch 4 x 4
  accumulation steps, seq 4096, full recomputation) and its three eager FSDP2 + TP + PP runs
  (torch.distributed.pipelining 1F1B over 32 GPUs). Their weights and AdamW states are bf16 with float32 gradient
  reductions, which neither of our precisions is: priced as bf16-mixed, whose float32 reductions set the data-parallel
  traffic as theirs do (the data's notes). Their gradient sync is off on every micro-batch but the last (FSDP2 holds
  the unsharded gradients through the accumulation): their 13B run's 88.5 GiB allocated against our 60.7 GiB for the
  plan is about that (~28 GiB of bf16 gradients); memory is not compared here. These run on hardware no fit covers
  (``FITTED_PROFILES``): validation only, priced on the committed h200-141gb-4gpu profile. Under pipelining
  KempnerForge's tensor parallelism is another than torchtitan's (its ``tensor_parallel.py``: no sequence parallelism
  on pipeline stages, and the token embedding, output head and cross-entropy whole on every TP rank): priced so since
  2026-11-30 (plans without ``+sp``, "vocab replicated"); priced with both, as before, the three rows read -40.9%,
  -16.1%, -27.8%. Not modelled: under torch.distributed.pipelining FSDP2 reduce-scatters every gradient after the last
  micro-batch's backward (ours each micro-batch), and KempnerForge reshards after each forward (an all-gather per
  micro-batch, as ours). A what-if (not committed code) pricing that deferred reduce-scatter, exposed after the last
  backward, read -16.3%, -36.2%, -27.4%: further off, so it is not what the remaining gap is; nor is one inter-node
  bandwidth (at half the profile's 50 GB/s per GPU the rows read -2.4%, +73%, +26% as our runtime runs them). All
  three run TP over 4 GPUs of a node, and the same source's compiled TP runs without pipelining are priced too fast
  too (below): the pipelined rows' gap (-12.4% before the H200 profiles carried overlap_slowdown 0.2, -7.2% since) is
  about that TP gap, not one of the pipeline's.
- KempnerForge's 17 compiled runs on 1 to 32 H200s (added 2026-11-30; 7B, 13B, 70B; micro-batch 2-8 x 2-8
  accumulation steps, seq 4096, full recomputation; torch.compile of the whole model, the loss eager outside it):
  validation only, on the committed h200-141gb-4gpu profile, in two families since the prices miss them in opposite
  directions. Without TP (one GPU, FSDP2 over 2-32 GPUs) they run faster than priced: the single-GPU 7B step is
  ~67% of the bf16 peak in the FLOPs it computes (6 per parameter and token, causal attention halved, the recomputed
  forward), above the committed H200 curve (the H100 SXM's unfitted earlier curve). With TP (2 or 4 ranks in a node)
  they run slower: TP over 2 GPUs of one node took their 7B step from 3.13 s on one GPU to 2.49 s for the same
  sequences (0.93 s over half the one-GPU step), where the price went from 3.61 s to 1.98 s (0.18 s over half) with
  its collectives at an 8-GPU NVSwitch node's rate. The source says 4 H200s a node with NVLink (the Kempner AI
  cluster, kempner-computing-handbook's overview; "NVIDIA H200", the SXM part, in its logs): 4-GPU Hopper boards have
  no NVSwitch and wire each GPU's 18 NVLinks 6 to each peer (``nvidia-smi topo -m``: NV6), so since 2026-11-30 the
  rows are priced on ``h200-141gb-4gpu`` (``intra_node.direct_peers`` 3: a pair reaches a third of the GPU's rate,
  4 GPUs all of it): the TP2 step is priced 2.32 s (-6.9%; the TP2 + FSDP2 row -20.1% -> -6.5%), the TP4 rows
  unchanged by it (-4.5% .. -23.4%; with FSDP2 across nodes the gap grew with its degree at 7B: 0.09 s at TP4 alone,
  0.25, 0.36, 0.39 s at FSDP2 2, 4, 8, about 0.4 of the FSDP2 traffic's priced time; the nodes' InfiniBand ports are
  not stated). The H200 profiles had no ``overlap_slowdown`` (0: they predate the constant); since 2026-11-30 they
  carry the H100 fit's 0.2 (NCCL's kernels on the same die's SMs; not fitted on these rows): the TP family 12.2% ->
  6.8% (-16.1% .. +4.5%), the one without TP +5.6% -> +8.4% (its FSDP2 rows' traffic now costs compute: FSDP2 over a
  pair adds 0.37 s to the one-GPU step, priced 0.32 s, where it was 0.09 s; the gap left is the one-GPU step's
  +15.4%). What-ifs not committed (`/tmp`): the H100 fit's memory_efficiency 0.5 as well reads the TP family 3.8%
  (-0.1% signed) and the one without TP +19.5%; the H100 SXM's fitted curve (x0.9) as well, +28.7% without TP. The
  H200 rows split by TP as torchtitan's H100 rows do (TP8 rows -4..-6%, FSDP rows +1..+4%), by more. Their
  TP plan without pipelining: norms sequence-parallel, the head's matmul split by vocabulary (priced so), the
  embedding whole on each TP rank (not modelled) and the logits gathered for a whole-vocabulary loss (priced since
  2026-11-30, ``_public_rows.gathered_logits_s``: +2-4% a step; the TP family 5.0% -> 3.0%, -2.8% -> -0.9% signed).
  Rows without data parallelism are priced bf16-true (the model is bf16).
- torchtitan's eight eager FSDP rows on 64 A100 80GB (micro-batch 1-2, Llama 2 13B/70B and Llama 3 8B/70B; in the data
  since issue 19, unpriced until now): validation only on the committed a100-80gb profile (whose curve was set on
  Megatron-LM's A100 runs, ``cost_calibration.md``, not on these).
- universal-llm-trainer's single "H100 x 1" full fine-tunes of Llama 3.1 8B and Phi-3-mini (bf16 weights and AdamW,
  Hugging Face checkpointing, 2 x 8192 tokens, deterministic algorithms on): which H100 and what "Sec/step" times are
  not stated, so they are shown and never fitted on.
"""


_GRAPHS: dict[str, tuple] = {}


def graph_of(row: dict) -> tuple:
    """The row's model captured once, with its folding and the whole-graph facts the cost model reads of it (each a
    scan of every op): the leave-one-source-out table prices each row on a fitted profile ~190 times."""
    config = json.dumps(model_config(row), sort_keys=True)
    if config not in _GRAPHS:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / f"{row['model']['id']}-s{row['seq_len']}.json"
            path.write_text(config)
            graph = tensoropt.capture(str(path)).graph
        _GRAPHS[config] = graph, tensoropt.fold(graph), GraphFacts.of(graph)
    return _GRAPHS[config]


def price(row: dict, profile) -> dict:
    graph, folding, facts = graph_of(row)
    if vocab_replicated(row):
        # the cost model then prices the vocabulary's ops whole on every rank, as it does for a model that refuses
        # the split
        facts = dataclasses.replace(facts, vocab=dataclasses.replace(
            facts.vocab, refused="the row ran its vocabulary replicated over tensor-parallel ranks"))
    megatron = row["source"] in MEGATRON
    # Megatron-LM's stream is sequence-first: its sequence-parallel collectives need no layout copies
    # the others ran torch's own ColwiseParallel / RowwiseParallel (torchtitan, KempnerForge): their copies
    model = ModelCost(graph, folding, Cluster(row["gpus"], row.get("gpus_per_node", GPUS_PER_NODE), profile),
                      facts=facts, runtime=Runtime.MEGATRON if megatron else Runtime.TORCH_STYLES)
    plan = build_plan(row, model)
    est = estimate(model, plan, megatron_tp_comm_overlap=megatron and bool(row["parallelism"].get("tp_comm_overlap")))
    measured = measured_step_s(row)
    # a source that gathered its logits for a whole-vocabulary loss pays that on top (``gathered_logits_s``)
    gathered = gathered_logits_s(model, plan) if logits_gathered(row) else 0.0
    memory = {}
    if row["measured"].get("max_memory_allocated_gib"):
        # tensors: the prediction less the allocator's and libraries' share (runtime_overhead_bytes), against
        # torch.cuda.max_memory_allocated
        tensors = (est.peak_memory_bytes - profile.runtime_overhead_bytes) / 2**30
        allocated = row["measured"]["max_memory_allocated_gib"]
        memory = {"predicted_tensor_gib": tensors, "measured_allocated_gib": allocated,
                  "memory_error": tensors / allocated - 1,
                  "memory_breakdown_gib": {k: round((v - (profile.runtime_overhead_bytes if k == "other_bytes" else 0))
                                                    / 2**30, 3) for k, v in est.memory_breakdown.items()}}
    return {"source": row["source"], "group": row["group"], "model": row["model"]["id"], "gpus": row["gpus"],
            "family": family(row), "profile": profile.name,
            "plan": plan.summary() + kernels(plan) + (" vocab replicated" if vocab_replicated(row) else ""),
            "measured_step_s": measured, "predicted_step_s": est.iteration_time_s + gathered,
            "error": (est.iteration_time_s + gathered) / measured - 1,
            # Megatron's rows hide tensor-parallel communication behind GEMMs (--tp-comm-overlap): how much of it
            "tp_comm_hidden_s": est.time_breakdown.get("tensor_parallel_hidden_s", 0.0),
            "breakdown": {k: round(v, 4) for k, v in est.time_breakdown.items()}
            | ({"gathered_logits_s": round(gathered, 4)} if gathered else {}), **memory}


def summary(rows: list[dict]) -> dict[str, dict]:
    out = {}
    groups = {f: [r for r in rows if r["family"] == f] for f in FAMILIES}
    groups["fsdp-zero3 (eager + compiled)"] = [r for r in rows if r["family"] in FSDP_ZERO3]
    for name, members in groups.items():
        if members:
            errors = [r["error"] for r in members]
            out[name] = {"rows": len(members), "median_abs_error": statistics.median(abs(e) for e in errors),
                         "median_signed_error": statistics.median(errors), "min": min(errors), "max": max(errors)}
    return out


def held_out(data: dict, rows: list[dict], profiles: dict) -> dict:
    """Leave-one-source-out (``_loso``): every priced row again on the grid of its profile's constants, the fits
    on all public sources and on all but each one, and the families' fitted and held-out errors."""
    raw = [r for r in data["rows"] if not why_not(r)]
    table = _loso.error_table(raw, lambda r, prof: price(r, prof)["error"], profiles, profile_name, FITTED_PROFILES)
    # validation only: our own runs, the Hugging Face pair whose part and timing are unstated, and rows on hardware
    # whose constants no fit chooses (``FITTED_PROFILES``: the H200s, KempnerForge's rows only, the pipelined three
    # of which no efficiency explains (fitted, they dragged the shared memory efficiency to 0.6); torchtitan's A100s)
    on_all, held = _loso.leave_one_source_out(rows, table, [profile_name(r) for r in raw], FITTED_PROFILES,
                                              (OWN, *ONE_GPU_PUBLIC))
    families = {f: (lambda r, f=f: r["family"] == f) for f in FAMILIES}
    families["fsdp-zero3 (eager + compiled)"] = lambda r: r["family"] in FSDP_ZERO3
    figures = _loso.family_figures(held, families)
    for name, f in figures.items():
        print(f"{name}: held out median |error| {f['held_out_median_abs']:.1%} (signed "
              f"{f['held_out_median_signed']:+.1%}), fitted {f['fitted_median_abs']:.1%}")
    others = sorted({profile_name(r) for r in raw} - set(FITTED_PROFILES))
    lines = _loso.table_lines(on_all, held, figures) + [
        "", f"Rows on {', '.join(others)} enter no fit: each is priced on its profile as committed (no constant of "
        "it is fitted here). Never fitted on either: " + ", ".join((OWN, *ONE_GPU_PUBLIC)) + "."]
    return {"on_all": on_all, "families": figures, "rows": held, "lines": lines}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tag", default="", help="suffix of the result files (e.g. 'before')")
    parser.add_argument("--note", default="", help="a line for the results (e.g. which code priced them)")
    args = parser.parse_args()
    data = json.loads(DATA.read_text())
    profiles = {name: load_profile(name) for name in PROFILES.values()}
    rows, skipped = [], []
    for row in data["rows"]:
        reason = why_not(row)
        if reason:
            skipped.append({"source": row["source"], "group": row["group"], "model": row["model"]["id"],
                            "why": reason})
            continue
        rows.append(price(row, profiles[profile_name(row)]))
        r = rows[-1]
        print(f"{r['family']:20s} {r['model']:18s} {r['gpus']:5d} {r['plan'][:60]:60s} measured "
              f"{r['measured_step_s']:8.3f} s predicted {r['predicted_step_s']:8.3f} s {r['error']:+.1%}", flush=True)
    families = summary(rows)
    loso = held_out(data, rows, profiles)
    for name, s in families.items():
        print(f"{name}: {s['rows']} rows, median |error| {s['median_abs_error']:.1%}, median signed "
              f"{s['median_signed_error']:+.1%} ({s['min']:+.1%} .. {s['max']:+.1%})")
    lines = ["| family | rows | median abs error | median signed | range |", "|---|---:|---:|---:|---|"]
    lines += [f"| {n} | {s['rows']} | {s['median_abs_error']:.1%} | {s['median_signed_error']:+.1%} | "
              f"{s['min']:+.1%} .. {s['max']:+.1%} |" for n, s in families.items()]
    lines += ["", "| source | group | model | GPUs | profile | plan as priced | measured s/step | predicted | error | "
              "TP comm hidden (s) |", "|---|---|---|---:|---|---|---:|---:|---:|---:|"]
    lines += [f"| {r['source']} | {r['group']} | {r['model']} | {r['gpus']} | {r['profile']} | {r['plan']} | "
              f"{r['measured_step_s']:.3f} | {r['predicted_step_s']:.3f} | {r['error']:+.1%} | "
              f"{r['tp_comm_hidden_s']:.3f} |" for r in rows]
    mem = [r for r in rows if "memory_error" in r]
    if mem:
        lines += ["", "Memory (tensors): the predicted peak less the profile's runtime_overhead_bytes, against "
                  "torch.cuda.max_memory_allocated:", "", "| group | predicted GiB | measured GiB | error | "
                  "predicted parts (GiB) |", "|---|---:|---:|---:|---|"]
        lines += [f"| {r['group']} | {r['predicted_tensor_gib']:.2f} | {r['measured_allocated_gib']:.2f} | "
                  f"{r['memory_error']:+.1%} | " + ", ".join(f"{k.removesuffix('_bytes')} {v:.2f}" for k, v in
                                                           r["memory_breakdown_gib"].items()) + " |" for r in mem]
    lines += loso["lines"]
    lines += ["", f"Not priced ({len(skipped)} rows):", ""]
    lines += [f"- {s['source']} {s['group']} {s['model']}: {s['why']}" for s in skipped]
    write_results("public_h100" + (f"_{args.tag}" if args.tag else ""), rows, "\n".join(lines) + "\n",
                  f"\nProfiles {', '.join(sorted(set(PROFILES.values())))}; data {DATA.name} "
                  f"({len(data['rows'])} rows). {args.note}\n{NOTES}",
                  {"families": families, "skipped": skipped, "profiles": PROFILES,
                   "leave_one_source_out": {"fit_on_all": loso["on_all"], "families": loso["families"],
                                            "rows": loso["rows"]}})


if __name__ == "__main__":
    main()
