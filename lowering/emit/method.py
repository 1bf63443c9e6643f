"""Stage 8, the method emitter: one ExecutionPlan from an edge-form program and its memory plan.

:class:`MethodEmitter` walks the program in graph order (see
:mod:`lowering.emit` for what each node becomes) and holds the value table
and data blobs while doing so; :func:`build_pte` / :func:`emit_program` wrap
its plan into a program.
"""

from __future__ import annotations

import operator
from typing import Any, Collection, Sequence

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils._pytree import treespec_dumps

from ..control_flow_graph import is_control_flow
from ..dynamic import SYM_OPS, DynamicShapeError, is_sym_op
from ..errors import EmitError, LoweringError
from ..memory_plan import SHARED_STATE_MEM_ID
from ..mutating_ops import is_auto_functionalized, mutated_bases, num_op_results, op_arguments, write_first_buffers
from ..pte import PteData, schema, serialize
from ..pte.flat_tensor import PtdEntry, TensorLayout
from ..pte.format import blob_key
from ..delegation import same_blob
from ..pte.scalar_types import DTYPE_TO_SCALAR_TYPE
from ..quant_ops import out_schema
from ..serialize import tensor_memory
from ..stock_ops.check import check_program_ops
from .control_flow import emit_control_flow
from .evalues import (
    allocation_details,
    compile_spec,
    empty_tensor_table,
    inline_list_evalue,
    list_element_type,
    list_evalue,
    scalar_evalue,
    scalar_tensor_dtype,
    string_evalue,
    tensor_bytes,
    tensor_evalue,
    tensor_table,
)

#: The method every lowerflow program has.
METHOD_NAME = "forward"

#: Memory formats and layouts as the runtime numbers them (c10 order).
_MEMORY_FORMATS = {torch.contiguous_format: 0, torch.preserve_format: 1}
_LAYOUTS = {torch.strided: 0}
_DELEGATE_CALL = "executorch_call_delegate"
_SYM_PLACEHOLDERS = {torch.SymInt: 0, torch.SymFloat: 0.0, torch.SymBool: False}


def emit_program(exported_program: ExportedProgram, memory_plan: Any, *, runtime_ops: Any = None) -> bytes:
    """The complete ``.pte`` of ``exported_program`` laid out by ``memory_plan``
    (weights inside; for a ``.pte`` and its ``.ptd`` see :func:`build_pte` with
    ``external_weights`` and :func:`lowering.external.program_files`).

    ``memory_plan`` follows the contract of :mod:`lowering.memory_plan`
    (``out_variants``, ``allocations``, ``arena_sizes``, optional ``aliases``).
    Raises :class:`EmitError` naming the node for anything unsupported, and
    :class:`~lowering.errors.MissingOperatorError` for an operator the runtime profile
    ``runtime_ops`` lacks (:mod:`lowering.stock_ops`; None: the default profile).
    """
    return serialize(build_pte(exported_program, memory_plan, runtime_ops=runtime_ops))


def build_pte(exported_program: ExportedProgram, memory_plan: Any, *, runtime_ops: Any = None,
              external_weights: bool = False, initial_read: Collection[str] | None = None) -> PteData:
    """The program tables and data blobs, before serialization; every KernelCall's
    operator checked against the runtime profile ``runtime_ops``.

    ``external_weights``: the program's weights (parameters, constant buffers, lifted
    tensor constants) are ``EXTERNAL`` tensors named by their fully qualified names,
    and the delegates' named data is external too: both go to ``PteData.external``
    (the ``.ptd``), none into the ``.pte``.  The ``.pte`` then depends on the
    program's structure only: a retrain (same program, new weights) emits the same
    ``.pte`` bytes and a new ``.ptd``.

    ``initial_read``: in a program of several methods, the mutable buffers (FQNs) whose
    initial value some method may read (:func:`lowering.methods.state_read_first`); a
    buffer this method writes before reading and no method reads first gets no stored
    initial value.  None (one method alone): a buffer in the shared-state arena keeps it.
    """
    emitter = MethodEmitter(exported_program, memory_plan, external_weights=external_weights,
                            initial_read=initial_read)
    plan = emitter.emit()
    check_program_ops(emitter.operator_nodes, runtime_ops)
    program = schema.ProgramT()
    program.version = 0
    program.executionPlan = [plan]
    return PteData(
        program=program,
        constants=emitter.constants,
        mutable_data=emitter.mutable_data if len(emitter.mutable_data) > 1 else [],
        delegate_data=emitter.delegate_payloads,
        named_data={} if external_weights else emitter.named_data,
        external=emitter.external_data() if external_weights else {},
    )


