"""torch dtype <-> ExecuTorch ScalarType code (the c10::ScalarType numbering)."""

from __future__ import annotations

import torch

from .generated.scalar_type_generated import ScalarType

#: Every dtype the format can carry, with its ScalarType code.
DTYPE_TO_SCALAR_TYPE: dict[torch.dtype, int] = {
    torch.uint8: ScalarType.BYTE,
    torch.int8: ScalarType.CHAR,
    torch.int16: ScalarType.SHORT,
    torch.int32: ScalarType.INT,
    torch.int64: ScalarType.LONG,
    torch.float16: ScalarType.HALF,
    torch.float32: ScalarType.FLOAT,
    torch.float64: ScalarType.DOUBLE,
    torch.bool: ScalarType.BOOL,
    torch.qint8: ScalarType.QINT8,
    torch.quint8: ScalarType.QUINT8,
    torch.qint32: ScalarType.QINT32,
    torch.bfloat16: ScalarType.BFLOAT16,
    torch.quint4x2: ScalarType.QUINT4X2,
    torch.quint2x4: ScalarType.QUINT2X4,
    torch.bits16: ScalarType.BITS16,
    torch.float8_e5m2: ScalarType.FLOAT8E5M2,
    torch.float8_e4m3fn: ScalarType.FLOAT8E4M3FN,
    torch.float8_e5m2fnuz: ScalarType.FLOAT8E5M2FNUZ,
    torch.float8_e4m3fnuz: ScalarType.FLOAT8E4M3FNUZ,
    torch.uint16: ScalarType.UINT16,
    torch.uint32: ScalarType.UINT32,
    torch.uint64: ScalarType.UINT64,
}

SCALAR_TYPE_TO_DTYPE: dict[int, torch.dtype] = {v: k for k, v in DTYPE_TO_SCALAR_TYPE.items()}


def dim_order_strides(sizes, dim_order) -> list[int]:
    """Element strides of a dense tensor whose dims are laid out in ``dim_order`` (outermost first)."""
    strides = [0] * len(sizes)
    step = 1
    for dim in reversed(list(dim_order)):
        strides[dim] = step
        step *= max(int(sizes[dim]), 1)
    return strides
