"""The e4m3 codec the FP8 kernels share (the KV cache's store and attention, the FP8 weights'
weight-only product): float32 <-> the bits of float8_e4m3fn, in integer arithmetic.

Triton rejects the float8e4nv type on sm_80 (triton/backends/nvidia/compiler.py adds it to the
supported types from sm_89 only), so the kernels read and write FP8 tensors as uint8 views and
convert here, on every target alike (and in the interpreter). Exact both ways, checked over
every e4m3 value and every midpoint between two (tests/test_fp8_kv.py):
  decode   e4m3 bits s eeee mmm shifted into a float16's as s 0eeee mmm0000000 are the value
           times 2^-8, normals and subnormals alike (2^(e-7) = 2^(e-15) * 2^8, and 2^-6 =
           2^-14 * 2^8): one shift and a bitcast. The callers fold DECODE_SCALE = 2^8 into
           their own scales (the KV scale, the weight scale), so nothing is multiplied here.
  encode   round to nearest even at 3 mantissa bits on float32's bits (normals), or as an
           integer number of 2^-9 (subnormals, below 2^-6), saturating at +-448 as
           torch's .to(torch.float8_e4m3fn) of a clamped value does.
"""

from __future__ import annotations

import triton
import triton.language as tl

DECODE_SCALE = 256.0  # decode_e4m3(bits) * DECODE_SCALE is the e4m3 value
E4M3_MAX = 448.0


@triton.jit
def decode_e4m3(bits):
    """uint8 bits of float8_e4m3fn -> float16, the value times 2^-8 (exact)."""
    h = bits.to(tl.uint16)
    h = ((h & 0x80) << 8) | ((h & 0x7F) << 7)
    return h.to(tl.float16, bitcast=True)


@triton.jit
def encode_e4m3(x):
    """float32 -> uint8 bits of float8_e4m3fn: nearest, ties to even, saturated at +-448."""
    a = tl.minimum(tl.abs(x), 448.0)
    bits = a.to(tl.uint32, bitcast=True)
    # normals: 3 mantissa bits kept, rounded to nearest even; exponent re-biased 127 -> 7
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - (120 << 3)
    # subnormals (a < 2^-6): the nearest (ties to even) multiple of 2^-9, by float32's own
    # rounding of a * 2^9 + 1.5 * 2^23 (a * 2^9 is exact, so a fused multiply-add is too)
    sub = ((a * 512.0 + 12582912.0) - 12582912.0).to(tl.uint32)
    magnitude = tl.where(a < 0.015625, sub, normal)
    sign = (x.to(tl.uint32, bitcast=True) >> 31) << 7
    return (magnitude | sign).to(tl.uint8)
