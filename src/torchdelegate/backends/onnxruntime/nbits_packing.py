"""Quantized integers packed as ONNX Runtime's integer kernels read them: ``MatMulNBits``' layout, which
``GatherBlockQuantized`` shares (4 or 8 bits, each value offset by half the range, two per byte low
nibble first at 4 bits, a row in blocks padded with the layer's zeros), zero points alike, and the
width a layer's integers need.

Packing goes a slice of rows at a time into the array it is given (a spilled one), the pages of each
slice let go as it is written: a weight's packed form is never whole in memory.
"""

from __future__ import annotations

import numpy as np

from torchdelegate.exported.mapped_pages import release_buffer

_ROWS_PER_STEP = 4096  # rows packed at a time: the temporaries stay a slice of a weight


def kernel_bits(integers: np.ndarray, points: np.ndarray | None) -> int:
    """4 when the integers and zero points fit int4, else 8; a ``ValueError`` if zero points do not fit int8."""
    if points is not None and (points.min(initial=0) < -128 or points.max(initial=0) > 127):
        raise ValueError(
            "zero points outside [-128, 127], which MatMulNBits cannot hold; quantize with int8 zero points "
            "(torchao's defaults), or keep this layer in float"
        )
    narrow = all(-8 <= a.min(initial=0) and a.max(initial=0) <= 7 for a in (integers, points) if a is not None)
    return 4 if narrow else 8


def packed_integers(integers: np.ndarray, block: int, bits: int, out: np.ndarray | None = None) -> np.ndarray:
    """``[N, blocks, block * bits / 8]`` uint8: each value plus half the range (so int4's -8 is 0),
    two per byte low nibble first at 4 bits; a row's last block padded with zeros of the layer.
    Written into ``out`` (spilled) when given, the pages of each step's integers and output let go."""
    rows, columns = integers.shape
    blocks = -(-columns // block)
    offset = 1 << (bits - 1)
    packed = np.empty((rows, blocks, block * bits // 8), dtype=np.uint8) if out is None else out
    for start in range(0, rows, _ROWS_PER_STEP):
        stop = min(rows, start + _ROWS_PER_STEP)
        unsigned = np.full((stop - start, blocks * block), offset, dtype=np.uint8)
        np.add(integers[start:stop].view(np.uint8), offset, out=unsigned[:, :columns], casting="unsafe")
        if bits == 4:
            unsigned &= 0x0F
            unsigned = unsigned[:, 0::2] | (unsigned[:, 1::2] << 4)
        packed[start:stop] = unsigned.reshape(stop - start, blocks, -1)
        release_buffer(integers[start:stop])
        release_buffer(packed[start:stop])
    return packed


def packed_points(points: np.ndarray, bits: int) -> np.ndarray:
    """Zero points as the kernel reads them: ``[N, ceil(blocks * bits / 8)]`` uint8, offset as the values are."""
    offset = 1 << (bits - 1)
    unsigned = (points.astype(np.int16) + offset).astype(np.uint8)
    if bits == 8:
        return unsigned
    if unsigned.shape[1] % 2:
        unsigned = np.concatenate([unsigned, np.full((unsigned.shape[0], 1), offset, np.uint8)], axis=1)
    return (unsigned[:, 0::2] & 0x0F) | (unsigned[:, 1::2] << 4)
