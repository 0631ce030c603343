"""Batch-invariant arithmetic: every result element depends only on its own inputs.

The reference engine must give bit-identical logits for a token however its sequence was
chunked, batched or resumed from cached KV. Library kernels do not promise that:
``matmul`` picks different blocking for different batch sizes and ``sum`` regroups its
reduction with the shape, so the rounding of a float sum depends on its neighbours; and
transcendental functions may run a SIMD polynomial on most elements but a scalar libm
call on a buffer's tail.

This module removes both causes by construction:

* **Every sum is exact.** Operands of a dot product or a sum are first put on a
  fixed-point grid (:class:`Fixed`: clamped to ``±2**int_bits``, rounded to a multiple of
  ``2**-frac_bits``) and held as integer-valued float64. The formats are chosen so that
  every product and every partial sum is an integer below ``2**53``, which float64
  represents exactly; so any summation order, any blocking, any padding with zeros gives
  the same exact value, and only the final conversion rounds. That lets a plain
  ``torch.matmul`` or ``sum`` do the work. :func:`max_terms` says how many terms a sum may
  have; the model checks its dimensions against it when it is built.
* **Elementwise functions use only correctly rounded operations** (IEEE ``+ - * /``,
  ``sqrt``, ``round``, ``clamp``, ``where``, integer bit operations), each as a separate
  eager op so that nothing is fused into a multiply-add. :func:`exp` is a Cody-Waite
  range reduction, a degree-7 polynomial and an exponent built from integer bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_EXACT_FLOAT64_LIMIT = 2**53


@dataclass(frozen=True)
class Fixed:
    """A fixed-point format: ``|x| <= 2**int_bits`` in steps of ``2**-frac_bits``."""

    int_bits: int
    frac_bits: int

    @property
    def max_units(self) -> int:
        """The largest magnitude of an encoded value (in units of the grid step)."""
        return 2 ** (self.int_bits + self.frac_bits)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` clamped and rounded to the grid, as integer-valued float64 grid units."""
        bound = float(2**self.int_bits)
        # Scaling by a power of two is exact, and rounding a float32 to an integer is
        # exact, so the only loss is the intended one onto the grid.
        return torch.round(x.clamp(-bound, bound) * float(2**self.frac_bits)).to(torch.float64)


# The formats of the model's sums. Limits (terms per sum, see max_terms): linear inputs
# 2**11, head_dim 2**11, keys per query 2**16, RMS-norm width 2**13, SSM state width 2**10.
ACTIVATION = Fixed(int_bits=7, frac_bits=16)
WEIGHT = Fixed(int_bits=3, frac_bits=16)
QUERY_KEY = Fixed(int_bits=5, frac_bits=16)
PROBABILITY = Fixed(int_bits=0, frac_bits=20)
VALUE = Fixed(int_bits=5, frac_bits=12)
NORM = Fixed(int_bits=10, frac_bits=10)
SSM_STATE = Fixed(int_bits=10, frac_bits=14)
SSM_READOUT = Fixed(int_bits=5, frac_bits=14)


def max_terms(a: Fixed, b: Fixed) -> int:
    """How many products of an ``a`` and a ``b`` value a sum may add and stay exact."""
    return _EXACT_FLOAT64_LIMIT // (a.max_units * b.max_units)


def decode(units: torch.Tensor, *formats: Fixed) -> torch.Tensor:
    """Float32 value of an exact float64 sum of products of ``formats`` (one rounding)."""
    frac_bits = sum(f.frac_bits for f in formats)
    return (units * float(2.0**-frac_bits)).to(torch.float32)


class Linear:
    """``x @ weight`` (``weight`` is ``[d_in, d_out]``) with an exact, order-free sum.

    The weight is stored on the :data:`WEIGHT` grid; inputs go onto the
    :data:`ACTIVATION` grid. A row's result therefore never depends on the other rows of
    the call, nor on how BLAS blocks the product.
    """

    def __init__(self, weight: torch.Tensor) -> None:
        d_in = weight.shape[0]
        limit = max_terms(ACTIVATION, WEIGHT)
        if d_in > limit:
            raise ValueError(
                f"a linear layer with {d_in} inputs exceeds the exact-sum limit {limit}"
            )
        self.weight = WEIGHT.encode(weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return decode(torch.matmul(ACTIVATION.encode(x), self.weight), ACTIVATION, WEIGHT)


_LOG2E = 1.4426950408889634
# ln 2 split so that k * _LN2_HI is exact for the |k| <= 127 that clamped inputs give.
_LN2_HI = 0.693145751953125
_LN2_LO = 1.428606765330187e-06
# Taylor coefficients of exp on |r| <= ln2/2 from degree 7 down to degree 1 (the constant
# term 1 is added last); the truncation error stays under 2 ulp.
_EXP_COEFFS = (1 / 5040, 1 / 720, 1 / 120, 1 / 24, 1 / 6, 1 / 2, 1.0)
# Inputs beyond these would make 2**k leave the normal float32 exponent range.
_EXP_MIN = -87.0
_EXP_MAX = 88.0


def exp(x: torch.Tensor) -> torch.Tensor:
    """``e**x`` for float32 within 2 ulp, elementwise exact whatever the tensor's shape.

    Inputs are clamped to [-87, 88], so the result is never 0 or inf; callers that need
    exact zeros (masked softmax entries) select them afterwards.
    """
    x = x.clamp(_EXP_MIN, _EXP_MAX)
    k = torch.round(x * _LOG2E)
    r = x - k * _LN2_HI
    r = r - k * _LN2_LO
    p = r * _EXP_COEFFS[0]
    for c in _EXP_COEFFS[1:]:
        p = p + c
        p = p * r
    p = p + 1.0
    two_to_k = torch.bitwise_left_shift(k.to(torch.int32) + 127, 23).view(torch.float32)
    return p * two_to_k


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + e**-x)``, built on :func:`exp`."""
    return 1.0 / (exp(-x) + 1.0)


def silu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(x)``, built on :func:`exp`."""
    return x / (exp(-x) + 1.0)


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x**2) + eps)`` over the last dimension (no learned scale).

    The mean square is an exact sum on the :data:`NORM` grid, so it is the same number
    for a row in any batch.
    """
    units = NORM.encode(x)
    mean_square = decode((units * units).sum(dim=-1), NORM, NORM) / x.shape[-1]
    return x / torch.sqrt(mean_square + eps).unsqueeze(-1)
