"""Preprocess: a partition's ExportedProgram -> an fp32 ``XNNGraph`` payload + named weights.

One walk over the fx graph, in graph order; nothing is re-traced.  Each op has
a *check* (used by the partitioner: can the runtime take this node?) and a
*lowering* (append XNN values and nodes) registered together in :data:`OPS`, so
the partitioner never tags what preprocess cannot lower.

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
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from ...dynamic import upper_bound_shape
from ...delegation import named_data_key
from ...errors import BackendError
from . import payload as P
from .generated import xnngraph_generated as fbx

aten = torch.ops.aten

NCHW, NHWC = "nchw", "nhwc"
_TO_NHWC = [0, 2, 3, 1]
_TO_NCHW = [0, 3, 1, 2]
_INF = float("inf")


class XnnpackPreprocessError(BackendError):
    """A node the XNNPACK backend cannot lower; the message names it."""


# --------------------------------------------------------------------------- op registry


@dataclass(frozen=True)
class OpRule:
    """How one ATen op goes to XNNPACK: ``check(node, ctx) -> reason or None``, ``lower(builder, node)``."""

    check: Callable[[torch.fx.Node, "Context"], str | None]
    lower: Callable[["GraphBuilder", torch.fx.Node], None]


OPS: dict[Any, OpRule] = {}


def _rule(*targets, check=None):
    def register(lower):
        for target in targets:
            OPS[target] = OpRule(check or (lambda n, c: None), lower)
        return lower

    return register


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
            if spec.target in mutated:
                continue
            self.static_targets[node] = spec.target

    def tensor(self, node: torch.fx.Node) -> torch.Tensor:
        target = self.static_targets[node]
        table = self.ep.constants if target in self.ep.constants else self.ep.state_dict
        return table[target].detach()

    def is_static(self, arg: Any) -> bool:
        """A static placeholder, or a permute/view/clone of one (folded at preprocess)."""
        if not isinstance(arg, torch.fx.Node):
            return False
        if arg in self.static_targets:
            return True
        return arg.op == "call_function" and arg.target in _FOLDABLE and self.is_static(arg.args[0])


_FOLDABLE = (aten.permute_copy.default, aten.view_copy.default, aten.clone.default, aten.alias_copy.default,
             aten.expand_copy.default, aten.unsqueeze_copy.default, aten.squeeze_copy.dims)


def val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def shape(node: torch.fx.Node) -> list[int]:
    """The node's dims; a symbolic size at its upper bound (the runtime reshapes the
    graph to the actual input sizes before each run, as ExecuTorch's XNNPACK delegate does)."""
    return upper_bound_shape(node.meta["val"], what=f"node {getattr(node, 'name', node)!r}")


def check_node(node: torch.fx.Node, ctx: Context) -> str | None:
    """Why the runtime cannot take ``node`` (None if it can)."""
    rule = OPS.get(node.target)
    if rule is None:
        return f"no XNNPACK lowering for {node.target}"
    if node.target in _OWN_DTYPE_CHECK:
        return rule.check(node, ctx)
    reason = _check_dtypes(node) or _check_zero_dim(node, ctx)
    return reason or rule.check(node, ctx)


def _check_zero_dim(node: torch.fx.Node, ctx: Context) -> str | None:
    """0-dim values could cross the delegate boundary, where the runtime sees no dims: keep
    them inside (static scalars are fine: they become 1-element constants)."""
    if isinstance(val(node), torch.Tensor) and val(node).dim() == 0:
        return "0-dim result"
    for a in node.all_input_nodes:
        if val(a).dim() == 0 and not ctx.is_static(a):
            return f"0-dim input {a.name!r}"
    return None


def _check_dtypes(node: torch.fx.Node) -> str | None:
    """Every tensor in and out is a non-empty fp32 tensor with static shape."""
    outs = val(node)
    outs = outs if isinstance(outs, (tuple, list)) else [outs]
    ins = [val(a) for a in node.all_input_nodes]
    for i, t in enumerate(outs):
        if i > 0 and node.target in _MULTI_OUTPUT_EXTRA_OK:
            continue  # e.g. the indices of max_pool2d_with_indices (must be unused)
        if not isinstance(t, torch.Tensor):
            return "result is not a tensor"
    for t in [o for i, o in enumerate(outs) if not (i > 0 and node.target in _MULTI_OUTPUT_EXTRA_OK)] + ins:
        if not isinstance(t, torch.Tensor):
            return "an input is not a tensor"
        if t.dtype != torch.float32:
            return f"dtype {t.dtype} (only float32)"
        if any(not isinstance(d, int) for d in t.shape):
            reason = _dynamic_reason(node)
            if reason:
                return reason
        if t.numel() == 0:
            return "empty tensor"
        if t.dim() > 6:
            return "more than 6 dims"
    return None


def _dynamic_reason(node: torch.fx.Node) -> str | None:
    """Why a node with a symbolic size cannot be delegated (None: it can).

    XNNPACK reshapes its graph to the actual input sizes at run time, which is
    right for ops whose attributes do not depend on the sizes: elementwise
    ops, fully connected (a dynamic batch of rows) and softmax over a static
    last dim.  Others bake sizes into the graph (reshape, slice, concat, pad,
    ...) and stay in the portable program.
    """
    if node.target not in _DYNAMIC_OPS:
        return ("dynamic shape: XNNPACK takes symbolic sizes only in elementwise ops, "
                "fully connected and softmax")
    if node.target is aten._softmax.default:
        dim = node.args[1] % val(node).dim()
        if not isinstance(val(node).shape[dim], int):
            return "dynamic shape: softmax over a symbolic dim"
    return None


_MULTI_OUTPUT_EXTRA_OK = set()
#: Ops whose rule checks dtypes itself (parts of a pattern with a bool value inside).
_OWN_DTYPE_CHECK: set = set()


def _only_getitem0(node: torch.fx.Node) -> str | None:
    for user in node.users:
        if user.target is not operator.getitem or user.args[1] != 0:
            return "a result other than the first is used"
    return None


# --------------------------------------------------------------------------- builder


@dataclass
class _Value:
    id: int
    layout: str
    dims: list[int]


