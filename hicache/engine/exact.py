"""Batch-invariant arithmetic: every result element depends only on its own inputs.

The reference engine must give bit-identical logits for a token however its sequence was
chunked, batched or resumed from cached KV. Library kernels do not promise that:
``matmul`` picks different blocking for different batch sizes, ``sum`` regroups its
reduction with the shape, and transcendental functions such as ``exp`` run a SIMD
polynomial on most elements but a scalar libm call on the tail of a buffer, so the bits
of one element depend on where it sits in the tensor.

So this module builds everything from operations whose result is exact per element
whatever the shape, stride, thread split or vector width: IEEE ``+ - * /`` and ``sqrt``
(correctly rounded), ``round``/``clamp``/``where``/``max`` (exact), integer bit
operations and indexing. Each is a separate eager op, so no multiply-add is ever fused.

* Sums run a fixed binary tree over *index* positions (pairs ``(0,1), (2,3), ...``, then
  pairs of pairs) padded with zeros. Any extra entries at the end of the reduced dimension
  are zero, and a zero subtree leaves a sum unchanged, so a sum over keys ``0..t`` gives
  the same bits whether the tensor holds ``t+1`` keys or ``t+1000`` masked ones.
* ``exp`` is a Cody-Waite range reduction, a degree-7 polynomial in Horner form and an
  exponent built from integer bits.
"""

from __future__ import annotations

import torch

_LOG2E = 1.4426950408889634
# ln 2 split so that k * _LN2_HI is exact for the |k| <= 127 that clamped inputs give.
_LN2_HI = 0.693145751953125
_LN2_LO = 1.428606765330187e-06
# Taylor coefficients of exp on |r| <= ln2/2, highest degree first (error < 1 ulp-ish).
_EXP_COEFFS = (1 / 5040, 1 / 720, 1 / 120, 1 / 24, 1 / 6, 1 / 2, 1.0, 1.0)
# Inputs beyond these would make 2**k leave the normal float32 exponent range.
_EXP_MIN = -87.0
_EXP_MAX = 88.0


def tree_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over ``dim`` in a fixed pairwise order that depends only on index positions.

    Entries ``(0,1), (2,3), ...`` are added first, then pairs of those sums, and so on; an
    odd length is padded with one zero. Appending zeros to ``x`` along ``dim`` never
    changes a bit of the result, which is what makes masked, padded reductions invariant
    to the padded length. Returns ``x`` with ``dim`` removed.
    """
    dim = dim % x.dim()
    lead = (slice(None),) * dim
    while x.shape[dim] > 1:
        if x.shape[dim] % 2:
            pad_shape = list(x.shape)
            pad_shape[dim] = 1
            x = torch.cat([x, x.new_zeros(pad_shape)], dim=dim)
        x = x[(*lead, slice(0, None, 2))] + x[(*lead, slice(1, None, 2))]
    return x.squeeze(dim)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight (+ bias)`` with ``weight`` as ``[d_in, d_out]``, batch-invariant.

    Each output is the :func:`tree_sum` over ``d_in`` of elementwise products, so a row's
    result does not depend on how many rows are computed with it.
    """
    out = tree_sum(x.unsqueeze(-1) * weight, dim=-2)
    if bias is not None:
        out = out + bias
    return out


def exp(x: torch.Tensor) -> torch.Tensor:
    """``e**x`` for float32 to about one ulp, elementwise exact whatever the tensor's shape.

    Inputs are clamped to [-87, 88], so the result is never 0 or inf; callers that need
    exact zeros (masked softmax entries) select them afterwards.
    """
    x = x.clamp(_EXP_MIN, _EXP_MAX)
    k = torch.round(x * _LOG2E)
    r = x - k * _LN2_HI
    r = r - k * _LN2_LO
    p = torch.full_like(r, _EXP_COEFFS[0])
    for c in _EXP_COEFFS[1:]:
        p = p * r
        p = p + c
    two_to_k = torch.bitwise_left_shift(k.to(torch.int32) + 127, 23).view(torch.float32)
    return p * two_to_k


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + e**-x)``, built on :func:`exp`."""
    return 1.0 / (exp(-x) + 1.0)


def silu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(x)``, built on :func:`exp`."""
    return x / (exp(-x) + 1.0)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS normalisation over the last dimension, scaled by ``weight``."""
    mean_square = tree_sum(x * x, dim=-1) / x.shape[-1]
    return x / torch.sqrt(mean_square + eps).unsqueeze(-1) * weight
