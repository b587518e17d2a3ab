"""The grouped expert products' price against public H100 measurements of ``torch._grouped_mm`` (issue 36:
"calibrate MoE prices on public sources"; NeMo AutoModel's performance summary stays aside, for validation).

What is priced: the MoE MLP forward of a Hugging Face Qwen3-MoE layer (router, token gather, the two grouped products,
SwiGLU, the weighted combine), captured from a config on the meta device in bf16-mixed and priced with the bf16
weights FSDP2 computes with, at 32,768 tokens (micro-batch 8 of 4,096), each op by ``cost.ops.op_times`` on
``profiles/h100-80gb.json``. What was measured (``benchmarks/data/moe_public_sources.md``, section 1a): VeOmni PR
#460, the fused MoE forward with ``torch._grouped_mm`` on one H100 in bf16, 32,768 tokens, hidden 2048:

- E=128 experts, top-8, expert FFN 768 (Qwen3-30B-A3B; 2,048 rows per expert): 10.218 ms;
- E=512 experts, top-10, expert FFN 512 (Qwen3-Next-like; 640 rows per expert): 11.411 ms.

The fit: one constant, the profile's ``grouped_matmul_efficiency`` (the fraction of a plain product's efficiency, at
one group's FLOPs, that the grouped kernel reaches), fitted on the E=128 point alone: the grouped products take what
the measurement leaves after the other ops' price. The E=512 point (smaller groups, another shape) is held out and
priced with it. Both rows are shown three ways: the whole op on the efficiency curve (the price before issue 36's
calibration), per-group efficiency without the constant, and per-group with the fitted one.

Caveat: VeOmni's fused forward is its own code around ``torch._grouped_mm`` (its token permutation, not Hugging
Face's index/scatter ops, which are what the torch engine runs and what is priced here); the fit assumes the two
spend alike outside the grouped products.

Beside it, a check of the all-to-all's price (not fitted): NCCL's ``alltoall_perf`` on 4 H100s at 500 MB.

    python benchmarks/moe_kernels.py     # writes results/moe_kernels.{json,md}
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
from _common import write_results

import tensoropt
from tensoropt.cost.comm import all_to_all_s
from tensoropt.cost.ops import OpArrays, op_times
from tensoropt.cost.profile import Cluster, DeviceProfile, load_profile
from tensoropt.graph.bf16_meta import bf16_weights_graph

SEQ_LEN, MICRO_BATCH = 4096, 8              # 32,768 tokens, as VeOmni's S=32768, B=1
# Qwen3-MoE config fields that size the MoE MLP; one layer, attention and vocabulary small (not priced)
BASE = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 1,
        "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 1024, "max_position_embeddings": SEQ_LEN,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu"}
# (label, experts, top-k, expert ffn, measured forward ms, role): VeOmni PR #460 (ByteDance-Seed/VeOmni), torch column
POINTS = [("qwen3-30b-a3b shape", 128, 8, 768, 10.218, "fitted"),
          ("qwen3-next-like shape", 512, 10, 512, 11.411, "held out")]
PROFILE = "h100-80gb"
# NVIDIA/nccl issue #2169: alltoall_perf on 4 x H100 80GB HBM3 (NCCL 2.30.4), 524,288,000 bytes: 1174.14 us
A2A_RANKS, A2A_BYTES, A2A_MEASURED_S = 4, 524_288_000, 1174.14e-6


def moe_ops(experts: int, top_k: int, ffn: int, tmp: Path) -> tuple:
    """The MoE MLP's ops of a one-layer Qwen3-MoE of that shape, captured in bf16-mixed with the bf16 weights FSDP2
    computes with."""
    spec = tmp / f"qwen3-moe-{experts}x{ffn}.json"
    spec.write_text(json.dumps(BASE | {"num_experts": experts, "num_experts_per_tok": top_k,
                                       "moe_intermediate_size": ffn}))
    graph = tensoropt.capture(str(spec), precision="bf16-mixed", seq_len=SEQ_LEN).graph
    graph = bf16_weights_graph(graph) or graph
    return tuple(op for op in graph.ops if ".mlp" in op.module_path)


def moe_forward_s(ops: tuple, profile: DeviceProfile) -> tuple[float, float, float]:
    """(the grouped products' forward seconds, the same priced as before the calibration, as plain products of
    their whole FLOPs, the other MoE ops' forward seconds) at 32,768 tokens."""
    arrays = OpArrays.of(ops, profile)
    forward, _ = op_times(arrays, np.ones(len(ops)), MICRO_BATCH, profile)
    whole = dataclasses.replace(arrays, groups=np.ones(len(ops)), grouped_kernel=np.zeros(len(ops), dtype=bool))
    whole_forward, _ = op_times(whole, np.ones(len(ops)), MICRO_BATCH, profile)
    grouped = np.array([op.target.startswith("aten._grouped_mm") for op in ops])
    return float(forward[grouped].sum()), float(whole_forward[grouped].sum()), float(forward[~grouped].sum())


def main() -> int:
    committed = load_profile(PROFILE)
    uncalibrated = dataclasses.replace(committed, grouped_matmul_efficiency=1.0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, experts, top_k, ffn, measured_ms, role in POINTS:
            grouped_s, whole_s, other_s = moe_forward_s(moe_ops(experts, top_k, ffn, Path(tmp)), uncalibrated)
            rows.append({"label": label, "experts": experts, "top_k": top_k, "expert_ffn": ffn,
                         "rows_per_expert": SEQ_LEN * MICRO_BATCH * top_k // experts, "role": role,
                         "measured_ms": measured_ms, "other_ops_ms": other_s * 1e3,
                         "grouped_whole_op_ms": whole_s * 1e3, "grouped_per_group_ms": grouped_s * 1e3})
    fit = rows[0]
    fitted = fit["grouped_per_group_ms"] / (fit["measured_ms"] - fit["other_ops_ms"])
    whole_fit = fit["grouped_whole_op_ms"] / (fit["measured_ms"] - fit["other_ops_ms"])
    for r in rows:
        r["predicted_whole_op_ms"] = r["other_ops_ms"] + r["grouped_whole_op_ms"]
        r["predicted_whole_op_fitted_ms"] = r["other_ops_ms"] + r["grouped_whole_op_ms"] / whole_fit
        r["predicted_per_group_ms"] = r["other_ops_ms"] + r["grouped_per_group_ms"]
        r["predicted_calibrated_ms"] = r["other_ops_ms"] + r["grouped_per_group_ms"] / fitted
        r["predicted_committed_ms"] = _committed_ms(r, committed)
    lines = ["| shape | experts | top-k | expert ffn | rows / expert | role | measured ms | whole op (before) | "
             "whole op, a factor fitted | per group | per group, fitted (committed profile) |",
             "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        cells = [_cell(r[k], r["measured_ms"]) for k in ("predicted_whole_op_ms", "predicted_whole_op_fitted_ms",
                                                          "predicted_per_group_ms", "predicted_committed_ms")]
        lines.append(f"| {r['label']} | {r['experts']} | {r['top_k']} | {r['expert_ffn']} | {r['rows_per_expert']} | "
                     f"{r['role']} | {r['measured_ms']:.3f} | " + " | ".join(cells) + " |")
    notes = (f"\nPredicted: the MoE MLP forward of a Hugging Face Qwen3-MoE layer at 32,768 tokens on {PROFILE} "
             f"(other ops {rows[0]['other_ops_ms']:.2f} / {rows[1]['other_ops_ms']:.2f} ms; each cell: ms and its "
             "error against the measurement). Measured: VeOmni PR #460, `torch._grouped_mm` fused MoE forward, one "
             "H100, bf16 (benchmarks/data/moe_public_sources.md).\n\n"
             f"Fitted on the first row alone: grouped_matmul_efficiency = {fitted:.3f} with per-group efficiency "
             f"(committed in profiles/{PROFILE}.json as {committed.grouped_matmul_efficiency}); a whole-op factor "
             f"fitted the same way would be {whole_fit:.3f}. The held-out row is what counts: the shape the fit did "
             "not see, with 3.2x smaller groups.\n")
    a2a_s = all_to_all_s(A2A_BYTES, A2A_RANKS, 1, Cluster(A2A_RANKS, 8, committed))
    notes += ("\nAll-to-all (not fitted: the profile's NVLink rate, 450 GB/s a direction at efficiency 0.8, as "
              f"before): NCCL's `alltoall_perf` on {A2A_RANKS} H100s, {A2A_BYTES:,} bytes a rank, measured "
              f"{A2A_MEASURED_S * 1e6:.0f} us (NVIDIA/nccl issue #2169), priced {a2a_s * 1e6:.0f} us "
              f"({a2a_s / A2A_MEASURED_S - 1:+.1%}; `cost.comm.all_to_all_s`).\n")
    write_results("moe_kernels", rows, "\n".join(lines) + "\n", notes,
                  extra={"fitted_grouped_matmul_efficiency": fitted, "whole_op_factor": whole_fit})
    print("\n".join(lines))
    print(f"fitted grouped_matmul_efficiency {fitted:.4f} (whole-op factor {whole_fit:.4f})")
    return 0


def _committed_ms(row: dict, committed: DeviceProfile) -> float:
    """The row priced with the committed profile (its ``grouped_matmul_efficiency``)."""
    return row["other_ops_ms"] + row["grouped_per_group_ms"] / committed.grouped_matmul_efficiency


def _cell(predicted_ms: float, measured_ms: float) -> str:
    return f"{predicted_ms:.2f} ({predicted_ms / measured_ms - 1:+.1%})"


if __name__ == "__main__":
    sys.exit(main())
