"""Stage 8, the table builders: flatbuffer tables (EValues, Tensors, ...) from plain values.

Small functions with no state, shared by the method emitter
(:mod:`lowering.emit.method`) and its control-flow case
(:mod:`lowering.emit.control_flow`).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..dynamic import is_symbolic, upper_bound_shape
from ..errors import EmitError
from ..pte import schema
from ..pte.scalar_types import DTYPE_TO_SCALAR_TYPE


def tensor_table(val: torch.Tensor, dim_order: list[int], ranges: Any = None) -> schema.TensorT:
    """A Tensor table; a symbolic shape is DYNAMIC_BOUND with sizes at the upper bound."""
    if val.dtype not in DTYPE_TO_SCALAR_TYPE:
        raise EmitError(f"dtype {val.dtype} is not supported")
    sizes = upper_bound_shape(val, ranges)
    dynamic = any(is_symbolic(s) for s in val.shape)
    tensor = schema.TensorT()
    tensor.scalarType = DTYPE_TO_SCALAR_TYPE[val.dtype]
    tensor.storageOffset = 0
    tensor.sizes = sizes
    tensor.dimOrder = list(dim_order)
    tensor.requiresGrad = False
    tensor.dataBufferIdx = 0
    tensor.layout = 0
    tensor.shapeDynamism = (
        schema.TensorShapeDynamism.DYNAMIC_BOUND if dynamic else schema.TensorShapeDynamism.STATIC
    )
    return tensor


def empty_tensor_table() -> schema.TensorT:
    """The empty uint8 tensor ExecuTorch passes for a None non-optional tensor argument."""
    return tensor_table(torch.empty(0, dtype=torch.uint8), [0])


def allocation_details(mem_id: int, offset: int) -> schema.AllocationDetailsT:
    allocation = schema.AllocationDetailsT()
    allocation.memoryId = int(mem_id)
    allocation.memoryOffsetLow = int(offset) & 0xFFFFFFFF
    allocation.memoryOffsetHigh = int(offset) >> 32
    return allocation


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return b""
    return flat.view(torch.uint8).numpy().tobytes()


def tensor_evalue(tensor: schema.TensorT) -> schema.EValueT:
    evalue = schema.EValueT()
    evalue.valType = schema.KernelTypes.Tensor
    evalue.val = tensor
    return evalue


def scalar_evalue(value: Any) -> schema.EValueT:
    evalue = schema.EValueT()
    if value is None:
        evalue.valType, evalue.val = schema.KernelTypes.Null, schema.NullT()
    elif isinstance(value, bool):
        evalue.valType, evalue.val = schema.KernelTypes.Bool, schema.BoolT()
        evalue.val.boolVal = value
    elif isinstance(value, int):
        evalue.valType, evalue.val = schema.KernelTypes.Int, schema.IntT()
        evalue.val.intVal = value
    else:
        evalue.valType, evalue.val = schema.KernelTypes.Double, schema.DoubleT()
        evalue.val.doubleVal = float(value)
    return evalue


def string_evalue(value: str) -> schema.EValueT:
    evalue = schema.EValueT()
    evalue.valType, evalue.val = schema.KernelTypes.String, schema.StringT()
    evalue.val.stringVal = value
    return evalue


_LIST_TABLES = {
    schema.KernelTypes.IntList: schema.IntListT,
    schema.KernelTypes.TensorList: schema.TensorListT,
    schema.KernelTypes.OptionalTensorList: schema.OptionalTensorListT,
}


def list_evalue(kind: int, ids: Sequence[int]) -> schema.EValueT:
    """A boxed list: its items are value ids."""
    return inline_list_evalue(kind, _LIST_TABLES[kind](), [int(i) for i in ids])


def inline_list_evalue(kind: int, table: Any, items: list) -> schema.EValueT:
    table.items = items
    evalue = schema.EValueT()
    evalue.valType, evalue.val = kind, table
    return evalue


def list_element_type(jit_type: Any, value: Sequence[Any]) -> Any:
    """Element type of a list argument; inferred from the items when the schema gives none."""
    if isinstance(jit_type, torch.OptionalType):
        jit_type = jit_type.getElementType()
    if isinstance(jit_type, torch.ListType):
        return jit_type.getElementType()
    if all(isinstance(v, bool) for v in value):
        return torch.BoolType.get()
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return torch.IntType.get()
    if all(isinstance(v, (int, float)) for v in value):
        return torch.FloatType.get()
    return torch.TensorType.get()


def scalar_tensor_dtype(node: torch.fx.Node, value: Any) -> torch.dtype:
    """dtype of the 0-dim constant standing for a Python number in a Tensor argument.

    The node's result dtype when it is not bool (arithmetic computes in it);
    otherwise the promotion of the first tensor argument with the number.
    """
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and val.dtype != torch.bool:
        return val.dtype
    for arg in node.args:
        if isinstance(arg, torch.fx.Node) and isinstance(arg.meta.get("val"), torch.Tensor):
            return torch.result_type(arg.meta["val"], value)
    return torch.tensor(value).dtype


def compile_spec(key: str, value: bytes) -> schema.CompileSpecT:
    spec = schema.CompileSpecT()
    spec.key = key
    spec.value = list(bytes(value))
    return spec