@dataclass
class GraphBuilder:
    """Builds the XNNGraph of one partition program."""

    ep: ExportedProgram
    ctx: Context = None
    values: list[fbx.XValueT] = field(default_factory=list)
    nodes: list[fbx.XNodeT] = field(default_factory=list)
    constant_data: list[fbx.ConstantDataOffsetT] = field(default_factory=list)
    named_data: dict[str, bytes] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.ctx = Context(self.ep)
        self._constant_of_key: dict[str, int] = {}
        self._by_layout: dict[tuple[torch.fx.Node, str], int] = {}
        self._primary: dict[torch.fx.Node, _Value] = {}
        self._dims: dict[int, list[int]] = {}
        self._producer: dict[int, int] = {}  # value id -> index of the fusable XNode producing it
        self._multi: dict[torch.fx.Node, list[Any]] = {}  # multi-output node -> per-index (node-like) values
        self._external_inputs: set[int] = set()
        self._alias_of: dict[torch.fx.Node, torch.fx.Node] = {}
        self._reshape_of: dict[torch.fx.Node, torch.fx.Node] = {}  # reshape node -> its input
        self._static_cache: dict[torch.fx.Node, torch.Tensor] = {}
        self.bn_folds: dict[torch.fx.Node, torch.fx.Node] = {}  # convolution -> its BatchNorm
        self.pad_folds: set[torch.fx.Node] = set()  # zero pads folded into the convolution after them
        self.weight_views: set[torch.fx.Node] = set()  # transposed runtime weights FC reads untransposed
        self.skip: set[torch.fx.Node] = set()  # nodes a pattern lowers with another node (PReLU's gt, mul)
        self.node: torch.fx.Node | None = None
        empty = fbx.ConstantDataOffsetT()
        empty.offset, empty.size, empty.namedKey = 0, 0, ""
        self.constant_data.append(empty)

    # ------------------------------------------------------------- driver

    def build(self) -> fbx.XNNGraphT:
        graph = self.ep.graph
        user_inputs = [n for n in graph.nodes if n.op == "placeholder" and n not in self.ctx.static_targets]
        for external_id, node in enumerate(user_inputs):
            t = val(node)
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
                raise XnnpackPreprocessError(f"input {node.name!r}: only float32 tensor inputs are supported")
            vid = self._define(shape(node) or [1], external_id=external_id, flags=P.EXTERNAL_INPUT)
            self._external_inputs.add(vid)
            self._set(node, vid, NCHW)
        self._plan_batch_norm_folds()
        self._plan_pad_folds()
        self._plan_weight_views()
        self._plan_prelu()
        for node in graph.nodes:
            self.node = node
            if node.op != "call_function":
                continue
            if node.target is operator.getitem:
                self._lower_getitem(node)
                continue
            if self.ctx.is_static(node) or node in self.skip:
                continue  # folded: a constant defined where it is used, or part of a pattern
            rule = OPS.get(node.target)
            if rule is None:
                raise XnnpackPreprocessError(f"node {node.name!r}: no XNNPACK lowering for {node.target}")
            reason = check_node(node, self.ctx)
            if reason:
                raise XnnpackPreprocessError(f"node {node.name!r} ({node.target}): {reason}")
            rule.lower(self, node)
        self.node = None
        output_ids = self._outputs(len(user_inputs))
        graph_t = fbx.XNNGraphT()
        graph_t.version = "0"
        graph_t.xnodes = self.nodes
        graph_t.xvalues = self.values
        graph_t.numExterns = len(user_inputs) + len(output_ids)
        if graph_t.numExterns > P.MAX_EXTERNS:
            raise XnnpackPreprocessError(f"{graph_t.numExterns} inputs and outputs exceed the runtime's {P.MAX_EXTERNS}")
        graph_t.inputIds = [self._by_layout[(n, NCHW)] for n in user_inputs]
        graph_t.outputIds = output_ids
        graph_t.constantData = self.constant_data
        return graph_t

    def _outputs(self, n_inputs: int) -> list[int]:
        """Mark each returned value an external output (NCHW); copy where the runtime needs a node."""
        out_node = self.ep.graph.output_node()
        specs = self.ep.graph_signature.output_specs
        ids = []
        for i, (arg, spec) in enumerate(zip(out_node.args[0], specs)):
            if spec.kind != OutputKind.USER_OUTPUT:
                raise XnnpackPreprocessError(f"output {i} ({spec.kind.name}): only user outputs can be delegated")
            if not isinstance(arg, torch.fx.Node):
                raise XnnpackPreprocessError(f"output {i} is not a tensor")
            self.node = arg
            vid = self.get(arg, NCHW)
            table = self.values[vid].xvalueUnion
            if vid in self._external_inputs or table.flags & P.EXTERNAL_OUTPUT or table.constantBufferIdx:
                copy = self._define(self._dims[vid])
                self._node(fbx.NodeUnion.XNNCopy, _node1x1(vid, copy))
                vid, table = copy, self.values[copy].xvalueUnion
            table.flags |= P.EXTERNAL_OUTPUT
            table.externalId = n_inputs + i
            ids.append(vid)
        return ids

    # ------------------------------------------------------------- values

    def _define(self, dims: list[int], *, constant: int = 0, external_id: int = P.INVALID_ID, flags: int = 0) -> int:
        tensor = fbx.XNNTensorValueT()
        tensor.datatype = P.DATATYPE_FP32
        tensor.numDims = len(dims)
        tensor.dims = [int(d) for d in dims]
        tensor.constantBufferIdx = constant
        tensor.externalId = external_id
        tensor.flags = flags
        tensor.idOut = len(self.values)
        value = fbx.XValueT()
        value.xvalueUnionType = fbx.ValueUnion.XNNTensorValue
        value.xvalueUnion = tensor
        self.values.append(value)
        self._dims[tensor.idOut] = list(tensor.dims)
        return tensor.idOut

    def constant(self, tensor: torch.Tensor) -> int:
        """A new value holding ``tensor`` (fp32), its bytes as named data keyed by sha256."""
        t = tensor.detach().to(torch.float32).contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        key = named_data_key(data)
        if key not in self._constant_of_key:
            entry = fbx.ConstantDataOffsetT()
            entry.offset, entry.size, entry.namedKey = P.NAMED_OFFSET, len(data), key
            self._constant_of_key[key] = len(self.constant_data)
            self.constant_data.append(entry)
            self.named_data[key] = data
        return self._define(list(t.shape) or [1], constant=self._constant_of_key[key])

    def _set(self, node: torch.fx.Node, vid: int, layout: str) -> None:
        self._by_layout[(node, layout)] = vid
        self._primary.setdefault(node, _Value(vid, layout, self._dims[vid]))

    def output(self, node: torch.fx.Node, layout: str = NCHW) -> int:
        """Define ``node``'s result value in ``layout`` (dims permuted for NHWC)."""
        dims = shape(node) or [1]
        if layout == NHWC:
            dims = [dims[i] for i in _TO_NHWC]
        vid = self._define(dims)
        self._set(node, vid, layout)
        return vid

    def alias(self, node: torch.fx.Node, source: torch.fx.Node) -> None:
        """``node`` computes nothing: it is ``source``'s value."""
        primary = self.primary(source)
        self._alias_of[node] = source
        self._set(node, primary.id, primary.layout)
        for layout in (NCHW, NHWC):
            if (source, layout) in self._by_layout:
                self._by_layout.setdefault((node, layout), self._by_layout[(source, layout)])

    def primary(self, node: torch.fx.Node) -> _Value:
        if node not in self._primary:
            if self.ctx.is_static(node):
                vid = self.constant(self.static_tensor(node))
                self._set(node, vid, NCHW)
            else:
                raise XnnpackPreprocessError(f"node {self._name()}: input {node.name!r} has no XNNPACK value")
        return self._primary[node]

    def layout(self, node: Any) -> str:
        return self.primary(node).layout if isinstance(node, torch.fx.Node) else NCHW

    def get(self, node: torch.fx.Node, layout: str | None = None) -> int:
        """``node``'s value in ``layout`` (its own layout if None), transposing once if needed."""
        primary = self.primary(node)
        layout = layout or primary.layout
        key = (node, layout)
        if key in self._by_layout:
            return self._by_layout[key]
        if len(primary.dims) != 4:
            raise XnnpackPreprocessError(f"node {self._name()}: {node.name!r} is not 4-D, it has no NHWC layout")
        if self.ctx.is_static(node):
            t = self.static_tensor(node)
            vid = self.constant(t.permute(_TO_NHWC) if layout == NHWC else t)
        else:
            perm = _TO_NHWC if layout == NHWC else _TO_NCHW
            vid = self._define([primary.dims[i] for i in perm])
            self._node(fbx.NodeUnion.XNNStaticTranspose, _transpose(perm, primary.id, vid))
        self._by_layout[key] = vid
        return vid

    def static_tensor(self, node: torch.fx.Node) -> torch.Tensor:
        """The value of a static node: a placeholder's tensor, or a fold of permute/view/clone of one."""
        if node not in self._static_cache:
            if node in self.ctx.static_targets:
                t = self.ctx.tensor(node)
            else:
                source = self.static_tensor(node.args[0])
                if node.target is aten.permute_copy.default:
                    t = source.permute(node.args[1])
                elif node.target is aten.expand_copy.default:
                    t = source.expand(shape(node))
                elif node.target in (aten.view_copy.default, aten.unsqueeze_copy.default, aten.squeeze_copy.dims):
                    t = source.reshape(shape(node))
                else:
                    t = source
            self._static_cache[node] = t
        return self._static_cache[node]

    def scalar(self, value: float) -> int:
        return self.constant(torch.tensor([float(value)]))

    # ------------------------------------------------------------- nodes

    def _node(self, kind: int, body: Any, *, fusable_output: int | None = None) -> fbx.XNodeT:
        node = fbx.XNodeT()
        node.xnodeUnionType = kind
        node.xnodeUnion = body
        node.debugHandle = len(self.nodes)
        self.nodes.append(node)
        if fusable_output is not None:
            self._producer[fusable_output] = len(self.nodes) - 1
        return node

    def _name(self) -> str:
        return repr(self.node.name) if self.node is not None else "<graph>"

    def fuse_clamp(self, node: torch.fx.Node, source: torch.fx.Node, lo: float, hi: float) -> bool:
        """Fold a clamp of ``source`` into the node producing it, if nothing else reads that value
        (``source`` and every alias between it and the producer have one user each)."""
        if source not in self._primary:
            return False
        chain = source  # through aliases and reshapes (a clamp commutes with both)
        while True:
            if len(chain.users) != 1:
                return False
            if chain in self._alias_of:
                chain = self._alias_of[chain]
            elif chain in self._reshape_of:
                chain = self._reshape_of[chain]
            else:
                break
        if chain not in self._primary:
            return False
        produced = self._primary[chain]
        index = self._producer.get(produced.id)
        if index is None or self.values[produced.id].xvalueUnion.flags:
            return False
        if self._by_layout.get((chain, produced.layout)) != produced.id:
            return False
        primary = self._primary[source]
        xnode = self.nodes[index]
        if xnode.outputMinMax is not None:
            lo, hi = max(lo, xnode.outputMinMax.outputMin), min(hi, xnode.outputMinMax.outputMax)
        xnode.outputMinMax = _min_max(lo, hi)
        self._set(node, primary.id, primary.layout)
        return True

    # ------------------------------------------------------------- batch norm

    def _plan_batch_norm_folds(self) -> None:
        """BatchNorms folded into the convolution before them (its only user, static weights)."""
        for node in self.ep.graph.nodes:
            if node.target is not aten._native_batch_norm_legit_no_training.default:
                continue
            conv = node.args[0]
            if (
                isinstance(conv, torch.fx.Node)
                and conv.target is aten.convolution.default
                and len(conv.users) == 1
                and not conv.args[6]  # not transposed
                and all(self.ctx.is_static(a) for a in node.args[1:5])
                and self.ctx.is_static(conv.args[1])
                and (conv.args[2] is None or self.ctx.is_static(conv.args[2]))
            ):
                self.bn_folds[conv] = node

    def _plan_weight_views(self) -> None:
        """Transposes of runtime 2-D values used only as FullyConnected weights.

        Before::  %t = permute_copy(%w, [1, 0])    %mm = mm(%x, %t)      (%w a delegate input)
        After::   FullyConnected(x, w) without the transpose-weights flag: w is [N, K] already
        """
        weight_arg = {aten.mm.default: 1, **dict.fromkeys(ADDMM_LIKE, 2)}
        for node in self.ep.graph.nodes:
            if (
                node.target is aten.permute_copy.default
                and not self.ctx.is_static(node)
                and len(shape(node)) == 2
                and [int(p) % 2 for p in node.args[1]] == [1, 0]
                and node.users
                and all(weight_arg.get(u.target) is not None and u.args[weight_arg[u.target]] is node
                        and node not in u.args[:weight_arg[u.target]] for u in node.users)
            ):
                self.weight_views.add(node)

    def _plan_prelu(self) -> None:
        """The comparison and the product of a decomposed PReLU are computed by its PReLU node."""
        for node in self.ep.graph.nodes:
            parts = prelu_parts(node, self.ctx) if node.target is aten.where.self else None
            if parts is not None:
                self.skip.update(parts[2:])

    def _plan_pad_folds(self) -> None:
        """Zero pads of H and W whose only user is a (non-transposed) convolution.

        Before::  %pad = constant_pad_nd(%x, [0, 1, 0, 1], 0.0)   %conv = convolution(%pad, %w, ...)
        After::   Conv2d(x) with padding right/bottom += 1
        """
        for node in self.ep.graph.nodes:
            if node.target is not aten.convolution.default or node.args[6]:
                continue
            pad = node.args[0]
            if (
                isinstance(pad, torch.fx.Node)
                and pad.target is aten.constant_pad_nd.default
                and len(pad.users) == 1
                and float(pad.args[2] if len(pad.args) > 2 else 0.0) == 0.0
                and len(pad.args[1]) <= 4
                and all(int(p) >= 0 for p in pad.args[1])
                and len(shape(pad)) == 4
            ):
                self.pad_folds.add(pad)

    def batch_norm_scale_shift(self, bn: torch.fx.Node) -> tuple[torch.Tensor, torch.Tensor]:
        """``y = x * scale + shift`` per channel."""
        weight, bias, mean, var = (self.static_tensor(a) if a is not None else None for a in bn.args[1:5])
        eps = float(bn.args[6])
        inv = torch.rsqrt(var.double() + eps)
        scale = inv if weight is None else weight.double() * inv
        shift = -mean.double() * scale
        if bias is not None:
            shift = shift + bias.double()
        return scale, shift


