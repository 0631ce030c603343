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
  the same exact value. That lets a plain
  ``torch.matmul`` or ``sum`` do the work. :func:`max_terms` says how many terms a sum may
  have; the model checks its dimensions against it when it is built.
* **Elementwise functions use only correctly rounded operations** (IEEE ``+ - * /``,
  ``sqrt``, ``round``, ``clamp``, ``where``, integer bit operations), each as a separate
  eager op so that nothing is fused into a multiply-add. :func:`exp` is a Cody-Waite
  range reduction, a degree-8 polynomial and an exponent built from integer bits.

Activations are float64: a decoded exact sum is then exact too (it is below ``2**53``
grid units), and the encodings need no dtype conversions. At the model's sizes the cost
of an op is its dispatch, not its width.
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
        if x.dtype != torch.float64:
            x = x.to(torch.float64)
        # Scaling by a power of two is exact, and so is rounding to an integer, so the
        # only loss is the intended one onto the grid.
        return torch.round(x.clamp(-bound, bound) * float(2**self.frac_bits))

    def round_to_grid(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` clamped and rounded to the grid, as float64 values (not units).

        A grid value stays on the grid and within the bound when it is then stored in any
        narrower float format (bf16, fp16, fp8): either the format holds all its bits, or
        its spacing there is a multiple of the grid step, and the bound is a power of two.
        So a value read back from such storage needs no new encoding: multiplied with
        integer grid units of another format, it gives exact sums directly.
        """
        return decode(self.encode(x), self)


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
    """The float64 value of an exact sum of products of ``formats`` (exact: no rounding)."""
    return units * float(2.0 ** -sum(f.frac_bits for f in formats))


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
        """``x`` ``[..., d_in]`` (any float dtype) times the weight, as float64."""
        return decode(torch.matmul(ACTIVATION.encode(x), self.weight), ACTIVATION, WEIGHT)


_LOG2E = 1.4426950408889634
# ln 2 split so that k * _LN2_HI is exact for every |k| <= 1023 (fdlibm's constants).
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
# Taylor coefficients of exp on |r| <= ln2/2 from degree 8 down to degree 1 (the constant
# term 1 is added last): relative error below 1e-9, plenty for softmax weights that are
# rounded to 2**-20 and for decay factors.
_EXP_COEFFS = (1 / 40320, 1 / 5040, 1 / 720, 1 / 120, 1 / 24, 1 / 6, 1 / 2, 1.0)
# Inputs beyond these would make 2**k leave the normal float64 exponent range.
_EXP_MIN = -708.0
_EXP_MAX = 709.0


def exp(x: torch.Tensor) -> torch.Tensor:
    """``e**x`` as float64 (relative error below 1e-9), elementwise exact whatever the shape.

    Inputs are clamped to [-708, 709], so the result is never 0 or inf; callers that
    need exact zeros (masked softmax entries) select them afterwards.
    """
    x = x.to(torch.float64).clamp(_EXP_MIN, _EXP_MAX)
    k = torch.round(x * _LOG2E)
    r = x - k * _LN2_HI
    r = r - k * _LN2_LO
    p = r * _EXP_COEFFS[0]
    for c in _EXP_COEFFS[1:]:
        p = p + c
        p = p * r
    p = p + 1.0
    two_to_k = torch.bitwise_left_shift(k.to(torch.int64) + 1023, 52).view(torch.float64)
    return p * two_to_k


def soft_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``(1 + x / (1 + |x|)) / 2``: a rational sigmoid onto (0, 1).

    The reference model gates with this instead of the logistic function: it is as exact
    and needs five tensor ops instead of twenty-five (the engine's per-token cost is
    mostly per-op overhead at these sizes).
    """
    return (x / (x.abs() + 1.0) + 1.0) * 0.5


def soft_silu(x: torch.Tensor) -> torch.Tensor:
    """``x * soft_sigmoid(x)``: a SiLU-shaped gate built on :func:`soft_sigmoid`."""
    return x * soft_sigmoid(x)


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x**2) + eps)`` over the last dimension (no learned scale).

    The mean square is an exact sum on the :data:`NORM` grid, so it is the same number
    for a row in any batch.
    """
    units = NORM.encode(x)
    mean_square = decode((units * units).sum(dim=-1, keepdim=True), NORM, NORM) / x.shape[-1]
    return x / torch.sqrt(mean_square + eps)
