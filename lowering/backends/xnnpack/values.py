"""What preprocess knows about a partition's fx values: static data, dims, layouts.

- :class:`Context`: which placeholders are static data (parameters, buffers,
  lifted constants that are not mutated), and their tensors; checks and
  lowerings ask it whether an operand folds into a constant;
- :func:`val`, :func:`shape`: a node's example value and its (upper-bound) dims;
- the two layouts a 4-D XNN value can have (:data:`NCHW`, :data:`NHWC`) and the
  permutations between them; :class:`Value`, a node's XNN value and its layout;
- small argument helpers more than one op family uses.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from ...delegation import SHARED_STATE
from ...dynamic import upper_bound_shape
from ...errors import BackendError
from .qparams import WEIGHT_DQ, is_op

aten = torch.ops.aten

NCHW, NHWC = "nchw", "nhwc"
TO_NHWC = [0, 2, 3, 1]
TO_NCHW = [0, 3, 1, 2]


class XnnpackPreprocessError(BackendError):
    """A node the XNNPACK backend cannot lower; the message names it."""


@dataclass
class Value:
    """The XNN value holding a node's result, and the layout it is in."""

    id: int
    layout: str
    dims: list[int]


#: Ops of static data that preprocess folds into a constant (see :meth:`Context.is_static`).
FOLDABLE = (aten.permute_copy.default, aten.view_copy.default, aten.clone.default, aten.alias_copy.default,
            aten.expand_copy.default, aten.unsqueeze_copy.default, aten.squeeze_copy.dims)


class Context:
    """What checks need to know about the program: which placeholders are static data."""

    def __init__(self, ep: ExportedProgram) -> None:
        sig = ep.graph_signature
        mutated = set(sig.buffers_to_mutate.values())
        kinds = {s.arg.name: s for s in sig.input_specs if hasattr(s.arg, "name")}
        self.ep = ep
        self.static_targets: dict[torch.fx.Node, str] = {}
        for node in ep.graph.nodes:
            if node.op != "placeholder":
                continue
            spec = kinds.get(node.name)
            if spec is None or spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
                continue
            if spec.target in mutated or node.meta.get(SHARED_STATE):  # state: read at run time
                continue
            self.static_targets[node] = spec.target
        #: The quantization plan (:mod:`.qplan`), set by whoever builds this context for a walk.
        self.qplan = None

    def tensor(self, node: torch.fx.Node) -> torch.Tensor:
        target = self.static_targets[node]
        table = self.ep.constants if target in self.ep.constants else self.ep.state_dict
        return table[target].detach()

    def is_static(self, arg: Any) -> bool:
        """A static placeholder, a permute/view/clone of one, or the dequantization of a static
        quantized weight (folded at preprocess)."""
        if not isinstance(arg, torch.fx.Node):
            return False
        if arg in self.static_targets:
            return True
        if arg.op != "call_function":
            return False
        if arg.target in FOLDABLE:
            return self.is_static(arg.args[0])
        return is_op(arg, WEIGHT_DQ) and all(self.is_static(a) for a in arg.all_input_nodes)

    def static_value(self, node: torch.fx.Node) -> torch.Tensor:
        """The tensor of a static placeholder, or of a permute/view/clone of one."""
        if node in self.static_targets:
            return self.tensor(node)
        source = self.static_value(node.args[0])
        if node.target is aten.permute_copy.default:
            return source.permute(node.args[1])
        if node.target is aten.expand_copy.default:
            return source.expand(shape(node))
        if node.target in (aten.view_copy.default, aten.unsqueeze_copy.default, aten.squeeze_copy.dims):
            return source.reshape(shape(node))
        return source


def val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def shape(node: torch.fx.Node) -> list[int]:
    """The node's dims; a symbolic size at its upper bound (the runtime reshapes the
    graph to the actual input sizes before each run, as ExecuTorch's XNNPACK delegate does)."""
    return upper_bound_shape(node.meta["val"], what=f"node {getattr(node, 'name', node)!r}")


def pair(v: Any) -> list[int]:
    """A 2-D window argument (kernel, stride, padding, dilation) as ``[h, w]``."""
    v = [int(x) for x in (v if isinstance(v, (list, tuple)) else [v])]
    return v * 2 if len(v) == 1 else v


def only_first_result(node: torch.fx.Node) -> str | None:
    """A check for multi-result ops: only result 0 may be used."""
    for user in node.users:
        if user.target is not operator.getitem or user.args[1] != 0:
            return "a result other than the first is used"
    return None