class MethodEmitter:
    """Builds one ExecutionPlan; holds the value table and data blobs while doing so."""

    def __init__(self, ep: ExportedProgram, memory_plan: Any, external_weights: bool = False,
                 initial_read: Collection[str] | None = None) -> None:
        self.ep = ep
        #: Mutable buffers (FQNs) whose initial value a method may read; None: not known.
        self.initial_read = None if initial_read is None else frozenset(initial_read)
        #: Weights as EXTERNAL tensors (key: FQN) bound from the .ptd (see :func:`build_pte`).
        self.external_weights = external_weights
        self.external: dict[str, PtdEntry] = {}
        #: A delegate's named data that is a weight as the program holds it -> its layout.
        self._named_layouts: dict[str, TensorLayout] = {}
        self.plan = memory_plan
        self.aliases: dict[str, str] = dict(getattr(memory_plan, "aliases", None) or {})
        self.values: list[schema.EValueT] = []
        self.constants: list[bytes] = [b""]
        self._constant_index: dict[bytes, int] = {}
        self.mutable_data: list[bytes] = [b""]
        self._mutable_index: dict[bytes, int] = {}
        self.delegate_payloads: list[bytes] = []
        self._payload_index: dict[bytes, int] = {}
        self.delegates: list[schema.BackendDelegateT] = []
        #: Named data of every lowered module (key -> blob), for Program.named_data.
        self.named_data: dict[str, bytes] = {}
        self._delegate_of_module: dict[str, int] = {}
        self.operators: list[schema.OperatorT] = []
        self._operator_index: dict[tuple[str, str], int] = {}
        #: ``"ns::name.overload"`` -> the first node calling it (for the runtime-profile check).
        self.operator_nodes: dict[str, str] = {}
        self.instructions: list[schema.InstructionT] = []
        self.inputs: list[int] = []
        self.outputs: list[int] = []
        #: fx node -> value id (tensor or other), or list of ids for multi-output nodes.
        self.node_values: dict[torch.fx.Node, Any] = {}
        self.node: torch.fx.Node | None = None
        #: Key prefix of the values being emitted ("" at the top level, "<submodule>/" inside
        #: a cond branch or map body) and the graph module holding their get_attr targets.
        self.scope = ""
        self.graph_module = ep.graph_module

    # ------------------------------------------------------------------ driver

    def emit(self) -> schema.ExecutionPlanT:
        signature = self.ep.graph_signature
        self.input_kinds = {
            spec.arg.name: spec for spec in signature.input_specs if hasattr(spec.arg, "name")
        }
        self.mutated_targets = {
            spec.target for spec in signature.output_specs if spec.kind == OutputKind.BUFFER_MUTATION
        }
        mutations = {spec.arg.name for spec in signature.output_specs if spec.kind == OutputKind.BUFFER_MUTATION}
        #: Mutated buffers written before every read (KV caches): planned, no initial value.
        self.write_first = write_first_buffers(self.ep.graph, mutations)
        for node in self.ep.graph.nodes:
            self.node = node
            if node.op == "placeholder":
                self._emit_placeholder(node)
            elif node.op == "get_attr":
                self.node_values[node] = None  # resolved by the delegate call that uses it
            elif node.op == "call_function":
                self.emit_call(node)
            elif node.op == "output":
                self._emit_output(node)
            else:
                raise EmitError(f"node {node.name!r}: {node.op} nodes are not supported")
        self.node = None
        return self._execution_plan()

    def _execution_plan(self) -> schema.ExecutionPlanT:
        chain = schema.ChainT()
        # Empty, as ExecuTorch's emitter writes them: the runtime reads a
        # chain's instructions only (the plan's inputs/outputs are the method's).
        chain.inputs = []
        chain.outputs = []
        chain.instructions = self.instructions
        plan = schema.ExecutionPlanT()
        plan.name = METHOD_NAME
        plan.containerMetaType = self._container_metadata()
        plan.values = self.values
        plan.inputs = list(self.inputs)
        plan.outputs = list(self.outputs)
        plan.chains = [chain]
        plan.operators = self.operators
        plan.delegates = self.delegates
        sizes = [int(s) for s in self.plan.arena_sizes] or [0]
        plan.nonConstBufferSizes = sizes
        return plan

    def _container_metadata(self) -> schema.ContainerMetadataT:
        """Pytree specs of inputs ((args), {kwargs}) and outputs, in torch's treespec_dumps format."""
        meta = schema.ContainerMetadataT()
        call_spec = self.ep.call_spec
        meta.encodedInpStr = treespec_dumps(call_spec.in_spec) if call_spec.in_spec is not None else ""
        meta.encodedOutStr = treespec_dumps(call_spec.out_spec) if call_spec.out_spec is not None else ""
        return meta

    def error(self, message: str) -> EmitError:
        where = f"node {self.node.name!r} ({self.node.target})" if self.node is not None else "program"
        return EmitError(f"{where}: {message}")

    # ------------------------------------------------------------ placeholders

    def _emit_placeholder(self, node: torch.fx.Node) -> None:
        spec = self.input_kinds.get(node.name)
        if spec is None:
            raise self.error("placeholder missing from the graph signature")
        kind = spec.kind
        if kind == InputKind.USER_INPUT:
            self._emit_user_input(node)
        elif kind == InputKind.BUFFER and (spec.target in self.mutated_targets or node.name in self.plan.allocations):
            # State: mutated here, or planned as state shared with another method.
            initial = self._state_tensor(spec.target)
            value = self.planned_tensor(node.name, node.meta["val"])
            if self.initial_read is None:
                read_first = self.values[value].val.allocationInfo.memoryId == SHARED_STATE_MEM_ID
            else:
                read_first = spec.target in self.initial_read
            if node.name not in self.write_first or read_first:
                self.values[value].val.dataBufferIdx = self._add_mutable_data(initial)
            self.node_values[node] = value
        elif kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            tensor = self._state_tensor(spec.target)
            if self.external_weights:
                self.node_values[node] = self._external_tensor(spec.target, tensor)
            else:
                self.node_values[node] = self._constant_tensor(tensor)
        else:
            raise self.error(f"{kind.name} inputs are not supported")

    def _emit_user_input(self, node: torch.fx.Node) -> None:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            value = self.planned_tensor(node.name, val)
        elif isinstance(val, (bool, int, float)) or val is None:
            value = self.add_value(scalar_evalue(val))
        elif isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            # A size computed outside (a delegated partition's symbolic input):
            # a placeholder of its type, set when the method is called.
            value = self.add_value(scalar_evalue(_SYM_PLACEHOLDERS[type(val)]))
        else:
            raise self.error(f"user input of type {type(val).__name__} is not supported")
        self.node_values[node] = value
        self.inputs.append(value)

    def _state_tensor(self, target: str) -> torch.Tensor:
        if target in self.ep.constants:
            tensor = self.ep.constants[target]
        elif target in self.ep.state_dict:
            tensor = self.ep.state_dict[target]
        else:
            raise self.error(f"no tensor named {target!r} in the program's state_dict or constants")
        if not isinstance(tensor, torch.Tensor):
            raise self.error(f"{target!r} is a {type(tensor).__name__}, not a tensor")
        return tensor.detach()

    # ------------------------------------------------------------------- calls

    def emit_call(self, node: torch.fx.Node) -> None:
        target = node.target
        if target is operator.getitem:
            self._emit_getitem(node)
        elif getattr(target, "__name__", "") == _DELEGATE_CALL:
            self._emit_delegate_call(node)
        elif is_sym_op(target):
            self._emit_sym_op(node)
        elif is_control_flow(node):
            emit_control_flow(self, node)
        elif is_auto_functionalized(node):
            self._emit_mutating_call(node)
        elif isinstance(target, torch._ops.OpOverload):
            if self.scope + node.name in self.aliases:
                self.node_values[node] = self.planned_tensor(self.scope + node.name, node.meta["val"])
            else:
                self._emit_kernel_call(node)
        else:
            raise self.error("only ATen operators, getitem and delegate calls can be emitted")

    def _emit_getitem(self, node: torch.fx.Node) -> None:
        source, index = node.args
        outputs = self.node_values.get(source)
        if not isinstance(outputs, list) or not isinstance(index, int) or index >= len(outputs):
            raise self.error(f"getitem {index!r} of {source.name!r}, which has no such output")
        self.node_values[node] = outputs[index]

    def _emit_mutating_call(self, node: torch.fx.Node) -> None:
        """A mutating custom op (``auto_functionalized_v2``): its ``.out`` variant writes the base
        in place; the base's new value is the base's own value (no copy, no write-back).  See
        :mod:`lowering.mutating_ops`."""
        try:
            args = op_arguments(node)
            bases = [self.node_value(base) for _, base in mutated_bases(node)]
        except LoweringError as exc:
            raise self.error(str(exc)) from None
        val = node.meta.get("val")
        own = [self.planned_tensor(f"{self.scope}{node.name}.{i}", v) for i, v in enumerate(val[:num_op_results(node)])]
        self._emit_kernel_call(node, args, own + bases)

    def _emit_kernel_call(self, node: torch.fx.Node, args: dict[str, Any] | None = None,
                          results: Any = None) -> None:
        out_schema, name, overload = self._out_variant(node)
        results = self.node_results(node) if results is None else results
        result_list = results if isinstance(results, list) else [results]
        out_args = [a for a in out_schema.arguments if a.is_out]
        args = self._functional_arguments(node) if args is None else args
        arg_ids: list[int] = []
        out_ids: list[int] = []
        for argument in out_schema.arguments:
            if argument.is_out:
                value = self._out_argument(argument, out_args, result_list)
                out_ids.append(value)
            elif argument.name in args:
                value = self._argument(args[argument.name], argument.type, node)
            elif argument.has_default_value():
                value = self._argument(argument.default_value, argument.type, node)
            else:
                raise self.error(f"out variant {name}.{overload} needs argument {argument.name!r}, "
                                  f"which the node does not give")
            arg_ids.append(value)
        if len(out_ids) == 1:
            arg_ids.append(out_ids[0])
        elif out_ids:
            arg_ids.append(self.add_value(list_evalue(schema.KernelTypes.TensorList, out_ids)))
        self.kernel_call(name, overload, arg_ids)
        self.node_values[node] = results

    def _emit_sym_op(self, node: torch.fx.Node) -> None:
        """A symbolic scalar op: ``KernelCall(prim op, [*operands, result])``.

        Before::

            %sym_size_int = aten.sym_size.int(%x, 0)
            %add = operator.add(%sym_size_int, 1)

        After: ``aten::sym_size.int(x, 0, v0)`` then ``executorch_prim::add.Scalar(v0, 1, v1)``,
        where ``v0``/``v1`` are Int values (placeholders the runtime overwrites).
        """
        name, overload = SYM_OPS[node.target]
        if node.kwargs:
            raise self.error("a symbolic op with keyword arguments cannot be emitted")
        args = [self._sym_operand(arg) for arg in node.args]
        val = node.meta.get("val")
        if isinstance(val, (bool, torch.SymBool)):
            result = self.add_value(scalar_evalue(False))
        elif isinstance(val, (float, torch.SymFloat)):
            result = self.add_value(scalar_evalue(0.0))
        else:
            result = self.add_value(scalar_evalue(0))
        self.kernel_call(name, overload, args + [result])
        self.node_values[node] = result

    def _sym_operand(self, arg: Any) -> int:
        if isinstance(arg, torch.fx.Node):
            return self.node_value(arg)
        if isinstance(arg, (bool, int, float)):
            return self.add_value(scalar_evalue(arg))
        raise self.error(f"symbolic op operand of type {type(arg).__name__} cannot be emitted")

    def _out_variant(self, node: torch.fx.Node):
        qualified = self.plan.out_variants.get(self.scope + node.name)
        if not qualified:
            raise self.error("the memory plan gives no out variant for this node")
        name, _, overload = qualified.rpartition(".")
        namespace, _, op_name = name.partition("::")
        parsed = out_schema(qualified)  # the stock quantized kernels: schemas of our own
        if parsed is not None:
            return parsed, name, overload
        try:
            op = getattr(getattr(getattr(torch.ops, namespace), op_name), overload)
        except (AttributeError, RuntimeError):
            raise self.error(f"out variant {qualified!r} is not a known operator") from None
        return op._schema, name, overload

    def _functional_arguments(self, node: torch.fx.Node) -> dict[str, Any]:
        """The node's arguments by schema name (positional and keyword)."""
        arguments = node.target._schema.arguments
        given: dict[str, Any] = {}
        for argument, value in zip(arguments, node.args):
            given[argument.name] = value
        given.update(node.kwargs)
        return given

    def _out_argument(self, argument, out_args, results: list[int]) -> int:
        """The value of one ``out`` argument: a result tensor, or a TensorList of all results."""
        if isinstance(argument.type, torch.ListType):
            return self.add_value(list_evalue(schema.KernelTypes.TensorList, results))
        index = out_args.index(argument)
        if index >= len(results):
            raise self.error(f"out argument {argument.name!r} has no matching result")
        return results[index]

    def node_results(self, node: torch.fx.Node) -> Any:
        """Planned tensor value(s) of a node's result: an id, or a list of ids for tuples."""
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return self.planned_tensor(self.scope + node.name, val)
        if isinstance(val, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in val):
            return [self.planned_tensor(f"{self.scope}{node.name}.{i}", v) for i, v in enumerate(val)]
        raise self.error(f"result of type {type(val).__name__} cannot be emitted")

    def kernel_call(self, name: str, overload: str, args: Sequence[int]) -> None:
        node = self.scope + self.node.name if self.node is not None else "output"
        self.operator_nodes.setdefault(f"{name}.{overload}" if overload else name, node)
        call = schema.KernelCallT()
        call.opIndex = self._operator(name, overload)
        call.args = list(args)
        self.instruction(schema.InstructionArguments.KernelCall, call)

    def instruction(self, kind: int, args: Any) -> None:
        instruction = schema.InstructionT()
        instruction.instrArgsType = kind
        instruction.instrArgs = args
        self.instructions.append(instruction)

    def _operator(self, name: str, overload: str) -> int:
        key = (name, overload)
        if key not in self._operator_index:
            entry = schema.OperatorT()
            entry.name = name
            entry.overload = overload
            self._operator_index[key] = len(self.operators)
            self.operators.append(entry)
        return self._operator_index[key]

    # --------------------------------------------------------------- delegates

    def _emit_delegate_call(self, node: torch.fx.Node) -> None:
        module_node, *inputs = node.args
        delegate_index = self._delegate(module_node)
        input_ids = [self._delegate_input(value) for value in inputs]
        val = node.meta.get("val")
        if not isinstance(val, (tuple, list)):
            raise self.error("a delegate call must return a tuple of tensors")
        results = self.node_results(node)
        call = schema.DelegateCallT()
        call.delegateIndex = delegate_index
        call.args = input_ids + list(results)
        self.instruction(schema.InstructionArguments.DelegateCall, call)
        self.node_values[node] = results

    def _delegate_input(self, value: Any) -> int:
        if isinstance(value, torch.fx.Node):
            return self.node_value(value)
        return self.add_value(self._constant_evalue(value, None))

    def _delegate(self, module_node: Any) -> int:
        """Index of the BackendDelegate of the lowered module named by a get_attr node."""
        if not isinstance(module_node, torch.fx.Node) or module_node.op != "get_attr":
            raise self.error("the first argument of a delegate call must be a get_attr of a lowered module")
        module_key = self.scope + module_node.target
        if module_key in self._delegate_of_module:
            return self._delegate_of_module[module_key]
        try:
            lowered = getattr(self.graph_module, module_node.target)
            backend_id, payload, compile_specs = lowered.backend_id, lowered.processed_bytes, lowered.compile_specs
        except AttributeError as exc:
            raise self.error(f"{module_node.target!r} is not a lowered backend module: {exc}") from None
        for key, blob in (getattr(lowered, "named_data", None) or {}).items():
            if not same_blob(self.named_data.setdefault(key, blob), blob):
                raise self.error(f"named data key {key!r} of {module_node.target!r} is already "
                                  "used by another delegate for different bytes")
            if self.external_weights and key not in self._named_layouts:
                layout = _weight_layout(getattr(lowered, "original_module", None), key, blob)
                if layout is not None:
                    self._named_layouts[key] = layout
        delegate = schema.BackendDelegateT()
        delegate.id = backend_id
        reference = schema.BackendDelegateDataReferenceT()
        reference.location = schema.DataLocation.SEGMENT
        reference.index = self._add_payload(bytes(payload))
        delegate.processed = reference
        delegate.compileSpecs = [compile_spec(spec.key, spec.value) for spec in compile_specs]
        self._delegate_of_module[module_key] = len(self.delegates)
        self.delegates.append(delegate)
        return len(self.delegates) - 1

    def _add_payload(self, payload: bytes) -> int:
        if payload not in self._payload_index:
            self._payload_index[payload] = len(self.delegate_payloads)
            self.delegate_payloads.append(payload)
        return self._payload_index[payload]

    # ------------------------------------------------------------------ output

    def _emit_output(self, node: torch.fx.Node) -> None:
        results = node.args[0]
        specs = self.ep.graph_signature.output_specs
        if len(results) != len(specs):
            raise self.error(f"{len(results)} outputs but {len(specs)} output specs")
        write_backs = []
        for value, spec in zip(results, specs):
            if spec.kind == OutputKind.BUFFER_MUTATION:
                write_backs.append((spec.target, value))
            elif spec.kind == OutputKind.USER_OUTPUT:
                self.outputs.append(self.output_value(value))
            else:
                raise self.error(f"{spec.kind.name} outputs are not supported")
        for target, value in write_backs:
            self._write_back(target, value)

    def output_value(self, value: Any) -> int:
        if isinstance(value, torch.fx.Node):
            return self.node_value(value)
        return self.add_value(self._constant_evalue(value, None))

    def _write_back(self, buffer_target: str, value: torch.fx.Node) -> None:
        """``aten::copy_(buffer, new_value)``: the mutated state lands in the buffer's planned memory."""
        placeholder = next(
            (n for n, spec in self.input_kinds.items()
             if spec.kind == InputKind.BUFFER and spec.target == buffer_target),
            None,
        )
        if placeholder is None:
            raise self.error(f"mutated buffer {buffer_target!r} has no placeholder")
        buffer_node = next(n for n in self.ep.graph.nodes if n.name == placeholder)
        buffer_id = self.node_value(buffer_node)
        new_id = self.node_value(value)
        if buffer_id == new_id:
            return
        non_blocking = self.add_value(scalar_evalue(False))
        self.kernel_call("aten::copy_", "", [buffer_id, new_id, non_blocking, buffer_id])

    # ------------------------------------------------------------------ values

    def add_value(self, evalue: schema.EValueT) -> int:
        self.values.append(evalue)
        return len(self.values) - 1

    def node_value(self, node: torch.fx.Node) -> int:
        value = self.node_values.get(node)
        if not isinstance(value, int):
            raise self.error(f"input {node.name!r} has no single emitted value")
        return value

    def planned_tensor(self, key: str, val: torch.Tensor) -> int:
        allocation = self.plan.allocations.get(key)
        if allocation is None:
            raise self.error(f"the memory plan has no allocation for value {key!r}")
        # Planned tensors are contiguous whatever strides the (possibly stale)
        # meta value has: *_copy ops write dense outputs, and the portable
        # kernels expect inputs and outputs in the same dim order.
        try:
            tensor = tensor_table(val, list(range(val.dim())), self.ep.range_constraints)
        except DynamicShapeError as exc:
            raise self.error(str(exc)) from None
        tensor.allocationInfo = allocation_details(allocation.mem_id, allocation.offset)
        return self.add_value(tensor_evalue(tensor))

    def _constant_tensor(self, tensor: torch.Tensor) -> int:
        """A tensor stored in the constant segment (identical bytes stored once)."""
        if tensor.dtype not in DTYPE_TO_SCALAR_TYPE:
            raise self.error(f"constant of dtype {tensor.dtype} cannot be stored")
        dense = tensor.contiguous()
        data = tensor_memory(dense)  # a view of the program's own weight: the .pte is its one copy
        table = tensor_table(dense, list(range(dense.dim())))
        key = blob_key(data)
        if key not in self._constant_index:
            self._constant_index[key] = len(self.constants)
            self.constants.append(data)
        table.dataBufferIdx = self._constant_index[key]
        return self.add_value(tensor_evalue(table))

    def _external_tensor(self, name: str, tensor: torch.Tensor) -> int:
        """A weight bound at load time from the ``.ptd`` by its name ``name`` and its layout.

        Before: ``Tensor{data_buffer_idx: i}`` with the bytes in the constant segment.
        After: ``Tensor{data_buffer_idx: 0, extra_tensor_info: {fully_qualified_name: name,
        location: EXTERNAL}}`` and ``external[name] = (bytes, layout)``.
        """
        if tensor.dtype not in DTYPE_TO_SCALAR_TYPE:
            raise self.error(f"constant of dtype {tensor.dtype} cannot be stored")
        dense = tensor.contiguous()
        table = tensor_table(dense, list(range(dense.dim())))
        info = schema.ExtraTensorInfoT()
        info.fullyQualifiedName = name
        info.location = schema.TensorDataLocation.EXTERNAL
        table.extraTensorInfo = info
        entry = PtdEntry(tensor_memory(dense), TensorLayout(int(table.scalarType), tuple(int(d) for d in dense.shape),
                                                            tuple(range(dense.dim()))))
        known = self.external.setdefault(name, entry)
        if known.layout != entry.layout or not same_blob(known.data, entry.data):
            raise self.error(f"two different weights are both named {name!r}")
        return self.add_value(tensor_evalue(table))

    def external_data(self) -> dict[str, PtdEntry]:
        """What the ``.ptd`` holds: the external tensors, then the delegates' named data; a key
        both name is one entry (equal bytes: a weight the top level and a delegate share).  A
        delegate's blob that is a weight as the program holds it (key: its name, same bytes)
        gets that weight's layout too, so a portable program of the same weights binds the
        same entry: the two targets' ``.ptd`` files can be one file."""
        data = dict(self.external)
        for key, blob in self.named_data.items():
            if key in data:
                if not same_blob(data[key].data, blob):
                    raise EmitError(f"external weight {key!r}: a delegate names different bytes than the program")
            else:
                data[key] = PtdEntry(blob, self._named_layouts.get(key))
        return data

    def _add_mutable_data(self, tensor: torch.Tensor) -> int:
        """The index of ``tensor``'s initial value; equal bytes are stored once (initial values
        are read-only sources copied into each buffer's planned memory at load, as in
        :class:`lowering.methods._DataPool` and ExecuTorch's emitter): e.g. a decoder's
        zero KV caches of one shape share one blob."""
        data = tensor_bytes(tensor.contiguous())
        if data not in self._mutable_index:
            self._mutable_index[data] = len(self.mutable_data)
            self.mutable_data.append(data)
        return self._mutable_index[data]

    # --------------------------------------------------------------- arguments

    def _argument(self, value: Any, jit_type: Any, node: torch.fx.Node) -> int:
        """The value id of one kernel argument of schema type ``jit_type``."""
        if isinstance(value, torch.fx.Node):
            return self.node_value(value)
        if value is None and isinstance(jit_type, torch.TensorType):
            return self.add_value(tensor_evalue(empty_tensor_table()))
        if isinstance(jit_type, torch.TensorType) and isinstance(value, (bool, int, float)):
            return self._constant_tensor(torch.tensor(value, dtype=scalar_tensor_dtype(node, value)))
        return self.add_value(self._constant_evalue(value, jit_type))

    def _constant_evalue(self, value: Any, jit_type: Any) -> schema.EValueT:
        if isinstance(value, (list, tuple)):
            element = list_element_type(jit_type, value)
            return self._list_argument(list(value), element)
        if isinstance(value, torch.dtype):
            if value not in DTYPE_TO_SCALAR_TYPE:
                raise self.error(f"dtype {value} is not supported")
            return scalar_evalue(int(DTYPE_TO_SCALAR_TYPE[value]))
        if isinstance(value, torch.memory_format):
            if value not in _MEMORY_FORMATS:
                raise self.error(f"memory format {value} is not supported")
            return scalar_evalue(_MEMORY_FORMATS[value])
        if isinstance(value, torch.layout):
            if value not in _LAYOUTS:
                raise self.error(f"layout {value} is not supported")
            return scalar_evalue(_LAYOUTS[value])
        if isinstance(value, torch.device):
            return string_evalue(str(value))
        if isinstance(value, str):
            return string_evalue(value)
        if value is None or isinstance(value, (bool, int, float)):
            return scalar_evalue(value)
        raise self.error(f"argument of type {type(value).__name__} cannot be emitted")

    def _list_argument(self, items: list, element: Any) -> schema.EValueT:
        if isinstance(element, torch.BoolType):
            return inline_list_evalue(schema.KernelTypes.BoolList, schema.BoolListT(), [bool(v) for v in items])
        if isinstance(element, torch.FloatType):
            return inline_list_evalue(schema.KernelTypes.DoubleList, schema.DoubleListT(), [float(v) for v in items])
        if isinstance(element, torch.IntType):
            ids = [self.node_value(v) if isinstance(v, torch.fx.Node) else self.add_value(scalar_evalue(int(v)))
                   for v in items]
            return list_evalue(schema.KernelTypes.IntList, ids)
        if isinstance(element, torch.TensorType):
            return list_evalue(schema.KernelTypes.TensorList, [self.node_value(v) for v in items])
        if isinstance(element, torch.OptionalType) and isinstance(element.getElementType(), torch.TensorType):
            ids = [-1 if v is None else self.node_value(v) for v in items]
            return list_evalue(schema.KernelTypes.OptionalTensorList, ids)
        raise self.error(f"list argument of element type {element} cannot be emitted")


def _weight_layout(program: Any, key: str, blob: Any) -> "TensorLayout | None":
    """The layout of weight ``key`` of ``program`` (a delegate's original program) if ``blob``
    is exactly its bytes, else None (a blob in the backend's own layout)."""
    if program is None:
        return None
    tensor = program.state_dict.get(key, program.constants.get(key))
    if not isinstance(tensor, torch.Tensor) or tensor.dtype not in DTYPE_TO_SCALAR_TYPE:
        return None
    dense = tensor.detach().contiguous()
    if not same_blob(tensor_memory(dense), blob):
        return None
    return TensorLayout(int(DTYPE_TO_SCALAR_TYPE[dense.dtype]), tuple(int(d) for d in dense.shape),
                        tuple(range(dense.dim())))
