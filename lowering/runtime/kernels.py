"""Kernels of the executor: an ``Operator`` table entry resolved to a callable.

A KernelCall's ``args`` are EValue indices: one per argument of the kernel's
schema (positional and keyword-only, in schema order, ``out`` tensors
included), followed by one for the result: the ``out`` tensor itself, or a
TensorList of the ``out`` tensors when there are several (ExecuTorch's
emitter convention).  The kernel writes its results into the ``out``
tensors, which are views of planned memory; the trailing value is not read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from .errors import ExecutorError


@dataclass(frozen=True)
class Kernel:
    """A resolved operator: ``call(args)`` with the values of its schema arguments."""

    qualified_name: str
    num_args: int
    #: EValues after the arguments: 1 for an op with a result or out arguments, else 0.
    num_results: int
    call: Callable[[list], Any]
    #: Positions of arguments the kernel writes (their memory must not move).
    written: tuple[int, ...] = ()
    #: The kernel returns a non-tensor result (an int, a bool) that the
    #: executor stores in the value after the arguments (ExecuTorch's prim ops).
    returns_value: bool = False


def resolve_operator(name: str, overload: str) -> Kernel:
    """The kernel for operator ``name`` (``"aten::add"``) and ``overload`` (``"out"``, ``""``)."""
    qualified = f"{name}.{overload}" if overload else name
    python_kernel = _PYTHON_KERNELS.get(qualified)
    if python_kernel is not None:
        return python_kernel
    if "::" not in name:
        raise ExecutorError(f"operator {qualified!r} has no namespace (expected e.g. 'aten::add')")
    namespace, op_name = name.split("::", 1)
    try:
        packet = getattr(getattr(torch.ops, namespace), op_name)
        op = getattr(packet, overload or "default")
    except (AttributeError, RuntimeError):
        raise ExecutorError(f"operator {qualified!r} has no kernel in torch.ops or the executor") from None
    return _aten_kernel(qualified, op)


def _aten_kernel(qualified: str, op: torch._ops.OpOverload) -> Kernel:
    """Wrap a torch op: schema-ordered argument values -> positional + keyword call."""
    arguments = op._schema.arguments
    kwarg_names = [(i, a.name) for i, a in enumerate(arguments) if a.kwarg_only]
    num_positional = sum(1 for a in arguments if not a.kwarg_only)
    written = tuple(
        i for i, a in enumerate(arguments) if a.alias_info is not None and a.alias_info.is_write
    )

    def call(values: list) -> Any:
        kwargs = {name: values[i] for i, name in kwarg_names}
        return op(*values[:num_positional], **kwargs)

    has_result = bool(op._schema.returns) or any(a.is_out for a in arguments)
    return Kernel(qualified, len(arguments), int(has_result), call, written)


def _copy_into_out(values: list) -> None:
    """``out.copy_(self)`` for ExecuTorch's dim-order copy ops (self, non_blocking, dim_order, out)."""
    source, out = values[0], values[-1]
    if tuple(out.shape) != tuple(source.shape):
        raise ExecutorError(f"dim-order copy of shape {tuple(source.shape)} into {tuple(out.shape)}")
    out.copy_(source)


def _nothing(values: list) -> None:
    """``_empty_dim_order.out``: the planned out tensor already exists."""


def _copy_index(values: list) -> None:
    """``executorch_prim::et_copy_index.tensor(copy_to, copy_from, index)``: ``copy_to[index] = copy_from``
    (map's output, one iteration at a time)."""
    copy_to, copy_from, index = values
    if tuple(copy_to.shape[1:]) != tuple(copy_from.shape) or not 0 <= index < copy_to.shape[0]:
        raise ExecutorError(
            f"et_copy_index of {tuple(copy_from.shape)} into row {index} of {tuple(copy_to.shape)}"
        )
    copy_to[index].copy_(copy_from)


def _prim(name: str, fn: Callable[..., Any], num_args: int) -> Kernel:
    """A scalar prim op of ExecuTorch (``executorch_prim::add.Scalar``, ``aten::sym_size.int``):
    its result is a value, not a tensor written in place."""
    return Kernel(name, num_args, 1, lambda values: fn(*values), (), returns_value=True)


#: ExecuTorch operators that are not torch ops, implemented here.
_PYTHON_KERNELS: dict[str, Kernel] = {
    "aten::sym_size.int": _prim("aten::sym_size.int", lambda t, dim: int(t.shape[dim]), 2),
    "executorch_prim::add.Scalar": _prim("executorch_prim::add.Scalar", lambda a, b: a + b, 2),
    "executorch_prim::sub.Scalar": _prim("executorch_prim::sub.Scalar", lambda a, b: a - b, 2),
    "executorch_prim::eq.Scalar": _prim("executorch_prim::eq.Scalar", lambda a, b: a == b, 2),
    "executorch_prim::et_copy_index.tensor": Kernel(
        "executorch_prim::et_copy_index.tensor", 3, 0, _copy_index, (0,)
    ),
    "dim_order_ops::_to_dim_order_copy.out": Kernel(
        "dim_order_ops::_to_dim_order_copy.out", 4, 1, _copy_into_out, (3,)
    ),
    "dim_order_ops::_clone_dim_order.out": Kernel(
        "dim_order_ops::_clone_dim_order.out", 4, 1, _copy_into_out, (3,)
    ),
    "dim_order_ops::_empty_dim_order.out": Kernel(
        "dim_order_ops::_empty_dim_order.out", 3, 1, _nothing, (2,)
    ),
}
