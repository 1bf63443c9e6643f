"""The XNNPACK backend's fused ops: ``lowerflow_xnnpack::addmm_relu``.

XNNPACK computes an activation clamp as part of a FullyConnected node
(``output_min`` / ``output_max``), so ``relu(addmm(b, x, W))`` is one node::

    before:  %addmm = aten.addmm.default(%b, %x, %w)    %relu = aten.relu.default(%addmm)
    after:   %addmm_relu = lowerflow_xnnpack.addmm_relu.default(%b, %x, %w)
    payload: FullyConnected(x, w, b, TRANSPOSE_WEIGHTS) output_min_max (0, inf)

Preprocess folds a relu after an FC into the FC anyway, so the payload is the
same either way; the fused op makes the fusion a property of the graph that
the partitioner (and re-export) sees.  Not applied by default: an
``addmm_relu`` XNNPACK did not take would stay in the top-level program, and
ExecuTorch's portable runtime has no kernel for it.  Opt in with
``XnnpackPartitioner(fused_ops=FUSED_OPS)`` (or ``fused_ops=["lowerflow_xnnpack::addmm_relu"]``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...backend_ops import FusedOp, define_fused_op
from .generated import xnngraph_generated as fbx
from .ops import OpRule, linear, register
from .xnodes import min_max

if TYPE_CHECKING:
    from .builder import GraphBuilder

NAMESPACE = "lowerflow_xnnpack"


def _addmm_relu(self: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor) -> torch.Tensor:
    return torch.relu(torch.addmm(self, mat1, mat2))


ADDMM_RELU = define_fused_op(
    f"{NAMESPACE}::addmm_relu", "(Tensor self, Tensor mat1, Tensor mat2) -> Tensor", _addmm_relu
)
linear.ADDMM_LIKE.add(ADDMM_RELU)


def _lower_addmm_relu(b: GraphBuilder, node: torch.fx.Node) -> None:
    """FullyConnected (plus an Add for a runtime bias) with the relu as its output clamp."""
    linear.lower_fully_connected(b, node)
    last: fbx.XNodeT = b.nodes[-1]
    last.outputMinMax = min_max(0.0, float("inf"))


register(ADDMM_RELU, OpRule(_lower_addmm_relu, linear.check_fully_connected))


def _linear_relu_pattern(bias: torch.Tensor, x: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    return torch.relu(torch.addmm(bias, x, weight_t))


#: Declared fused ops (opt-in, see the module docstring).
FUSED_OPS: tuple[FusedOp, ...] = (
    FusedOp(ADDMM_RELU, _linear_relu_pattern, (torch.zeros(3), torch.zeros(2, 4), torch.zeros(4, 3))),
)