# --------------------------------------------------------------------------- node bodies


def _node1x1(inp: int, out: int, flags: int = 0) -> fbx._XNNNode1x1T:
    body = fbx._XNNNode1x1T()
    body.inputId, body.outputId, body.flags = inp, out, flags
    return body


def _node2x1(a: int, b: int, out: int, flags: int = 0) -> fbx._XNNNode2x1T:
    body = fbx._XNNNode2x1T()
    body.input1Id, body.input2Id, body.outputId, body.flags = a, b, out, flags
    return body


def _transpose(perm: list[int], inp: int, out: int) -> fbx.XNNStaticTransposeT:
    body = fbx.XNNStaticTransposeT()
    body.numDims, body.perm, body.inputId, body.outputId, body.flags = len(perm), list(perm), inp, out, 0
    return body


def _reshape(new_shape: list[int], inp: int, out: int) -> fbx.XNNStaticReshapeT:
    body = fbx.XNNStaticReshapeT()
    body.numDims, body.newShape, body.inputId, body.outputId, body.flags = len(new_shape), list(new_shape), inp, out, 0
    return body


def _min_max(lo: float, hi: float) -> fbx.OutputMinMaxT:
    mm = fbx.OutputMinMaxT()
    mm.outputMin, mm.outputMax = float(lo), float(hi)
    return mm


# --------------------------------------------------------------------------- elementwise

_BINARY = {
    aten.add.Tensor: fbx.NodeUnion.XNNAdd,
    aten.sub.Tensor: fbx.NodeUnion.XNNSubtract,
    aten.mul.Tensor: fbx.NodeUnion.XNNMultiply,
    aten.div.Tensor: fbx.NodeUnion.XNNDiv,
    aten.maximum.default: fbx.NodeUnion.XNNMaximum,
    aten.minimum.default: fbx.NodeUnion.XNNMinimum,
    aten.add.Scalar: fbx.NodeUnion.XNNAdd,
    aten.sub.Scalar: fbx.NodeUnion.XNNSubtract,
    aten.mul.Scalar: fbx.NodeUnion.XNNMultiply,
    aten.div.Scalar: fbx.NodeUnion.XNNDiv,
}
_FUSABLE_BINARY = {aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.add.Scalar, aten.sub.Scalar, aten.mul.Scalar}


def _check_binary(node, ctx):
    if node.kwargs.get("alpha", 1) != 1 or (len(node.args) > 2 and node.args[2] != 1):
        return "alpha != 1"
    if node.kwargs.get("rounding_mode") is not None:
        return "rounding mode"
    for a in node.args[:2]:
        if not isinstance(a, (torch.fx.Node, int, float)) or isinstance(a, bool):
            return f"operand {a!r} is not a tensor or number"
    return None


def _operand_layout(b: GraphBuilder, node: torch.fx.Node) -> str:
    """NHWC when an activation operand is NHWC and every tensor operand is 4-D or a single number."""
    tensors = [a for a in node.args[:2] if isinstance(a, torch.fx.Node)]
    active = [a for a in tensors if not b.ctx.is_static(a)]
    if not any(b.layout(a) == NHWC for a in active):
        return NCHW
    for a in tensors:
        t = val(a)
        if t.dim() != 4 and not (b.ctx.is_static(a) and t.numel() == 1):
            return NCHW
    if val(node).dim() != 4:
        return NCHW
    return NHWC


def _operand(b: GraphBuilder, arg: Any, layout: str) -> int:
    if not isinstance(arg, torch.fx.Node):
        return b.scalar(arg)
    if b.ctx.is_static(arg) and val(arg).numel() == 1:
        return b.constant(b.static_tensor(arg).reshape(1))
    if val(arg).dim() != 4:
        return b.get(arg, NCHW)
    return b.get(arg, layout)


