"""What an ATen op is (its kind) and what it costs in FLOPs.

Matrix products, convolutions and attention use PyTorch's own FLOP formulas
(``torch.utils.flop_counter``: 2*m*n*k per matrix product) where it has one; fused CPU attention,
which it lacks, uses the same rule: two batched products of 2*b*h*s_q*s_k*d each.
Backward of a product costs one forward product per operand that needs a gradient (dA = dC B^T,
dB = A^T dC), which gives the familiar total of 3x forward for a weight-times-activation product
(Narayanan et al., SC'21, appendix; Kaplan et al., 2020, sec. 2.1).
Other ops are memory-bound; they get a small per-element count (below) so that FLOP totals are
honest, and their backward is counted as one more pass of the same size. The cost model prices
them by bytes moved, not by these FLOPs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.utils.flop_counter import flop_registry

_KIND_BY_NAME: dict[str, str] = {}


def _register(kind: str, names: str) -> None:
    for name in names.split():
        _KIND_BY_NAME[name] = kind


_register("matmul", "mm addmm bmm baddbmm _scaled_mm matmul linear _grouped_mm")
_register("attention", "_scaled_dot_product_flash_attention_for_cpu _scaled_dot_product_flash_attention "
          "_scaled_dot_product_efficient_attention _scaled_dot_product_cudnn_attention "
          "_flash_attention_forward _efficient_attention_forward")
_register("conv", "convolution _convolution cudnn_convolution _slow_conv2d_forward")
_register("embedding", "embedding embedding_bag _embedding_bag")
_register("norm", "native_layer_norm native_batch_norm _native_batch_norm_legit "
          "_native_batch_norm_legit_functional _native_batch_norm_legit_no_training native_group_norm "
          "_fused_rms_norm rms_norm")
_register("softmax", "_softmax _safe_softmax _log_softmax")
_register("loss", "nll_loss_forward nll_loss2d_forward mse_loss binary_cross_entropy "
          "binary_cross_entropy_with_logits")
_register("dropout", "native_dropout bernoulli bernoulli_")
_register("reduction", "sum mean amax amin max min var var_mean std argmax argmin cumsum prod logsumexp "
          "norm linalg_vector_norm")
_register("copy", "clone _to_copy copy_ cat stack index index_select gather scatter scatter_add "
          "index_put index_put_ constant_pad_nd repeat_interleave repeat topk sort one_hot "
          "masked_fill masked_fill_ tril triu _unsafe_index")
_register("factory", "ones zeros empty empty_like zeros_like ones_like full full_like arange "
          "scalar_tensor new_ones new_zeros new_empty new_full rand randn randint rand_like randn_like "
          "empty_strided lift_fresh_copy")

# FLOPs per output element of memory-bound ops (forward). Rough operation counts of the usual
# kernels: a norm computes mean, variance, normalise, scale and shift; softmax max, subtract,
# exp, sum and divide.
_FLOPS_PER_ELEMENT = {"norm": 5, "softmax": 5, "elementwise": 1, "loss": 1, "reduction": 1}
_NO_FLOPS = {"embedding", "copy", "factory", "dropout"}

# Ops whose outputs alias an input without moving data, beyond those PyTorch marks as views.
ALIAS_OPS = {"_unsafe_view", "alias", "detach", "lift_fresh", "_reshape_alias", "view_as_real",
             "view_as_complex", "_conj", "_neg_view", "_unsafe_view_copy"}


def op_kind(name: str) -> str:
    """Coarse category of an ATen op given its packet name (``"addmm"``)."""
    return _KIND_BY_NAME.get(name, "elementwise")


def _numel(t: torch.Tensor) -> int:
    return math.prod(t.shape)


def attention_flops(q: torch.Tensor, k: torch.Tensor) -> int:
    """Two batched products (Q K^T and P V): 4 * b * heads * s_q * s_k * d. Causal masking is not
    discounted, following the convention of Narayanan et al. (SC'21)."""
    *batch, s_q, d = q.shape
    s_k = k.shape[-2]
    return 4 * math.prod(batch) * s_q * s_k * d


def _grouped_mm_flops(a: torch.Tensor, out: torch.Tensor) -> int:
    """A grouped product (one matrix per expert, ``aten._grouped_mm``): every row of ``a`` meets one group's matrix,
    2 * rows * in * out whatever the grouping, so the routing's balance changes no FLOP count."""
    return 2 * _numel(out) * a.shape[-1]


def forward_flops(func: torch._ops.OpOverload, kind: str, args: Sequence, kwargs: dict,
                  out: object, out_tensors: Sequence[torch.Tensor],
                  in_tensors: Sequence[torch.Tensor]) -> int:
    """Forward FLOPs of one dispatched op."""
    formula = flop_registry.get(func.overloadpacket)
    if func.overloadpacket is torch.ops.aten._grouped_mm and out_tensors:
        return _grouped_mm_flops(in_tensors[0], out_tensors[0])
    if formula is not None:
        return int(formula(*args, **kwargs, out_val=out))
    if kind == "attention":
        return attention_flops(args[0], args[1])
    if kind in _NO_FLOPS or not out_tensors:
        return 0
    if kind in ("reduction", "loss"):
        return _FLOPS_PER_ELEMENT[kind] * max((_numel(t) for t in in_tensors), default=0)
    return _FLOPS_PER_ELEMENT.get(kind, 1) * _numel(out_tensors[0])


def backward_flops(kind: str, fwd_flops: int, grad_operands: int, requires_grad: bool) -> int:
    """Backward FLOPs: one forward-sized product per operand needing a gradient for products
    (matmul, attention, conv); one forward-sized pass for everything else on the gradient path."""
    if not requires_grad:
        return 0
    if kind in ("matmul", "conv"):
        return fwd_flops * grad_operands
    if kind == "attention":
        return 2 * fwd_flops   # dV, dP, dQ, dK: four products against the forward's two
    return fwd_flops


def product_operands(kind: str, name: str, in_tensors: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    """The operands of a product whose gradients backward computes (bias excluded)."""
    if kind == "matmul":
        return in_tensors[1:3] if name in ("addmm", "baddbmm") else in_tensors[:2]
    if kind == "conv":
        return in_tensors[:2]
    return in_tensors
