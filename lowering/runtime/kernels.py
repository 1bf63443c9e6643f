"""Kernels of the executor: an ``Operator`` table entry resolved to a callable.

A KernelCall's ``args`` are EValue indices: one per argument of the kernel's
schema (positional and keyword-only, in schema order, ``out`` tensors
included), followed by one for the result: the ``out`` tensor itself, or a
TensorList of the ``out`` tensors when there are several (ExecuTorch's
emitter convention).  The kernel writes its results into the ``out``
tensors, which are views of planned memory; the trailing value is not read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .errors import ExecutorError
from .kernels_llm import LLM_KERNEL_SPECS
from .kernels_quant import QUANT_KERNEL_SPECS


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
    #: The call returns a non-tensor result (a symbolic scalar op, ExecuTorch's prim ops):
    #: it goes to the trailing EValue.
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
    op = _torch_op(namespace, op_name, overload)
    if op is None and namespace != "aten":
        # A backend's fused op (lowering.backend_ops): defined when its backend is imported.
        from ..backend_ops import load_backend_op_libraries

        load_backend_op_libraries()
        op = _torch_op(namespace, op_name, overload)
    if op is None:
        raise ExecutorError(f"operator {qualified!r} has no kernel in torch.ops or the executor")
    return _aten_kernel(qualified, op)


def _torch_op(namespace: str, op_name: str, overload: str) -> torch._ops.OpOverload | None:
    try:
        return getattr(getattr(getattr(torch.ops, namespace), op_name), overload or "default")
    except (AttributeError, RuntimeError):
        return None


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


def _scalar_kernel(qualified: str, arity: int, fn: Callable[..., Any]) -> Kernel:
    """A prim op on scalars (ints, floats, bools): ``arity`` operands, one result value."""
    return Kernel(qualified, arity, 1, lambda values: fn(*values), (), True)


def _floordiv(a, b):
    return a // b


def _truediv(a, b):
    return a / b


#: ExecuTorch's symbolic scalar ops (``aten::sym_size.int``, ``executorch_prim::*.Scalar``).
_SYM_KERNELS: dict[str, Kernel] = {
    k.qualified_name: k
    for k in (
        _scalar_kernel("aten::sym_size.int", 2, lambda t, d: int(t.shape[d])),
        _scalar_kernel("aten::sym_numel", 1, lambda t: int(t.numel())),
        _scalar_kernel("aten::_local_scalar_dense", 1, lambda t: t.reshape(-1)[0].item()),
        _scalar_kernel("executorch_prim::add.Scalar", 2, lambda a, b: a + b),
        _scalar_kernel("executorch_prim::sub.Scalar", 2, lambda a, b: a - b),
        _scalar_kernel("executorch_prim::mul.Scalar", 2, lambda a, b: a * b),
        _scalar_kernel("executorch_prim::floordiv.Scalar", 2, _floordiv),
        _scalar_kernel("executorch_prim::truediv.Scalar", 2, _truediv),
        _scalar_kernel("executorch_prim::mod.Scalar", 2, lambda a, b: a % b),
        _scalar_kernel("executorch_prim::neg.Scalar", 1, lambda a: -a),
        _scalar_kernel("executorch_prim::eq.Scalar", 2, lambda a, b: a == b),
        _scalar_kernel("executorch_prim::gt.Scalar", 2, lambda a, b: a > b),
        _scalar_kernel("executorch_prim::lt.Scalar", 2, lambda a, b: a < b),
        _scalar_kernel("executorch_prim::ge.Scalar", 2, lambda a, b: a >= b),
        _scalar_kernel("executorch_prim::le.Scalar", 2, lambda a, b: a <= b),
        _scalar_kernel("executorch_prim::round.Scalar", 1, round),
        _scalar_kernel("executorch_prim::ceil.Scalar", 1, math.ceil),
        _scalar_kernel("executorch_prim::trunc.Scalar", 1, math.trunc),
        _scalar_kernel("executorch_prim::sym_float.Scalar", 1, float),
        _scalar_kernel("executorch_prim::sym_int.Scalar", 1, int),
        _scalar_kernel("executorch_prim::sym_max.Scalar", 2, max),
        _scalar_kernel("executorch_prim::sym_min.Scalar", 2, min),
        _scalar_kernel("executorch_prim::sym_not.Scalar", 1, lambda a: not a),
        _scalar_kernel("executorch_prim::sym_ite.Scalar", 3, lambda c, t, f: t if c else f),
    )
}

def _copy_index(values: list) -> None:
    """``executorch_prim::et_copy_index.tensor(copy_to, copy_from, index)``: map's output, one
    iteration at a time.  As ExecuTorch's kernel does, ``copy_to`` (DYNAMIC_BOUND) grows to
    ``index + 1`` rows in place, then row ``index`` becomes ``copy_from``."""
    copy_to, copy_from, index = values
    if index < 0:
        raise ExecutorError(f"et_copy_index into row {index}")
    copy_to.resize_((index + 1, *copy_from.shape))
    copy_to[index].copy_(copy_from)


#: ExecuTorch operators that are not torch ops, implemented here.
_PYTHON_KERNELS: dict[str, Kernel] = {
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
    **_SYM_KERNELS,
    # ExecuTorch's quantized kernel library (quantized_decomposed::*.out), ours.
    **{name: Kernel(name, num_args, 1, call, written) for name, (num_args, call, written) in QUANT_KERNEL_SPECS.items()},
    # ExecuTorch's LLM custom-ops library (llama::*.out), ours.
    **{name: Kernel(name, num_args, 1, call, written) for name, (num_args, call, written) in LLM_KERNEL_SPECS.items()},
}