@_rule(*_BINARY, check=_check_binary)
def _lower_binary(b: GraphBuilder, node: torch.fx.Node) -> None:
    layout = _operand_layout(b, node)
    x, y = (_operand(b, a, layout) for a in node.args[:2])
    out = b.output(node, layout)
    fusable = out if node.target in _FUSABLE_BINARY else None
    b._node(_BINARY[node.target], _node2x1(x, y, out), fusable_output=fusable)


_UNARY = {
    aten.sigmoid.default: fbx.NodeUnion.XNNSigmoid,
    aten.tanh.default: fbx.NodeUnion.XNNTanh,
    aten.hardswish.default: fbx.NodeUnion.XNNHardswish,
    aten.abs.default: fbx.NodeUnion.XNNAbs,
    aten.neg.default: fbx.NodeUnion.XNNNegate,
    aten.exp.default: fbx.NodeUnion.XNNExp,
    aten.log.default: fbx.NodeUnion.XNNLog,
    aten.sqrt.default: fbx.NodeUnion.XNNSquareRoot,
    aten.rsqrt.default: fbx.NodeUnion.XNNReciprocalSquareRoot,
    aten.floor.default: fbx.NodeUnion.XNNFloor,
    aten.ceil.default: fbx.NodeUnion.XNNCeiling,
    aten.sin.default: fbx.NodeUnion.XNNSin,
    aten.cos.default: fbx.NodeUnion.XNNCos,
    aten.gelu.default: fbx.NodeUnion.XNNGelu,
}


def _check_unary(node, ctx):
    if node.target is aten.gelu.default and node.kwargs.get("approximate", "none") != "none":
        return "tanh-approximate GELU (XNNPACK's Gelu is exact)"
    return None


@_rule(*_UNARY, check=_check_unary)
def _lower_unary(b: GraphBuilder, node: torch.fx.Node) -> None:
    source = node.args[0]
    layout = b.layout(source)
    x = b.get(source, layout)
    out = b.output(node, layout)
    b._node(_UNARY[node.target], _node1x1(x, out))


_POWERS = {2: "square", 3: "cube", 0.5: "sqrt", -0.5: "rsqrt"}


def _check_pow(node, ctx):
    exponent = node.args[1]
    if isinstance(exponent, bool) or not isinstance(exponent, (int, float)) or exponent not in _POWERS:
        return f"exponent {exponent!r} (XNNPACK takes 2, 3, 0.5, -0.5)"
    return None


@_rule(aten.pow.Tensor_Scalar, check=_check_pow)
def _lower_pow(b: GraphBuilder, node: torch.fx.Node) -> None:
    """x**2 -> Square; x**3 -> Square, Multiply by x; x**0.5 -> SquareRoot; x**-0.5 -> ReciprocalSquareRoot."""
    source = node.args[0]
    layout = b.layout(source)
    x = b.get(source, layout)
    kind = _POWERS[node.args[1]]
    if kind == "cube":
        square = b._define(b._dims[x])
        b._node(fbx.NodeUnion.XNNSquare, _node1x1(x, square))
        b._node(fbx.NodeUnion.XNNMultiply, _node2x1(square, x, b.output(node, layout)))
        return
    op = {"square": fbx.NodeUnion.XNNSquare, "sqrt": fbx.NodeUnion.XNNSquareRoot,
          "rsqrt": fbx.NodeUnion.XNNReciprocalSquareRoot}[kind]
    b._node(op, _node1x1(x, b.output(node, layout)))


def _check_layer_norm(node, ctx):
    if len(node.args[1]) != 1:
        return "normalization over more than the last dim"
    return _only_getitem0(node)


@_rule(aten.native_layer_norm.default, check=_check_layer_norm)
def _lower_layer_norm(b: GraphBuilder, node: torch.fx.Node) -> None:
    """Layer norm over the last dim from XNNPACK's nodes (1.5.1 has no LayerNorm node); the
    means are FullyConnected by a constant [K, 1] of 1/K::

        mean = FC(x, 1/K)   d = x - mean   var = FC(d*d, 1/K)
        out = d * rsqrt(var + eps) [* weight] [+ bias]
    """
    source, (k,), weight, bias, eps = node.args[:5]
    x = b.get(source, NCHW)
    dims = b._dims[x]
    reduced = dims[:-1] + [1]
    averaging = b.constant(torch.full((k, 1), 1.0 / k))

    def define(d):
        return b._define(list(d))

    def fc(inp):
        out = define(reduced)
        body = fbx.XNNFullyConnectedT()
        body.input1Id, body.filterId, body.biasId, body.outputId = inp, averaging, P.INVALID_ID, out
        body.flags = P.FLAG_TRANSPOSE_WEIGHTS
        b._node(fbx.NodeUnion.XNNFullyConnected, body)
        return out

    mean = fc(x)
    centered = define(dims)
    b._node(fbx.NodeUnion.XNNSubtract, _node2x1(x, mean, centered))
    squared = define(dims)
    b._node(fbx.NodeUnion.XNNSquare, _node1x1(centered, squared))
    var = fc(squared)
    shifted = define(reduced)
    b._node(fbx.NodeUnion.XNNAdd, _node2x1(var, b.scalar(eps), shifted))
    inv = define(reduced)
    b._node(fbx.NodeUnion.XNNReciprocalSquareRoot, _node1x1(shifted, inv))
    steps = [(fbx.NodeUnion.XNNMultiply, inv)]
    if weight is not None:
        steps.append((fbx.NodeUnion.XNNMultiply, b.get(weight, NCHW)))
    if bias is not None:
        steps.append((fbx.NodeUnion.XNNAdd, b.get(bias, NCHW)))
    value = centered
    for i, (kind, operand) in enumerate(steps):
        out = b._define(dims) if i < len(steps) - 1 else None
        if out is None:
            out = b._define(dims)
            b._set(node, out, NCHW)
        b._node(kind, _node2x1(value, operand, out))
        value = out


@_rule(aten.leaky_relu.default)
def _lower_leaky_relu(b: GraphBuilder, node: torch.fx.Node) -> None:
    source = node.args[0]
    layout = b.layout(source)
    x = b.get(source, layout)
    out = b.output(node, layout)
    body = fbx.XNNLeakyReLUT()
    body.negativeSlope = float(node.args[1] if len(node.args) > 1 else 0.01)
    body.inputId, body.outputId, body.flags = x, out, 0
    b._node(fbx.NodeUnion.XNNLeakyReLU, body)


def _clamp_bounds(node: torch.fx.Node) -> tuple[float, float]:
    if node.target is aten.relu.default:
        return 0.0, _INF
    if node.target is aten.hardtanh.default:
        args = list(node.args) + [None, None]
        return float(args[1] if args[1] is not None else -1.0), float(args[2] if args[2] is not None else 1.0)
    args = list(node.args) + [None, None]
    lo = node.kwargs.get("min", args[1])
    hi = node.kwargs.get("max", args[2])
    return (-_INF if lo is None else float(lo)), (_INF if hi is None else float(hi))


def _check_clamp(node, ctx):
    if node.target is aten.clamp.default:
        args = list(node.args[1:]) + list(node.kwargs.values())
        if any(isinstance(a, torch.fx.Node) for a in args):
            return "tensor bounds"
    return None


@_rule(aten.relu.default, aten.hardtanh.default, aten.clamp.default, check=_check_clamp)
def _lower_clamp(b: GraphBuilder, node: torch.fx.Node) -> None:
    source = node.args[0]
    lo, hi = _clamp_bounds(node)
    if b.fuse_clamp(node, source, lo, hi):
        return
    layout = b.layout(source)
    x = b.get(source, layout)
    out = b.output(node, layout)
    b._node(fbx.NodeUnion.XNNClamp, _node1x1(x, out)).outputMinMax = _min_max(lo, hi)


def _check_softmax(node, ctx):
    dim, rank = node.args[1], val(node.args[0]).dim()
    if dim not in (-1, rank - 1):
        return "softmax over a dim other than the last"
    if node.target is aten._softmax.default and node.args[2]:
        return "half_to_float"
    return None


@_rule(aten._softmax.default, check=_check_softmax)
def _lower_softmax(b: GraphBuilder, node: torch.fx.Node) -> None:
    x = b.get(node.args[0], NCHW)
    out = b.output(node)
    b._node(fbx.NodeUnion.XNNSoftmax, _node1x1(x, out))


