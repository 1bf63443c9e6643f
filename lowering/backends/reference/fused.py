"""The reference backend's fused ops: ``lowerflow_reference::addmm_relu``.

The pattern is a Linear followed by ReLU in edge form (the weight already
transposed, as :func:`lowering.export.export` folds it)::

    before:  %addmm = aten.addmm.default(%p_fc1_bias, %x, %c__folded_permute)
             %relu  = aten.relu.default(%addmm)
    after:   %addmm_relu = lowerflow_reference.addmm_relu.default(%p_fc1_bias, %x, %c__folded_permute)

The op has a CompositeExplicitAutograd kernel (so torch.export traces and
re-exports it, and lowerflow's executor runs it) and an ``.out`` overload (so
it can be memory-planned and emitted when no backend takes it).
"""

from __future__ import annotations

import torch

from ...backend_ops import FusedOp, define_fused_op

NAMESPACE = "lowerflow_reference"


def _addmm_relu(self: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor) -> torch.Tensor:
    return torch.relu(torch.addmm(self, mat1, mat2))


ADDMM_RELU = define_fused_op(
    f"{NAMESPACE}::addmm_relu", "(Tensor self, Tensor mat1, Tensor mat2) -> Tensor", _addmm_relu
)


def _linear_relu_pattern(bias: torch.Tensor, x: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    return torch.relu(torch.addmm(bias, x, weight_t))


#: The fused ops the reference partitioner applies by default (those whose op it supports).
FUSED_OPS: tuple[FusedOp, ...] = (
    FusedOp(ADDMM_RELU, _linear_relu_pattern, (torch.zeros(3), torch.zeros(2, 4), torch.zeros(4, 3))),
)
