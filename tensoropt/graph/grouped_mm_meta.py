"""Shapes of ``aten._grouped_mm`` on fake tensors in every float dtype.

Mixture-of-Experts layers run their experts' products as one grouped product (Hugging Face's default experts
kernel, torchtitan's): rows sorted by expert times one weight matrix per expert. PyTorch's meta kernel for it
repeats the checks of the CUDA kernel it was written beside and accepts bf16 operands only, while the CPU kernel
(and a float32 model's forward) runs it in float32. TensorOpt runs forwards on fake tensors to capture a model, to
try its tensor-parallel shares and to simulate a plan's memory: a float32 MoE model would fail there for a reason
that says nothing about the model. ``install_grouped_mm_meta`` replaces that meta kernel, once per process, by one
that keeps PyTorch's own for bf16 and gives other float dtypes the output shape PyTorch documents
(``torch.nn.functional.grouped_mm``): (rows, in) x (groups, in, out) -> (rows, out); (groups, rows, in) x
(groups, in, out) -> (groups, rows, out); (rows, in) x (in, out) grouped along in -> (groups, rows, out);
(groups, rows, in) x (in, out) grouped along rows -> (rows, out). Shapes only: no kernel computes with it.
"""

from __future__ import annotations

import torch

_INSTALLED: list[object] = []       # the Library keeping the registration alive


def _shape(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> tuple[int, ...]:
    if a.dim() == 2 and b.dim() == 3:
        return (a.shape[0], b.shape[2])
    if a.dim() == 3 and b.dim() == 3:
        return (a.shape[0], a.shape[1], b.shape[2])
    groups = offs.shape[0] if offs is not None else 1
    if a.dim() == 2 and b.dim() == 2:
        return (groups, a.shape[0], b.shape[1])
    return (a.shape[1], b.shape[1])


def _grouped_mm_meta(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    if mat_a.dtype == torch.bfloat16 and mat_b.dtype == torch.bfloat16:
        from torch._meta_registrations import meta_grouped_mm
        return meta_grouped_mm(mat_a, mat_b, offs=offs, bias=bias, out_dtype=out_dtype)
    torch._check(mat_a.dtype == mat_b.dtype and mat_a.dtype.is_floating_point,
                 lambda: f"grouped_mm needs two float operands of one dtype, got {mat_a.dtype} and {mat_b.dtype}")
    torch._check(mat_a.shape[-1] == mat_b.shape[-2],
                 lambda: f"grouped_mm contracts {mat_a.shape[-1]} with {mat_b.shape[-2]} features")
    return mat_a.new_empty(_shape(mat_a, mat_b, offs), dtype=out_dtype or mat_a.dtype)


def install_grouped_mm_meta() -> None:
    """Register the meta kernel above for ``aten::_grouped_mm`` (idempotent)."""
    if _INSTALLED:
        return
    library = torch.library.Library("aten", "IMPL")
    library.impl("_grouped_mm", _grouped_mm_meta, "Meta")
    _INSTALLED.append(library)


__all__ = ["install_grouped_mm_meta"]