def _check_copy(node, ctx):
    if node.target is aten._to_copy.default:
        allowed = {"dtype": torch.float32, "memory_format": torch.contiguous_format}
        for k, v in node.kwargs.items():
            if k in allowed and v not in (None, allowed[k], torch.preserve_format):
                return f"{k}={v}"
            if k not in allowed and k not in ("layout", "device", "pin_memory", "non_blocking") and v:
                return f"{k}={v}"
    if node.target is aten.clone.default and node.kwargs.get("memory_format") not in (
        None, torch.contiguous_format, torch.preserve_format
    ):
        return "memory format change"
    return None


@_rule(aten.clone.default, aten.alias_copy.default, aten._to_copy.default, check=_check_copy)
def _lower_copy(b: GraphBuilder, node: torch.fx.Node) -> None:
    b.alias(node, node.args[0])  # no data change; outputs that need a node get a Copy


# --------------------------------------------------------------------------- shapes


@_rule(aten.view_copy.default, aten._unsafe_view.default, aten.squeeze_copy.dims, aten.squeeze_copy.dim,
       aten.squeeze_copy.default, aten.unsqueeze_copy.default)
def _lower_reshape(b: GraphBuilder, node: torch.fx.Node) -> None:
    source = node.args[0]
    if shape(node) == shape(source):
        b.alias(node, source)
        return
    x = b.get(source, NCHW)
    out = b.output(node)
    b._node(fbx.NodeUnion.XNNStaticReshape, _reshape(shape(node) or [1], x, out))
    b._reshape_of[node] = source


def _check_expand(node, ctx):
    if shape(node) != shape(node.args[0]) and not ctx.is_static(node.args[0]):
        return "broadcast of a runtime value (XNNPACK has no broadcast node)"
    return None


@_rule(aten.expand_copy.default, check=_check_expand)
def _lower_expand(b: GraphBuilder, node: torch.fx.Node) -> None:
    """An expand to the same shape is its input (an expand of static data is folded, never lowered)."""
    b.alias(node, node.args[0])


@_rule(aten.permute_copy.default)
def _lower_permute(b: GraphBuilder, node: torch.fx.Node) -> None:
    if node in b.weight_views:
        return  # read untransposed by the FullyConnected nodes using it
    source = node.args[0]
    rank = len(shape(source))
    perm = [int(p) % rank for p in node.args[1]]
    if b.layout(source) == NHWC and rank == 4:
        # Read the NHWC value directly: NCHW perm p over NHWC dims is perm [to_nhwc.index(d) for d in p].
        x = b.get(source, NHWC)
        perm = [_TO_NHWC.index(d) for d in perm]
    else:
        x = b.get(source, NCHW)
    out = b.output(node)
    b._node(fbx.NodeUnion.XNNStaticTranspose, _transpose(perm, x, out))


def _slice_bounds(node: torch.fx.Node) -> tuple[int, int, int, int]:
    src = shape(node.args[0])
    args = list(node.args) + [None] * 5
    dim = int(args[1] if args[1] is not None else 0) % len(src)
    start, end, step = args[2], args[3], args[4] if args[4] is not None else 1
    start = 0 if start is None else int(start)
    end = src[dim] if end is None else int(end)
    start = max(0, min(src[dim], start + src[dim] if start < 0 else start))
    end = max(start, min(src[dim], end + src[dim] if end < 0 else end))
    return dim, start, end, int(step)


def _check_slice(node, ctx):
    if _slice_bounds(node)[3] != 1:
        return "step != 1"
    return None


@_rule(aten.slice_copy.Tensor, check=_check_slice)
def _lower_slice(b: GraphBuilder, node: torch.fx.Node) -> None:
    source = node.args[0]
    dim, start, end, _ = _slice_bounds(node)
    if start == 0 and end == shape(source)[dim]:
        b.alias(node, source)
        return
    x = b.get(source, NCHW)
    out = b.output(node)
    offsets = [0] * len(shape(source))
    offsets[dim] = start
    _slice_node(b, x, out, offsets, shape(node))


def _slice_node(b: GraphBuilder, x: int, out: int, offsets: list[int], sizes: list[int]) -> None:
    body = fbx.XNNStaticSliceT()
    body.numDims, body.offsets, body.sizes = len(sizes), list(offsets), list(sizes)
    body.inputId, body.outputId, body.flags = x, out, 0
    b._node(fbx.NodeUnion.XNNStaticSlice, body)


@_rule(aten.select_copy.int)
def _lower_select(b: GraphBuilder, node: torch.fx.Node) -> None:
    """select = slice of size 1 + reshape dropping the dim."""
    source = node.args[0]
    src = shape(source)
    dim = int(node.args[1]) % len(src)
    index = int(node.args[2]) % src[dim]
    x = b.get(source, NCHW)
    sizes = list(src)
    sizes[dim] = 1
    offsets = [0] * len(src)
    offsets[dim] = index
    sliced = b._define(sizes)
    _slice_node(b, x, sliced, offsets, sizes)
    out = b.output(node)
    b._node(fbx.NodeUnion.XNNStaticReshape, _reshape(shape(node) or [1], sliced, out))


