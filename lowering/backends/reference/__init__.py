"""The ``reference`` backend: an op-allowlist partitioner and a self-contained payload.

``ReferencePartitioner`` tags maximal groups of allowlisted core-ATen ops
(after fusing ``addmm → relu`` into the backend's own ``lowerflow_reference::addmm_relu``,
see :mod:`.fused`);
``ReferenceBackend.preprocess`` memory-plans the partition's program and emits
it as a nested ``.pte`` (stages 7 and 8 applied to the partition), and
:class:`.runtime.ReferenceRuntime` executes that payload with lowerflow's own
executor, without the original Python objects.  The runtime is found by the
executor through the ``lowerflow.backend_runtimes`` entry point.
"""

from __future__ import annotations

from typing import Iterable

import torch

from ...emit import emit_program
from ...lowered_module import BackendDetails, PreprocessResult
from ...memory_plan import memory_plan
from ...partition import CompileSpec, OpSupportPartitioner
from . import fused
from .fused import ADDMM_RELU
from .runtime import ReferenceRuntime

BACKEND_ID = "ReferenceBackend"

aten = torch.ops.aten

#: Ops the reference backend takes by default: the elementwise and linear-algebra
#: core of MLPs, CNNs and attention.  Deliberately not everything, so that real
#: models split into several partitions.
SUPPORTED_OPS = frozenset(
    {
        aten.add.Tensor,
        aten.sub.Tensor,
        aten.mul.Tensor,
        aten.mul.Scalar,
        aten.div.Tensor,
        aten.relu.default,
        aten.sigmoid.default,
        aten.tanh.default,
        aten.addmm.default,
        aten.mm.default,
        aten.bmm.default,
        aten.permute_copy.default,
        aten.view_copy.default,
        aten.convolution.default,
        aten._native_batch_norm_legit_no_training.default,
        aten.sum.dim_IntList,
        ADDMM_RELU,  # a fused op: lowering.backend_ops, .fused
    }
)


class ReferencePartitioner(OpSupportPartitioner):
    """Tags maximal groups of ``supported_ops``.

    ``fused_ops`` (:class:`lowering.backend_ops.FusedOp`, or their op names from a
    manifest) replace their patterns before tagging; by default the ones of
    :data:`.fused.FUSED_OPS` whose op is in ``supported_ops``.  ``[]`` applies none.
    """

    def __init__(
        self,
        supported_ops: Iterable[object] = SUPPORTED_OPS,
        *,
        compile_specs: Iterable[CompileSpec] = (),
        backend_id: str = BACKEND_ID,
        fused_ops: Iterable[object] | None = None,
        **options,
    ) -> None:
        supported_ops = list(supported_ops)
        if all(isinstance(op, str) for op in supported_ops):  # e.g. ["aten.add.Tensor"] from a manifest
            supported_ops = [_op_from_name(op) for op in supported_ops]
        super().__init__(backend_id, supported_ops, compile_specs=compile_specs, **options)
        if fused_ops is None:
            fused_ops = [f for f in fused.FUSED_OPS if f.op in supported_ops]
        self.fused_ops = tuple(_fused_op_from_name(f) if isinstance(f, str) else f for f in fused_ops)


def _op_from_name(name: str):
    """``"aten.add.Tensor"`` -> ``torch.ops.aten.add.Tensor``."""
    namespace, op, overload = (name.split(".") + ["default"])[:3]
    try:
        return getattr(getattr(getattr(torch.ops, namespace), op), overload)
    except AttributeError as exc:
        raise ValueError(f"unknown operator {name!r}") from exc


def _fused_op_from_name(name: str):
    """``"lowerflow_reference::addmm_relu"`` -> that entry of :data:`.fused.FUSED_OPS`."""
    for candidate in fused.FUSED_OPS:
        if candidate.name == name:
            return candidate
    raise ValueError(f"unknown fused op {name!r}; the reference backend has {[f.name for f in fused.FUSED_OPS]}")


class ReferenceBackend(BackendDetails):
    @classmethod
    def partitioner(cls, **options) -> ReferencePartitioner:
        """The target's partitioner; ``options`` go to :class:`ReferencePartitioner`."""
        options.setdefault("backend_id", cls.__name__)  # subclasses partition for themselves
        return ReferencePartitioner(**options)

    @staticmethod
    def preprocess(edge_program, compile_specs) -> PreprocessResult:
        return PreprocessResult(emit_program(edge_program, memory_plan(edge_program)))


__all__ = [
    "ADDMM_RELU",
    "BACKEND_ID",
    "SUPPORTED_OPS",
    "ReferenceBackend",
    "ReferencePartitioner",
    "ReferenceRuntime",
]
