"""Constructors of the XNNGraph node bodies that several lowerings share.

Each returns a flatbuffers object-API body (``fbx.*T``) for
:meth:`.graph_builder.GraphBuilder.add_node`; bodies only one op family uses
are built in its room under :mod:`.ops`.
"""

from __future__ import annotations

from .generated import xnngraph_generated as fbx


def node1x1(inp: int, out: int, flags: int = 0) -> fbx._XNNNode1x1T:
    body = fbx._XNNNode1x1T()
    body.inputId, body.outputId, body.flags = inp, out, flags
    return body


def node2x1(a: int, b: int, out: int, flags: int = 0) -> fbx._XNNNode2x1T:
    body = fbx._XNNNode2x1T()
    body.input1Id, body.input2Id, body.outputId, body.flags = a, b, out, flags
    return body


def transpose(perm: list[int], inp: int, out: int) -> fbx.XNNStaticTransposeT:
    body = fbx.XNNStaticTransposeT()
    body.numDims, body.perm, body.inputId, body.outputId, body.flags = len(perm), list(perm), inp, out, 0
    return body


def reshape(new_shape: list[int], inp: int, out: int) -> fbx.XNNStaticReshapeT:
    body = fbx.XNNStaticReshapeT()
    body.numDims, body.newShape, body.inputId, body.outputId, body.flags = len(new_shape), list(new_shape), inp, out, 0
    return body


def min_max(lo: float, hi: float) -> fbx.OutputMinMaxT:
    mm = fbx.OutputMinMaxT()
    mm.outputMin, mm.outputMax = float(lo), float(hi)
    return mm