@_rule(aten.split_with_sizes_copy.default, aten.split_copy.Tensor)
def _lower_split(b: GraphBuilder, node: torch.fx.Node) -> None:
    """Each result is a StaticSlice; getitems pick them."""
    source = node.args[0]
    src = shape(source)
    dim = int(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % len(src)
    x = b.get(source, NCHW)
    offset = 0
    results = []
    for piece in val(node):
        sizes = [int(s) for s in piece.shape]
        offsets = [0] * len(src)
        offsets[dim] = offset
        offset += sizes[dim]
        vid = b._define(sizes)
        _slice_node(b, x, vid, offsets, sizes)
        results.append(vid)
    b._multi[node] = results


def _check_cat(node, ctx):
    tensors = node.args[0]
    if len(tensors) < 1:
        return "no inputs"
    return None


_CATS = {2: fbx.NodeUnion.XNNConcatenate2, 3: fbx.NodeUnion.XNNConcatenate3,
         4: fbx.NodeUnion.XNNConcatenate4, 5: fbx.NodeUnion.XNNConcatenate5}


@_rule(aten.cat.default, check=_check_cat)
def _lower_cat(b: GraphBuilder, node: torch.fx.Node) -> None:
    """Concatenate2..5; more inputs are chained (5, then the partial result and up to 4 more)."""
    inputs = list(node.args[0])
    rank = len(shape(node))
    dim = int(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % rank
    if len(inputs) == 1:
        b.alias(node, inputs[0])
        return
    active = [a for a in inputs if not b.ctx.is_static(a)]
    layout = NHWC if rank == 4 and active and all(b.layout(a) == NHWC for a in active) else NCHW
    axis = _TO_NHWC.index(dim) if layout == NHWC else dim
    ids = [b.get(a, layout) for a in inputs]
    while ids:
        take, ids = ids[:5], ids[5:]
        if ids:  # partial result, then continue with it first
            partial = [b._dims[i] for i in take]
            dims = list(partial[0])
            dims[axis] = sum(d[axis] for d in partial)
            vid = b._define(dims)
        else:
            vid = b.output(node, layout)
        body = fbx._XNNCatT()
        body.axis, body.outputId, body.flags = axis, vid, 0
        slots = take + [P.INVALID_ID] * (5 - len(take))
        body.input1Id, body.input2Id, body.input3Id, body.input4Id, body.input5Id = slots
        b._node(_CATS[len(take)], body)
        if ids:
            ids = [vid] + ids


def _check_pad(node, ctx):
    pads = node.args[1]
    if any(int(p) < 0 for p in pads):
        return "negative padding"
    if len(pads) // 2 > len(shape(node.args[0])):
        return "more pads than dims"
    return None


def _pads(node: torch.fx.Node) -> tuple[list[int], list[int]]:
    """Per-dim (pre, post) padding of ``constant_pad_nd`` (its pad list runs from the last dim back)."""
    rank = len(shape(node.args[0]))
    pads = [int(p) for p in node.args[1]]
    pre, post = [0] * rank, [0] * rank
    for i in range(len(pads) // 2):
        pre[rank - 1 - i], post[rank - 1 - i] = pads[2 * i], pads[2 * i + 1]
    return pre, post


@_rule(aten.constant_pad_nd.default, check=_check_pad)
def _lower_pad(b: GraphBuilder, node: torch.fx.Node) -> None:
    """StaticConstantPad in its input's layout (a zero pad of H, W before a convolution is
    folded into the convolution's padding instead, see ``_plan_pad_folds``)."""
    if node in b.pad_folds:
        return
    source = node.args[0]
    pre, post = _pads(node)
    layout = b.layout(source)
    if layout == NHWC:
        pre, post = [pre[i] for i in _TO_NHWC], [post[i] for i in _TO_NHWC]
    x = b.get(source, layout)
    out = b.output(node, layout)
    body = fbx.XNNStaticConstantPadT()
    body.prePaddings, body.postPaddings = pre, post
    body.paddingValue = float(node.args[2] if len(node.args) > 2 else 0.0)
    body.inputId, body.outputId, body.flags = x, out, 0
    b._node(fbx.NodeUnion.XNNStaticConstantPad, body)


# --------------------------------------------------------------------------- matmul


#: Ops with ``addmm``'s arguments (bias, input, transposed weight): ``aten.addmm`` and
#: the fused ops of :mod:`.fused` that add an activation to it.
ADDMM_LIKE: set[Any] = {aten.addmm.default}


def _check_addmm(node, ctx):
    if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
        return "alpha/beta != 1"
    weight = node.args[2] if node.target in ADDMM_LIKE else node.args[1]
    if not ctx.is_static(weight) and val(weight).dim() != 2:
        return "weight is not 2-D"
    if node.target in ADDMM_LIKE:
        bias = node.args[0]
        if val(bias).numel() != val(node).shape[-1]:
            return "bias is not one value per output"
    return None


@_rule(aten.addmm.default, aten.mm.default, check=_check_addmm)
def _lower_fully_connected(b: GraphBuilder, node: torch.fx.Node) -> None:
    """``addmm(bias, x, W[in,out])`` -> FullyConnected(x, W, bias, TRANSPOSE_WEIGHTS)."""
    is_addmm = node.target in ADDMM_LIKE
    x_node, w_node = (node.args[1], node.args[2]) if is_addmm else (node.args[0], node.args[1])
    x = b.get(x_node, NCHW)
    flags = P.FLAG_TRANSPOSE_WEIGHTS
    if b.ctx.is_static(w_node):
        filter_id = b.constant(b.static_tensor(w_node))
    elif w_node in b.weight_views:
        # A runtime weight (e.g. tied to an embedding the top level keeps): its [N, K] source as the filter.
        filter_id, flags = b.get(w_node.args[0], NCHW), 0
    else:
        filter_id = b.get(w_node, NCHW)
    bias_id, add_bias = P.INVALID_ID, None
    if is_addmm:
        bias_node = node.args[0]
        if b.ctx.is_static(bias_node):
            bias_id = b.constant(b.static_tensor(bias_node).reshape(-1))
        else:
            add_bias = bias_node
    out = b.output(node) if add_bias is None else b._define(shape(node))
    body = fbx.XNNFullyConnectedT()
    body.input1Id, body.filterId, body.biasId, body.outputId = x, filter_id, bias_id, out
    body.flags = flags
    b._node(fbx.NodeUnion.XNNFullyConnected, body, fusable_output=out if add_bias is None else None)
    if add_bias is not None:
        result = b.output(node)
        b._node(fbx.NodeUnion.XNNAdd, _node2x1(out, b.get(add_bias, NCHW), result), fusable_output=result)


def _batch_broadcast_weight(b: "GraphBuilder", arg: Any) -> torch.Tensor | None:
    """The [K, N] matrix a static [B, K, N] operand repeats over its batch, if it does."""
    if not b.ctx.is_static(arg):
        return None
    t = b.static_tensor(arg)
    first = t[0]
    return first if bool((t == first.unsqueeze(0)).all()) else None


@_rule(aten.bmm.default)
def _lower_bmm(b: GraphBuilder, node: torch.fx.Node) -> None:
    """BatchMatrixMultiply; with a static right operand repeated over the batch (an
    expanded weight), a FullyConnected over the flattened batch instead::

        bmm(%x [B,M,K], expand_copy(%w [K,N], [B,K,N]))  ->  FullyConnected(x, w, TRANSPOSE_WEIGHTS)
    """
    weight = _batch_broadcast_weight(b, node.args[1])
    if weight is not None:
        x = b.get(node.args[0], NCHW)
        out = b.output(node)
        body = fbx.XNNFullyConnectedT()
        body.input1Id, body.filterId, body.biasId, body.outputId = x, b.constant(weight), P.INVALID_ID, out
        body.flags = P.FLAG_TRANSPOSE_WEIGHTS
        b._node(fbx.NodeUnion.XNNFullyConnected, body, fusable_output=out)
        return
    x, y = b.get(node.args[0], NCHW), b.get(node.args[1], NCHW)
    out = b.output(node)
    b._node(fbx.NodeUnion.XNNBatchMatrixMultiply, _node2x1(x, y, out))


# --------------------------------------------------------------------------- convolution


def _pair(v: Any) -> list[int]:
    v = [int(x) for x in (v if isinstance(v, (list, tuple)) else [v])]
    return v * 2 if len(v) == 1 else v


def _check_conv(node, ctx):
    rank = len(shape(node.args[1]))
    if rank == 3 and node.args[6]:
        return "1-D transposed convolution"
    if rank not in (3, 4):
        return "only 1-D and 2-D convolution"
    if not ctx.is_static(node.args[1]):
        return "weight is not a static parameter"
    if node.args[2] is not None and not ctx.is_static(node.args[2]):
        return "bias is not a static parameter"
    if node.args[6]:
        if any(_pair(node.args[5])[i] != 1 for i in range(2)):
            return "dilated transposed convolution"
        return None
    return None


def _conv1d_input(b: "GraphBuilder", x_node: torch.fx.Node) -> int:
    """[N, C, L] -> NHWC [N, 1, L, C]: a transpose and a reshape."""
    n, c, length = shape(x_node)
    x = b.get(x_node, NCHW)
    nlc = b._define([n, length, c])
    b._node(fbx.NodeUnion.XNNStaticTranspose, _transpose([0, 2, 1], x, nlc))
    nhwc = b._define([n, 1, length, c])
    b._node(fbx.NodeUnion.XNNStaticReshape, _reshape([n, 1, length, c], nlc, nhwc))
    return nhwc


def _conv1d_output(b: "GraphBuilder", node: torch.fx.Node, nhwc: int) -> None:
    """NHWC [N, 1, L, O] -> [N, O, L]: a reshape and a transpose."""
    n, o, length = shape(node)
    nlo = b._define([n, length, o])
    b._node(fbx.NodeUnion.XNNStaticReshape, _reshape([n, length, o], nhwc, nlo))
    b._node(fbx.NodeUnion.XNNStaticTranspose, _transpose([0, 2, 1], nlo, b.output(node)))


@_rule(aten.convolution.default, check=_check_conv)
def _lower_conv(b: GraphBuilder, node: torch.fx.Node) -> None:
    """Conv2d / DepthwiseConv2d / ConvTranspose2d in NHWC, filter OHWI ([1,H,W,O] depthwise).
    A 1-D convolution is a 2-D one over [N, 1, L, C] (H = 1), reshaped in and out."""
    x_node, w_node, bias_node = node.args[0], node.args[1], node.args[2]
    one_d = len(shape(w_node)) == 3
    if one_d:
        stride, dilation = [1, int(node.args[3][0])], [1, int(node.args[5][0])]
        padding = [0, int(node.args[4][0])]
    else:
        stride, padding, dilation = _pair(node.args[3]), _pair(node.args[4]), _pair(node.args[5])
    top, right, bottom, left = padding[0], padding[1], padding[0], padding[1]
    if x_node in b.pad_folds:  # a zero pad folded into this convolution
        pre, post = _pads(x_node)
        top, bottom, left, right = top + pre[2], bottom + post[2], left + pre[3], right + post[3]
        x_node = x_node.args[0]
    transposed, output_padding, groups = bool(node.args[6]), _pair(node.args[7]), int(node.args[8])
    weight = b.static_tensor(w_node).double()
    if one_d:
        weight = weight.unsqueeze(2)  # [O, I, K] -> [O, I, 1, K]
    bias = b.static_tensor(bias_node).double() if bias_node is not None else None
    bn = b.bn_folds.get(node)
    if bn is not None:
        scale, shift = b.batch_norm_scale_shift(bn)
        weight = weight * scale.reshape(-1, 1, 1, 1)
        bias = shift if bias is None else bias * scale + shift
    kernel = weight.shape
    if transposed:
        group_in, group_out = kernel[0] // groups, kernel[1]
    else:
        group_in, group_out = kernel[1], kernel[0] // groups
    depthwise = group_in == 1 and group_out % group_in == 0 and not transposed
    filt = weight.permute(_TO_NHWC)  # OIHW -> OHWI
    if depthwise:
        filt = filt.permute(3, 1, 2, 0)  # -> [1, H, W, O]
    elif transposed:
        # [groups*in, out, H, W] -> [groups*out, H, W, in]: per group, swap in and out.
        w = weight.reshape(groups, group_in, group_out, kernel[2], kernel[3])
        filt = w.permute(0, 2, 3, 4, 1).reshape(groups * group_out, kernel[2], kernel[3], group_in)
    x = _conv1d_input(b, x_node) if one_d else b.get(x_node, NHWC)
    filter_id = b.constant(filt.float())
    bias_id = b.constant(bias.float()) if bias is not None else P.INVALID_ID
    out = b._define([shape(node)[0], 1, shape(node)[2], shape(node)[1]]) if one_d else b.output(node, NHWC)
    body = fbx._XNNNodeConvT()
    body.paddingTop, body.paddingRight, body.paddingBottom, body.paddingLeft = top, right, bottom, left
    body.kernelHeight, body.kernelWidth = kernel[2], kernel[3]
    body.subsamplingHeight, body.subsamplingWidth = stride
    body.dilationHeight, body.dilationWidth = dilation
    body.groupInputChannels, body.groupOutputChannels, body.groups = group_in, group_out, groups
    body.adjustmentHeight, body.adjustmentWidth = (output_padding if transposed else [0, 0])
    body.input1Id, body.filterId, body.biasId, body.outputId, body.flags = x, filter_id, bias_id, out, 0
    kind = (fbx.NodeUnion.XNNDepthwiseConv2d if depthwise else
            fbx.NodeUnion.XNNConvTranspose2d if transposed else fbx.NodeUnion.XNNConv2d)
    b._node(kind, body, fusable_output=None if one_d else out)
    if one_d:
        _conv1d_output(b, node, out)
    if bn is not None:
        b.alias(bn, node)


def _check_batch_norm(node, ctx):
    if not all(a is None or ctx.is_static(a) for a in node.args[1:5]):
        return "statistics or affine parameters are not static"
    if val(node.args[0]).dim() < 2:
        return "input has no channel dim"
    return _only_getitem0(node)


@_rule(aten._native_batch_norm_legit_no_training.default, check=_check_batch_norm)
def _lower_batch_norm(b: GraphBuilder, node: torch.fx.Node) -> None:
    """Folded into the convolution before it (see ``_plan_batch_norm_folds``), else ``x*scale + shift``."""
    if node.args[0] in b.bn_folds and b.bn_folds[node.args[0]] is node:
        return  # aliased by the convolution's lowering
    source = node.args[0]
    scale, shift = b.batch_norm_scale_shift(node)
    rank = val(source).dim()
    layout = b.layout(source) if rank == 4 else NCHW
    per_channel = [-1] if layout == NHWC else [-1] + [1] * (rank - 2)
    x = b.get(source, layout)
    scaled = b._define(b._dims[x])
    b._node(fbx.NodeUnion.XNNMultiply, _node2x1(x, b.constant(scale.float().reshape(per_channel)), scaled))
    dims = shape(node.args[0])
    out = b._define([dims[i] for i in _TO_NHWC] if layout == NHWC else dims)
    b._set(node, out, layout)
    b._node(fbx.NodeUnion.XNNAdd, _node2x1(scaled, b.constant(shift.float().reshape(per_channel)), out),
            fusable_output=out)


_MULTI_OUTPUT_EXTRA_OK.update({aten._native_batch_norm_legit_no_training.default,
                               aten.max_pool2d_with_indices.default, aten.native_layer_norm.default})


# --------------------------------------------------------------------------- pooling


def _pool_args(node: torch.fx.Node) -> tuple[list[int], list[int], list[int], list[int], bool]:
    args = list(node.args) + [None] * 6
    kernel = _pair(args[1])
    stride = _pair(args[2]) if args[2] else kernel
    padding = _pair(args[3] if args[3] is not None else 0)
    dilation = _pair(args[4] if args[4] is not None else 1) if node.target is aten.max_pool2d_with_indices.default else [1, 1]
    ceil_mode = bool(args[5] if node.target is aten.max_pool2d_with_indices.default else args[4])
    return kernel, stride, padding, dilation, ceil_mode


def _floor_shape(node, kernel, stride, padding, dilation) -> list[int]:
    n, c, h, w = shape(node.args[0])
    hw = [(s + 2 * p - d * (k - 1) - 1) // st + 1 for s, k, st, p, d in zip((h, w), kernel, stride, padding, dilation)]
    return [n, c, *hw]


def _check_pool(node, ctx):
    if len(shape(node.args[0])) != 4:
        return "input is not 4-D"
    kernel, stride, padding, dilation, ceil_mode = _pool_args(node)
    if ceil_mode and _floor_shape(node, kernel, stride, padding, dilation) != shape(_first(node)):
        return "ceil_mode changes the output size"
    if node.target is aten.max_pool2d_with_indices.default:
        if any(s > k for s, k in zip(stride, kernel)):
            return "stride > kernel"
        return _only_getitem0(node)
    args = list(node.args) + [None] * 7
    count_include_pad = True if args[5] is None else bool(args[5])
    if any(padding) and count_include_pad:
        return "padding counted in the average"
    if args[6] is not None:
        return "divisor_override"
    return None


def _first(node: torch.fx.Node) -> torch.fx.Node:
    """A node-like carrying the first result's shape (for multi-result pooling)."""
    class _Shape:
        meta = {"val": val(node)[0] if isinstance(val(node), (tuple, list)) else val(node)}
    return _Shape()


@_rule(aten.max_pool2d_with_indices.default, aten.avg_pool2d.default, check=_check_pool)
def _lower_pool(b: GraphBuilder, node: torch.fx.Node) -> None:
    kernel, stride, padding, dilation, _ = _pool_args(node)
    x = b.get(node.args[0], NHWC)
    result = _first(node)
    dims = shape(result)
    out = b._define([dims[i] for i in _TO_NHWC])
    body = fbx._XNNPooling2DT()
    body.paddingTop, body.paddingRight, body.paddingBottom, body.paddingLeft = (
        padding[0], padding[1], padding[0], padding[1])
    body.poolingHeight, body.poolingWidth = kernel
    body.strideHeight, body.strideWidth = stride
    body.dilationHeight, body.dilationWidth = dilation
    body.inputId, body.outputId, body.flags = x, out, P.FLAG_KEEP_DIMS
    is_max = node.target is aten.max_pool2d_with_indices.default
    b._node(fbx.NodeUnion.XNNMaxPooling2d if is_max else fbx.NodeUnion.XNNAvgPooling2d, body)
    if is_max:
        b._multi[node] = [(out, NHWC)]
    else:
        b._set(node, out, NHWC)


def _mean_dims(node: torch.fx.Node) -> list[int]:
    rank = len(shape(node.args[0]))
    return sorted(int(d) % rank for d in node.args[1])


def _check_mean(node, ctx):
    rank = len(shape(node.args[0]))
    if node.kwargs.get("dtype") is not None:
        return "dtype"
    if _mean_dims(node) == [rank - 1]:
        return None  # a FullyConnected by 1/K
    if rank != 4:
        return "input is not 4-D"
    if _mean_dims(node) != [2, 3]:
        return "mean over dims other than H and W, or the last"
    return None


def _keepdim(node: torch.fx.Node) -> bool:
    return bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))


def _mean_last(b: "GraphBuilder", node: torch.fx.Node) -> None:
    """Mean over the last dim: FullyConnected(x, 1/K) -> [..., 1] (then reshaped if not keepdim)."""
    x = b.get(node.args[0], NCHW)
    dims = b._dims[x]
    mean = b._define(dims[:-1] + [1]) if not _keepdim(node) else b.output(node)
    body = fbx.XNNFullyConnectedT()
    body.input1Id, body.filterId, body.biasId, body.outputId = (
        x, b.constant(torch.full((dims[-1], 1), 1.0 / dims[-1])), P.INVALID_ID, mean)
    body.flags = P.FLAG_TRANSPOSE_WEIGHTS
    b._node(fbx.NodeUnion.XNNFullyConnected, body)
    if not _keepdim(node):
        b._node(fbx.NodeUnion.XNNStaticReshape, _reshape(shape(node) or [1], mean, b.output(node)))


@_rule(aten.mean.dim, check=_check_mean)
def _lower_mean(b: GraphBuilder, node: torch.fx.Node) -> None:
    """GlobalAvgPooling2d in NHWC ([N,1,1,C]); keepdim=False is a reshape of it to [N,C].
    A mean over the last dim is a FullyConnected by 1/K instead."""
    if _mean_dims(node) == [len(shape(node.args[0])) - 1]:
        _mean_last(b, node)
        return
    x = b.get(node.args[0], NHWC)
    n, c = shape(node.args[0])[:2]
    keepdim = bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
    pooled = b.output(node, NHWC) if keepdim else b._define([n, 1, 1, c])
    b._node(fbx.NodeUnion.XNNGlobalAvgPooling2d, _node1x1(x, pooled, P.FLAG_KEEP_DIMS))
    if not keepdim:  # [N,1,1,C] NHWC has the bytes of [N,C]
        out = b.output(node)
        b._node(fbx.NodeUnion.XNNStaticReshape, _reshape([n, c], pooled, out))


def prelu_parts(node: torch.fx.Node, ctx: Context):
    """``(x, slope node, gt, mul)`` if ``node`` is a decomposed PReLU, else None::

        %gt = gt.Scalar(%x, 0)   %mul = mul.Tensor(%w, %x)   %where = where.self(%gt, %x, %mul)

    with ``w`` static, one slope per channel (dim 1) or one for all, ``x`` fp32 2-D or 4-D,
    and ``gt`` and ``mul`` read only by the ``where``.
    """
    if node.target is not aten.where.self or len(node.args) != 3:
        return None
    cond, x, mul = node.args
    if not all(isinstance(a, torch.fx.Node) for a in (cond, x, mul)):
        return None
    if cond.target is not aten.gt.Scalar or cond.args[0] is not x or cond.args[1] != 0:
        return None
    if mul.target is not aten.mul.Tensor or x not in mul.args or len(cond.users) != 1 or len(mul.users) != 1:
        return None
    slope = mul.args[0] if mul.args[1] is x else mul.args[1]
    t = val(x)
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() not in (2, 4):
        return None
    if not ctx.is_static(slope) or val(slope).numel() not in (1, t.shape[1]) or val(slope).dtype != torch.float32:
        return None
    dims = [1] * (t.dim() - val(slope).dim()) + list(val(slope).shape)  # as broadcast against x
    if len(dims) != t.dim() or any(d != 1 for i, d in enumerate(dims) if i != 1):
        return None  # the slopes must run along the channel dim
    return x, slope, cond, mul


def _check_where(node, ctx):
    return None if prelu_parts(node, ctx) is not None else "where other than a decomposed PReLU"


def _check_gt(node, ctx):
    users = list(node.users)
    if len(users) == 1 and prelu_parts(users[0], ctx) is not None:
        return None
    return "comparison other than a decomposed PReLU's"


@_rule(aten.where.self, check=_check_where)
def _lower_prelu(b: GraphBuilder, node: torch.fx.Node) -> None:
    """PReLU: channels last (NHWC for 4-D), one slope per channel."""
    x_node, slope_node, _, _ = prelu_parts(node, b.ctx)
    channels = shape(x_node)[1]
    slope = b.static_tensor(slope_node).reshape(-1).expand(channels)
    layout = NHWC if len(shape(x_node)) == 4 else NCHW
    x = b.get(x_node, layout)
    out = b.output(node, layout)
    b._node(fbx.NodeUnion.XNNPReLU, _node2x1(x, b.constant(slope), out))


@_rule(aten.gt.Scalar, check=_check_gt)
def _lower_gt(b: GraphBuilder, node: torch.fx.Node) -> None:
    raise XnnpackPreprocessError(f"node {node.name!r}: a comparison is only lowered inside a PReLU")


_OWN_DTYPE_CHECK.update({aten.where.self, aten.gt.Scalar})


def _check_amax(node, ctx):
    if len(shape(node.args[0])) != 4 or sorted(int(d) % 4 for d in node.args[1]) != [2, 3]:
        return "max over dims other than H and W of a 4-D tensor"
    return None


@_rule(aten.amax.default, check=_check_amax)
def _lower_amax(b: GraphBuilder, node: torch.fx.Node) -> None:
    """amax over H, W: a MaxPooling2d whose window is the whole image (NHWC [N,1,1,C])."""
    x = b.get(node.args[0], NHWC)
    n, c, h, w = shape(node.args[0])
    keepdim = bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
    pooled = b.output(node, NHWC) if keepdim else b._define([n, 1, 1, c])
    body = fbx._XNNPooling2DT()
    body.paddingTop = body.paddingRight = body.paddingBottom = body.paddingLeft = 0
    body.poolingHeight, body.poolingWidth, body.strideHeight, body.strideWidth = h, w, h, w
    body.dilationHeight = body.dilationWidth = 1
    body.inputId, body.outputId, body.flags = x, pooled, P.FLAG_KEEP_DIMS
    b._node(fbx.NodeUnion.XNNMaxPooling2d, body)
    if not keepdim:
        b._node(fbx.NodeUnion.XNNStaticReshape, _reshape([n, c], pooled, b.output(node)))


def _check_upsample(node, ctx):
    if len(shape(node.args[0])) != 4:
        return "input is not 4-D"
    scales = node.args[3] if len(node.args) > 3 else None
    if scales is not None:  # torch maps coordinates with the given scale, XNNPACK with the size ratio
        src, dst = shape(node.args[0])[2:], shape(node)[2:]
        if any(float(d) != float(s) * float(f) for s, d, f in zip(src, dst, scales)):
            return "scale factor other than output size / input size"
    return None


@_rule(aten.upsample_bilinear2d.vec, check=_check_upsample)
def _lower_upsample(b: GraphBuilder, node: torch.fx.Node) -> None:
    """StaticResizeBilinear2D in NHWC (align_corners as XNNPACK's flag)."""
    x = b.get(node.args[0], NHWC)
    out = b.output(node, NHWC)
    body = fbx.XNNStaticResizeBilinear2DT()
    body.newHeight, body.newWidth = shape(node)[2:]
    body.inputId, body.outputId = x, out
    body.flags = P.FLAG_ALIGN_CORNERS if node.args[2] else 0
    b._node(fbx.NodeUnion.XNNStaticResizeBilinear2D, body)


# --------------------------------------------------------------------------- getitem


def _lower_getitem_impl(b: GraphBuilder, node: torch.fx.Node) -> None:
    source, index = node.args
    if source in b._multi:
        item = b._multi[source][index]
        vid, layout = item if isinstance(item, tuple) else (item, NCHW)
        b._set(node, vid, layout)
    elif index == 0 and source.target in (aten._native_batch_norm_legit_no_training.default,
                                          aten.native_layer_norm.default):
        b.alias(node, source)
    else:
        raise XnnpackPreprocessError(f"node {node.name!r}: result {index} of {source.name!r} has no XNNPACK value")


GraphBuilder._lower_getitem = _lower_getitem_impl


# --------------------------------------------------------------------------- entry


def preprocess_program(ep: ExportedProgram) -> tuple[bytes, dict[str, bytes]]:
    """The payload bytes and named data (sha256 key -> fp32 bytes) of one partition."""
    builder = GraphBuilder(ep)
    graph = builder.build()
    return P.serialize_payload(graph), dict(builder.named_data)


#: Ops :func:`_dynamic_reason` lets XNNPACK take with symbolic sizes.
_DYNAMIC_OPS = frozenset({
    *_BINARY, *_UNARY,
    aten.relu.default, aten.hardtanh.default, aten.clamp.default, aten.leaky_relu.default,
    aten.addmm.default, aten.mm.default, aten._softmax.default,
})
