"""Preprocess: a partition's ExportedProgram -> an fp32 ``XNNGraph`` payload + named weights.

One walk over the fx graph, in graph order; nothing is re-traced.  Each op has
a *check* (used by the partitioner: can the runtime take this node?) and a
*lowering* (append XNN values and nodes) registered together in the table
:data:`.ops.OPS`, so the partitioner never tags what preprocess cannot lower.
The lowerings sit one room per op family under :mod:`.ops`; this module is
the walk (:func:`lower_nodes`); the :class:`~.builder.GraphBuilder` they append to (values,
constants, layouts, clamp fusion) has its own room, :mod:`.builder`; what checks and lowerings share about fx values is in
:mod:`.values`, the common node bodies in :mod:`.xnodes`.

What happens on the way, per node:

- static inputs (parameters, buffers, lifted constants, and ``permute_copy`` /
  ``view_copy`` / ``clone`` of them) are folded into constants: fp32 bytes in
  the program's named data, keyed by their sha256;
- BatchNorm after a convolution that has no other user is folded into the
  convolution's filter and bias; any other BatchNorm becomes a multiply and an
  add by constants::

      before:  %conv = convolution(%x, %w, %b)   %bn = batch_norm(%conv, %g, %beta, %m, %v)
               %y = getitem(%bn, 0)              %r = relu(%y)
      after:   Conv2d(x, w*s, (b-m)*s+beta) with output_min_max (0, inf)      s = g/sqrt(v+eps)

- relu / hardtanh / clamp after an FC, convolution, add, subtract or multiply
  that has no other user becomes that node's ``output_min_max``;
- layout: convolutions and poolings compute in NHWC.  Each 4-D value has the
  layout its producer gave it; an op that needs the other one gets a
  ``StaticTranspose`` (one per value and layout, cached), elementwise ops follow
  their inputs, so transposes appear only where the layout changes (graph
  inputs and outputs are NCHW):

      x(NCHW) -T-> conv -> relu -> maxpool -> conv -> add -> avgpool -T-> view -> FC

- quantized programs: the plan of :mod:`.qplan` gives each node computing quantized
  its qint8 output parameters (:meth:`GraphBuilder.define` and :meth:`GraphBuilder.output`
  define its values with them); q/dq nodes become aliases or Converts
  (:mod:`.ops.quantized`)::

      x -Convert(qint8)-T-> Conv2d(qcint8, qcint32) -> MaxPool -> ... -> FC -Convert(fp32)->
"""

from __future__ import annotations

import operator

from torch.export import ExportedProgram

from . import payload as P
from .builder import GraphBuilder
from .ops import OPS, PLANS, check_node, lower_getitem, rule_of
from .values import Context, XnnpackPreprocessError


def lower_nodes(self: GraphBuilder) -> None:
    """The walk: the op table's plans, then every node in graph order through its room's lowering."""
    graph = self.ep.graph
    for plan in PLANS:
        plan(self)
    for node in graph.nodes:
        self.node = node
        if node.op != "call_function":
            continue
        if node in self.skip or node in self.qplan.dynamic_parts:
            continue  # part of a pattern another node lowers
        if node.target is operator.getitem:
            lower_getitem(self, node)
            continue
        if self.ctx.is_static(node):
            continue  # folded: a constant defined where it is used
        rule = rule_of(node.target)
        if rule is None:
            raise XnnpackPreprocessError(f"node {node.name!r}: no XNNPACK lowering for {node.target}")
        reason = check_node(node, self.ctx)
        if reason:
            raise XnnpackPreprocessError(f"node {node.name!r} ({node.target}): {reason}")
        rule.lower(self, node)


def preprocess_program(ep: ExportedProgram, stable_keys: bool = False) -> tuple[bytes, dict[str, bytes]]:
    """The payload bytes and named data of one partition: keyed by sha256 (ExecuTorch's
    keying), or with ``stable_keys`` by weight name and role (:meth:`GraphBuilder.constant_key`)."""
    builder = GraphBuilder(ep, stable_keys=stable_keys)
    graph = builder.build(lower_nodes)
    return P.serialize_payload(graph), dict(builder.named_data)


__all__ = ["Context", "GraphBuilder", "OPS", "XnnpackPreprocessError", "check_node", "preprocess_program"]
