"""The :class:`GraphBuilder` every lowering room appends to: XNN values and nodes,
constants (bytes in named data, keyed by sha256 or, for external weights, by weight name
and role), layouts and clamp fusion.

Its own room, below the op table: the rooms under :mod:`.ops` type their lowerings with
it, and the walk that dispatches nodes to them (:func:`.preprocess.lower_nodes`) is
handed to :meth:`GraphBuilder.build`, so the builder never imports the table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind

from ... import ptd_recipes
from ...delegation import named_data_key, same_blob
from ...serialize import tensor_memory
from . import payload as P
from .generated import xnngraph_generated as fbx
from .payload import QUANT_TYPES, per_tensor_quant
from .qparams import WEIGHT_DQ, QuantWeightError, dequantized_constant, is_op, weight_of
from .qplan import plan_quantization
from .values import NCHW, NHWC, TO_NCHW, TO_NHWC, Context, Value, XnnpackPreprocessError, shape, val
from .xnodes import min_max, node1x1, transpose

aten = torch.ops.aten


@dataclass
class GraphBuilder:
    """Builds the XNNGraph of one partition program.

    Lowerings (:mod:`.ops`) read values with :meth:`get` (in a layout, transposed
    once if needed) or :meth:`constant`, define results with :meth:`output` /
    :meth:`define` and append nodes with :meth:`add_node`.  The plans
    (:data:`.ops.PLANS`) fill ``bn_folds``, ``pad_folds``, ``weight_views``,
    ``batched_inputs``, ``alias_views``, ``batched_dims`` and ``skip`` before the walk.
    """

    ep: ExportedProgram
    ctx: Context = None
    values: list[fbx.XValueT] = field(default_factory=list)
    nodes: list[fbx.XNodeT] = field(default_factory=list)
    constant_data: list[fbx.ConstantDataOffsetT] = field(default_factory=list)
    named_data: dict[str, bytes] = field(default_factory=dict)
    #: Name constants from their weight and role (external weights), not by sha256.
    stable_keys: bool = False

    def __post_init__(self) -> None:
        self.ctx = Context(self.ep)
        self._storages: dict | None = None  # storage -> (weight name, its tensor), for stable keys
        self._node_keys: dict[tuple[str, str], int] = {}
        self._constant_of_key: dict[str, int] = {}
        self._by_layout: dict[tuple[torch.fx.Node, str], int] = {}
        self._primary: dict[torch.fx.Node, Value] = {}
        self.dims: dict[int, list[int]] = {}
        self._producer: dict[int, int] = {}  # value id -> index of the fusable XNode producing it
        self.results: dict[torch.fx.Node, list[Any]] = {}  # multi-output node -> per-index (node-like) values
        self._external_inputs: set[int] = set()
        self._alias_of: dict[torch.fx.Node, torch.fx.Node] = {}
        self.reshape_of: dict[torch.fx.Node, torch.fx.Node] = {}  # reshape node -> its input
        self._static_cache: dict[torch.fx.Node, torch.Tensor] = {}
        self._derived: dict[int, tuple[torch.Tensor, dict]] = {}  # id -> (tensor, recipe): :meth:`derived`
        self.bn_folds: dict[torch.fx.Node, torch.fx.Node] = {}  # convolution -> its BatchNorm
        self.pad_folds: set[torch.fx.Node] = set()  # zero pads folded into the convolution after them
        self.weight_views: set[torch.fx.Node] = set()  # transposed runtime weights FC reads untransposed
        self.batched_inputs: dict[torch.fx.Node, tuple[torch.fx.Node, torch.fx.Node]] = {}  # mm -> (N-D x, y)
        self.alias_views: set[torch.fx.Node] = set()  # reshapes whose value is their input's (N-D quantized FC)
        self.batched_dims: dict[torch.fx.Node, list[int]] = {}  # quantized product -> its N-D result dims
        self.converts: dict[tuple[int, float, int], int] = {}  # (fp32 value, scale, zero point) -> its qint8
        self.skip: set[torch.fx.Node] = set()  # nodes a pattern lowers with another node (PReLU's gt, mul)
        self.node: torch.fx.Node | None = None
        self.qplan = plan_quantization(self.ep.graph, self.ctx)
        self.ctx.qplan = self.qplan
        self.dq_source: dict[torch.fx.Node, torch.fx.Node] = {}  # dq converted to fp32 -> its qint8 q
        self.dynamic_inputs: dict[tuple[torch.fx.Node, tuple[int, ...]], int] = {}  # (x, dims) -> qdint8
        empty = fbx.ConstantDataOffsetT()
        empty.offset, empty.size, empty.namedKey = 0, 0, ""
        self.constant_data.append(empty)

    # ------------------------------------------------------------- driver

    def build(self, lower_nodes: Callable[["GraphBuilder"], None]) -> fbx.XNNGraphT:
        """The XNNGraph: the user inputs defined, ``lower_nodes(self)`` (the walk over the op
        table, :func:`.preprocess.lower_nodes`), the outputs marked."""
        graph = self.ep.graph
        user_inputs = [n for n in graph.nodes if n.op == "placeholder" and n not in self.ctx.static_targets]
        for external_id, node in enumerate(user_inputs):
            t = val(node)
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
                raise XnnpackPreprocessError(f"input {node.name!r}: only float32 tensor inputs are supported")
            vid = self.define(shape(node) or [1], external_id=external_id, flags=P.EXTERNAL_INPUT)
            self._external_inputs.add(vid)
            self.set_value(node, vid, NCHW)
        lower_nodes(self)
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
            table = self.tensor_value(vid)
            if vid in self._external_inputs or table.flags & P.EXTERNAL_OUTPUT or table.constantBufferIdx:
                copy = self.define(self.dims[vid])
                self.add_node(fbx.NodeUnion.XNNCopy, node1x1(vid, copy))
                vid, table = copy, self.tensor_value(copy)
            table.flags |= P.EXTERNAL_OUTPUT
            table.externalId = n_inputs + i
            ids.append(vid)
        return ids

    # ------------------------------------------------------------- values

    def define(self, dims: list[int], *, datatype: int | None = None, quant: Any = None, constant: int = 0,
               external_id: int = P.INVALID_ID, flags: int = 0) -> int:
        """A new value; ``datatype`` None: fp32, or qint8 with the planned parameters of a node
        computing quantized (:attr:`qplan`); ``quant`` a PerTensorQuantT/PerChannelQuantT/... ."""
        if datatype is None:
            datatype = P.DATATYPE_FP32
            if constant == 0 and self.node in self.qplan.qout:
                datatype, quant = P.DATATYPE_QINT8, per_tensor_quant(self.qplan.qout[self.node])
        tensor = fbx.XNNTensorValueT()
        tensor.datatype = datatype
        tensor.numDims = len(dims)
        tensor.dims = [int(d) for d in dims]
        tensor.constantBufferIdx = constant
        tensor.externalId = external_id
        tensor.flags = flags
        tensor.idOut = len(self.values)
        value = fbx.XValueT()
        if quant is None:
            value.xvalueUnionType, value.xvalueUnion = fbx.ValueUnion.XNNTensorValue, tensor
        else:
            qvalue = fbx.XNNQuantizedTensorValueT()
            qvalue.tensorValue = tensor
            qvalue.quantParamsType, qvalue.quantParams = QUANT_TYPES[type(quant)], quant
            value.xvalueUnionType, value.xvalueUnion = fbx.ValueUnion.XNNQuantizedTensorValue, qvalue
        self.values.append(value)
        self.dims[tensor.idOut] = list(tensor.dims)
        return tensor.idOut

    def tensor_value(self, vid: int) -> fbx.XNNTensorValueT:
        value = self.values[vid].xvalueUnion
        return value.tensorValue if isinstance(value, fbx.XNNQuantizedTensorValueT) else value

    def value_type(self, vid: int) -> tuple[int, Any]:
        """``(datatype, quant params)`` of a value, to define another one like it."""
        value = self.values[vid].xvalueUnion
        if isinstance(value, fbx.XNNQuantizedTensorValueT):
            return value.tensorValue.datatype, value.quantParams
        return value.datatype, None

    def blob(self, data: bytes, prefix: str = "", key: str | None = None, recipe: dict | None = None) -> int:
        """The ``constant_data`` index of named data ``data``, stored once per key.

        The key is ``prefix`` + sha256 of the bytes (ExecuTorch's keying), or with
        :attr:`stable_keys` ``key`` (a name from the weight and its role, see
        :meth:`constant_key`; None: the node being lowered and a count).  ``recipe``: how
        ``data`` derives from the weights (:mod:`lowering.ptd_recipes`; noted only while a
        program's recipes are recorded).
        """
        if self.stable_keys:
            key = key or self._node_key("scales" if prefix else "const")
            if key in self._constant_of_key and not same_blob(self.named_data[key], data):
                raise XnnpackPreprocessError(
                    f"node {self._name()}: two different constants are both named {key!r} (external weights)")
            ptd_recipes.note(key, recipe)
        else:
            key = prefix + named_data_key(data)
        if key not in self._constant_of_key:
            entry = fbx.ConstantDataOffsetT()
            entry.offset, entry.size, entry.namedKey = P.NAMED_OFFSET, len(data), key
            self._constant_of_key[key] = len(self.constant_data)
            self.constant_data.append(entry)
            self.named_data[key] = data
        return self._constant_of_key[key]

    def constant(self, tensor: torch.Tensor, *, datatype: int = P.DATATYPE_FP32, quant: Any = None,
                 data: bytes | None = None, key: str | None = None) -> int:
        """A new value holding ``tensor`` (fp32 unless ``datatype`` says otherwise: its dtype's bytes
        as they are, or ``data`` if given, e.g. packed 4-bit), as named data (see :meth:`blob`;
        ``key``: its stable name, else :meth:`constant_key`)."""
        t = tensor.detach()
        t = (t.to(torch.float32) if datatype == P.DATATYPE_FP32 else t).contiguous()
        if self.stable_keys and key is None:
            key = self.constant_key(tensor, t.dtype, datatype, packed=data is not None)
        recipe = None
        if self.stable_keys and ptd_recipes.recording():
            packed = "int4" if data is not None and datatype in (P.DATATYPE_QCINT4, P.DATATYPE_QBINT4) else None
            recipe = self.recipe(tensor, t.dtype, packed) if data is None or packed else None
        if data is None:
            data = tensor_memory(t)  # a view of the weight: the named data holds no second copy
        return self.define(list(t.shape) or [1], datatype=datatype, quant=quant,
                           constant=self.blob(data, key=key, recipe=recipe))

    def recipe(self, tensor: torch.Tensor, dtype: torch.dtype, pack: str | None = None) -> dict | None:
        """How a constant's bytes derive from the weights (:mod:`lowering.ptd_recipes`): ``tensor``
        (a view of a weight, or a tensor :meth:`derived` tagged) cast to ``dtype``, packed by
        ``pack``; None when it is neither."""
        found = self._weight_of_storage(tensor)
        if found is not None:
            return {"fn": "view", **ptd_recipes.view_spec(found[0], found[1], tensor), "dtype": str(dtype).replace(
                "torch.", ""), "pack": pack}
        tagged = self._derived.get(id(tensor))
        if tagged is not None and tagged[0] is tensor and pack is None:
            return {**tagged[1], "dtype": str(dtype).replace("torch.", "")}
        return None

    def derived(self, tensor: torch.Tensor, recipe: dict) -> torch.Tensor:
        """``tensor``, noted as computed by ``recipe`` (``{"fn", "args": {role: view of a weight (the
        tensor :meth:`recipe` reads it as) or None}, ...}``) while a program's recipes are recorded."""
        if ptd_recipes.recording():
            args = {}
            for role, arg in recipe["args"].items():
                found = self._weight_of_storage(arg) if arg is not None else None
                if arg is not None and found is None:
                    return tensor  # an argument that is no weight's view: no recipe
                args[role] = ptd_recipes.view_spec(found[0], found[1], arg) if arg is not None else None
            self._derived[id(tensor)] = (tensor, {**recipe, "args": args})
        return tensor

    # ------------------------------------------------- stable keys (external weights)

    def weight_name(self, tensor: torch.Tensor) -> str | None:
        """The fully qualified name of the weight whose memory ``tensor`` is (or views), else None."""
        found = self._weight_of_storage(tensor)
        return found[0] if found is not None else None

    def node_weight_name(self, node: Any) -> str | None:
        """The fully qualified name of the weight a static node reads (through permute / view /
        clone / dequantize: their first input), else None."""
        while isinstance(node, torch.fx.Node) and node not in self.ctx.static_targets:
            if node.op != "call_function" or not node.args or not self.ctx.is_static(node):
                return None
            node = node.args[0]
        return self.ctx.static_targets.get(node) if isinstance(node, torch.fx.Node) else None

    def _weight_of_storage(self, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        if self._storages is None:
            self._storages = {}
            for node, target in sorted(self.ctx.static_targets.items(), key=lambda item: item[1]):
                source = self.ctx.tensor(node)
                self._storages.setdefault(_storage_of(source), (target, source))
        return self._storages.get(_storage_of(tensor))

    def constant_key(self, tensor: torch.Tensor, stored_dtype: torch.dtype, datatype: int,
                     packed: bool = False) -> str:
        """A constant's name from the weight it is and its role, never from its bytes::

            fc1.weight                 the weight as the program holds it
            fc1.weight#t               transposed ([in, out])
            conv.weight#p0231          permuted (OIHW -> OHWI)
            layers.0.w#qc8 / #qb4      in XNNPACK's quantized types (4-bit packed)
            <node>#c0, <node>#c1       computed (folded BatchNorm, a constant fill): the
                                       node being lowered and the order it asked them in

        The same name always means the same bytes in one program; a retrain (same
        program, new weights) gives every constant its old name.
        """
        found = self._weight_of_storage(tensor)
        if found is None:
            return self._node_key("c")
        name, source = found
        roles = [_view_role(tensor, source)]
        if stored_dtype != source.dtype:
            roles.append(str(stored_dtype).replace("torch.", ""))
        if datatype != P.DATATYPE_FP32 or packed:
            roles.append(P.DATATYPE_NAMES.get(datatype, f"type{datatype}"))
        roles = [r for r in roles if r]
        return name + "".join(f"#{r}" for r in roles)

    def _node_key(self, role: str) -> str:
        where = self.node.name if self.node is not None else "graph"
        count = self._node_keys[(where, role)] = self._node_keys.get((where, role), -1) + 1
        return f"{where}#{role}{count}"

    def set_value(self, node: torch.fx.Node, vid: int, layout: str) -> None:
        self._by_layout[(node, layout)] = vid
        self._primary.setdefault(node, Value(vid, layout, self.dims[vid]))

    def output(self, node: torch.fx.Node, layout: str = NCHW) -> int:
        """Define ``node``'s result value in ``layout`` (dims permuted for NHWC)."""
        dims = shape(node) or [1]
        if layout == NHWC:
            dims = [dims[i] for i in TO_NHWC]
        vid = self.define(dims)
        self.set_value(node, vid, layout)
        return vid

    def alias(self, node: torch.fx.Node, source: torch.fx.Node) -> None:
        """``node`` computes nothing: it is ``source``'s value."""
        primary = self.primary(source)
        self._alias_of[node] = source
        self.set_value(node, primary.id, primary.layout)
        for layout in (NCHW, NHWC):
            if (source, layout) in self._by_layout:
                self._by_layout.setdefault((node, layout), self._by_layout[(source, layout)])

    def primary(self, node: torch.fx.Node) -> Value:
        if node not in self._primary:
            if self.ctx.is_static(node):
                vid = self.constant(self.static_tensor(node))
                self.set_value(node, vid, NCHW)
            else:
                raise XnnpackPreprocessError(f"node {self._name()}: input {node.name!r} has no XNNPACK value")
        return self._primary[node]

    def layout(self, node: Any) -> str:
        return self.primary(self.quantized_source(node)).layout if isinstance(node, torch.fx.Node) else NCHW

    def quantized_source(self, node: torch.fx.Node) -> torch.fx.Node:
        """For a node computing quantized, the qint8 q behind a dq that was converted to fp32."""
        if node in self.dq_source and self.node in self.qplan.qout:
            return self.dq_source[node]
        return node

    def get(self, node: torch.fx.Node, layout: str | None = None) -> int:
        """``node``'s value in ``layout`` (its own layout if None), transposing once if needed."""
        static = self.static_qint8(node, layout or NCHW)
        if static is not None:
            return static
        node = self.quantized_source(node)
        primary = self.primary(node)
        layout = layout or primary.layout
        key = (node, layout)
        if key in self._by_layout:
            return self._by_layout[key]
        if len(primary.dims) != 4:
            raise XnnpackPreprocessError(f"node {self._name()}: {node.name!r} is not 4-D, it has no NHWC layout")
        if self.ctx.is_static(node):
            t = self.static_tensor(node)
            vid = self.constant(t.permute(TO_NHWC) if layout == NHWC else t)
        else:
            perm = TO_NHWC if layout == NHWC else TO_NCHW
            datatype, quant = self.value_type(primary.id)
            vid = self.define([primary.dims[i] for i in perm], datatype=datatype, quant=quant)
            self.add_node(fbx.NodeUnion.XNNStaticTranspose, transpose(perm, primary.id, vid))
        self._by_layout[key] = vid
        return vid

    def static_qint8(self, node: torch.fx.Node, layout: str = NCHW) -> int | None:
        """For the node being lowered, if it computes quantized: the qint8 constant (its int8 data and
        per-tensor parameters) of the static dq ``node`` it reads (:attr:`.qplan.QuantPlan.static_q`);
        else None (an fp32 reader reads the dequantized constant)."""
        params = self.qplan.static_q.get(node)
        if params is None or self.node not in self.qplan.qout:
            return None
        key = (node, f"qint8 {layout}")
        if key not in self._by_layout:
            t = self.ctx.tensor(node.args[0])
            t = t.permute(TO_NHWC) if layout == NHWC and t.dim() == 4 else t
            self._by_layout[key] = self.constant(t, datatype=P.DATATYPE_QINT8, quant=per_tensor_quant(params))
        return self._by_layout[key]

    def static_tensor(self, node: torch.fx.Node) -> torch.Tensor:
        """The value of a static node: a placeholder's tensor, or a fold of permute/view/clone of one."""
        if node not in self._static_cache:
            if node in self.ctx.static_targets:
                t = self.ctx.tensor(node)
            elif is_op(node, WEIGHT_DQ):
                t = self._dequantized(node)
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

    def _dequantized(self, node: torch.fx.Node) -> torch.Tensor:
        """The fp32 values of a quantized weight read by a node computing in fp32."""
        if node not in self.qplan.weights:
            constant = dequantized_constant(node, self.static_tensor)
            if constant is not None:
                return constant
        try:
            w = self.qplan.weights.get(node) or weight_of(node, self.static_tensor)
        except QuantWeightError as e:
            raise XnnpackPreprocessError(f"node {self._name()}: weight {node.name!r}: {e}") from None
        return w.dequantized()

    def scalar(self, value: float) -> int:
        return self.constant(torch.tensor([float(value)]))

    # ------------------------------------------------------------- nodes

    def add_node(self, kind: int, body: Any, *, fusable_output: int | None = None) -> fbx.XNodeT:
        node = fbx.XNodeT()
        node.xnodeUnionType = kind
        node.xnodeUnion = body
        node.debugHandle = len(self.nodes)
        self.nodes.append(node)
        if fusable_output is not None:
            self._producer[fusable_output] = len(self.nodes) - 1
        return node

    def _same_type(self, vid: int, node: torch.fx.Node) -> bool:
        """Whether ``vid`` has the type ``node``'s own result would have (a clamp fused into its
        producer must not change the quantization parameters)."""
        datatype, quant = self.value_type(vid)
        if node in self.qplan.qout:
            return _same_params(quant, self.qplan.qout[node])
        return datatype == P.DATATYPE_FP32

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
            elif chain in self.reshape_of:
                chain = self.reshape_of[chain]
            else:
                break
        if chain not in self._primary:
            return False
        produced = self._primary[chain]
        index = self._producer.get(produced.id)
        if index is None or self.tensor_value(produced.id).flags:
            return False
        if self._by_layout.get((chain, produced.layout)) != produced.id:
            return False
        if not self._same_type(produced.id, node):
            return False
        primary = self._primary[source]
        xnode = self.nodes[index]
        if xnode.outputMinMax is not None:
            lo, hi = max(lo, xnode.outputMinMax.outputMin), min(hi, xnode.outputMinMax.outputMax)
        xnode.outputMinMax = min_max(lo, hi)
        self.set_value(node, primary.id, primary.layout)
        return True


def _same_params(quant: Any, params: Any) -> bool:
    return isinstance(quant, fbx.PerTensorQuantT) and (quant.scale, quant.zeroPoint) == (
        float(params.scale), int(params.zero_point))


def _storage_of(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _view_role(view: torch.Tensor, source: torch.Tensor) -> str:
    """How ``view`` reads its weight ``source``: "" as it is, ``t`` / ``p<perm>`` a permutation,
    ``<d0>x<d1>..`` a reshape, else its sizes, strides and offset (all of them structure)."""
    if (view.shape, view.stride(), view.storage_offset()) == (source.shape, source.stride(), source.storage_offset()):
        return ""
    if view.storage_offset() == source.storage_offset() and view.dim() == source.dim():
        for perm in _permutations(source.dim()):
            if [source.shape[i] for i in perm] == list(view.shape) and \
                    [source.stride(i) for i in perm] == list(view.stride()):
                return "t" if perm == (1, 0) else "p" + "".join(str(i) for i in perm)
    if view.storage_offset() == source.storage_offset() and view.is_contiguous() and source.is_contiguous():
        return "x".join(str(d) for d in view.shape) or "scalar"
    return ("v" + "x".join(str(d) for d in view.shape) + "s" + "x".join(str(d) for d in view.stride())
            + f"o{view.storage_offset()}")


def _permutations(rank: int):
    import itertools

    return itertools.permutations(range(rank)) if rank <= 6 else ()
