"""Calling ExecuTorch's own partitioners and ``preprocess`` inside lowerflow's stages.

Stage 2 (:class:`EtPartitioner`): ExecuTorch's partitioners read edge-dialect ops
(``EdgeOpOverload.__name__`` is ``aten.addmm.default``, an ATen overload's is
``addmm.default``: on the ATen graph OpenVINO's tags 0 of 8 nodes).  So the partitioner
runs on a copy whose ATen targets are retargeted, node for node, to
``exir_ops.edge.*`` (names kept), and its tags are copied back by node name::

    lowerflow's program                 the copy ExecuTorch's partitioner sees
    %addmm = aten.addmm.default(...)    %addmm = <EdgeOpOverload: aten.addmm.default>(...)  {tag: tag0}
    after: %addmm {delegation_tag: OpenvinoBackend_tag0}

Stage 5 (:func:`et_preprocess`): the partition's program is brought to ExecuTorch's
edge form with ExecuTorch's ``to_edge`` (IR checks off) and handed to the backend's
own ``preprocess``; its named data (``NamedDataStoreOutput``) becomes lowerflow's
``named_data``.  One fix: lowerflow's partition programs name their input and output
nodes in the module call graph, which ExecuTorch's passes rename
(``SpecViolationError: Output addmm_2 does not exist in the graph``); they get an
anonymous signature, as ExecuTorch's own partition programs have.
"""

from __future__ import annotations

import contextlib
import io
import logging
import operator

import torch
from torch.export import ExportedProgram
from torch.export.exported_program import ModuleCallEntry, ModuleCallSignature

from ...delegation import TAG, CompileSpec, DelegationSpec, PreprocessResult
from ...errors import BackendError
from ...export import KEPT
from ...partition import Partitioner, PartitionResult
from ...program import copy_program

#: Named-data alignments lowerflow's segments (aligned to 128) honour.
SEGMENT_ALIGNMENT = 128


@contextlib.contextmanager
def quiet():
    """ExecuTorch's partitioners print a line per unsupported op and log per partition."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logging.disable(previous)


def retarget_to_edge(gm: torch.fx.GraphModule) -> int:
    """Point every ATen ``OpOverload`` call at its ``exir_ops.edge`` twin, in place (names kept).

    Before:: %addmm = aten.addmm.default(%b, %x, %w)
    After::  %addmm = <EdgeOpOverload aten.addmm.default>(%b, %x, %w)
    """
    from executorch.exir.passes.replace_aten_with_edge_pass import aten_to_edge, should_lower_to_edge

    changed = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and should_lower_to_edge(node.target):
            try:
                node.target = aten_to_edge(node.target)
            except (AttributeError, RuntimeError):
                continue  # an op ExecuTorch's edge dialect lacks: its partitioner will not take it
            changed += 1
    return changed


def retarget_dim_order(gm: torch.fx.GraphModule) -> int:
    """Point every edge ``clone`` / ``_to_copy`` at ExecuTorch's dim-order twin, in place, as
    ``to_edge``'s ``MemoryFormatOpsPass`` does: ExecuTorch's partitioners take (and their
    backends drop) a no-op ``_clone_dim_order``, where an ``aten.clone`` cut BERT into 12
    Ethos-U partitions (ExecuTorch's: 2).  Only the partitioner's copy changes.

    Before:: %clone = aten.clone.default(%x, memory_format=torch.contiguous_format)
    After::  %clone = dim_order_ops._clone_dim_order.default(%x, dim_order=[0, 1, 2])
    """
    from executorch.exir.dim_order_utils import get_dim_order
    from executorch.exir.passes.dim_order_ops_registry import DimOrderOpsMap

    changed = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in DimOrderOpsMap:
            continue
        val = node.meta.get("val")
        source = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
        if not isinstance(val, torch.Tensor):
            continue
        kwargs = dict(node.kwargs)
        memory_format = kwargs.pop("memory_format", torch.preserve_format)
        if memory_format in (None, torch.preserve_format):
            order = source.dim_order() if isinstance(source, torch.Tensor) else range(val.dim())
        else:
            order = get_dim_order(memory_format, val.dim())
        kwargs["dim_order"] = [int(d) for d in order]
        node.target, node.kwargs = DimOrderOpsMap[node.target], kwargs
        changed += 1
    return changed


def scalars_to_constants(program: ExportedProgram) -> int:
    """Give every Python scalar that an op takes as a Tensor argument its own lifted constant, in
    place, as ExecuTorch's ``to_edge`` does (``ScalarToTensorPass``): its partitioners read both
    operands of ``add.Tensor`` as nodes (Vulkan asserts).  Only the partitioner's copy changes.

    Before:: %add_2 = aten.add.Tensor(%arange_6, 0)
    After::  %c_scalar_0 : placeholder (tensor(0))   %add_2 = aten.add.Tensor(%arange_6, %c_scalar_0)
    """
    from torch._guards import detect_fake_mode
    from torch.export.graph_signature import InputKind, InputSpec, TensorArgument

    graph = program.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    fake_mode = detect_fake_mode([n.meta.get("val") for n in placeholders])
    user_inputs = set(program.graph_signature.user_inputs)
    first_user = next((i for i, n in enumerate(placeholders) if n.name in user_inputs), len(placeholders))
    count = 0
    for node in list(graph.nodes):
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        if schema is None or fake_mode is None:
            continue
        args = list(node.args)
        for i, (value, arg) in enumerate(zip(args, schema.arguments)):
            if type(value) not in (int, float, bool) or not isinstance(arg.type, torch.TensorType):
                continue
            name = f"c_scalar_{count}"
            with graph.inserting_before(placeholders[first_user] if first_user < len(placeholders) else
                                        next(iter(n for n in graph.nodes if n.op != "placeholder"))):
                constant = graph.placeholder(name)
            tensor = torch.tensor(value)
            constant.meta["val"] = fake_mode.from_tensor(tensor, static_shapes=True)
            program.constants[name] = tensor
            program.graph_signature.input_specs.insert(
                first_user + count, InputSpec(InputKind.CONSTANT_TENSOR, TensorArgument(name), target=name))
            args[i] = constant
            count += 1
        node.args = tuple(args)
    if count:
        program.graph_module.recompile()
    return count


class EtPartitioner(Partitioner):
    """Tags what ExecuTorch's own partitioner ``et_partitioner`` of ``backend_id`` takes.

    Tags are ``f"{backend_id}_{tag}"`` (so a chain's partitions never share a name);
    a getitem follows its producer and a tag left without a computing node is dropped.
    Stage 1 leaves parameters' view copies unfolded for it (``fold_constants``), as ExecuTorch's
    graph has them: OpenVINO's CPU plugin then makes its fully connected layers of them (a folded
    ``W.T`` ran 1.05-1.10x slower than ExecuTorch's program, as snippets MatMuls) and Vulkan's
    payload is ExecuTorch's byte for byte.  Its partitioner sees the graph as ExecuTorch's
    ``to_edge`` makes it: edge ops (:func:`retarget_to_edge`), dim-order copies
    (:func:`retarget_dim_order`) and scalars as constants (:func:`scalars_to_constants`).
    """

    fold_constants = False

    def __init__(self, backend_id: str, et_partitioner, quantizer_for=None) -> None:
        self.backend_id = backend_id
        self.et_partitioner = et_partitioner
        self.quantizer_for = quantizer_for

    def quantizer(self, recipe):
        """The backend's own PT2E quantizer for ``recipe`` (``quantizer_for(recipe)``), if it has one."""
        return self.quantizer_for(recipe) if self.quantizer_for is not None else None

    def ops_to_not_decompose(self, exported_program: ExportedProgram):
        """ExecuTorch's partitioner's own answer, on the program before decomposition (as
        ``to_edge_transform_and_lower`` asks it): Core ML keeps ``linear``, ``max_pool2d``, ..."""
        try:
            with quiet():
                return self.et_partitioner.ops_to_not_decompose(exported_program)
        except Exception as exc:
            raise BackendError(f"ExecuTorch's {type(self.et_partitioner).__name__}.ops_to_not_decompose failed on "
                               f"this program: {type(exc).__name__}: {exc}") from exc

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        edge = copy_program(exported_program)
        retarget_to_edge(edge.graph_module)
        retarget_dim_order(edge.graph_module)
        scalars_to_constants(edge)
        try:
            with quiet():
                result = self.et_partitioner.partition(edge)
        except Exception as exc:
            raise BackendError(f"ExecuTorch's {type(self.et_partitioner).__name__} failed on this program: "
                               f"{type(exc).__name__}: {exc}") from exc
        tags = {n.name: n.meta.get(TAG) for n in result.tagged_exported_program.graph.nodes}
        nodes = list(exported_program.graph.nodes)
        for node in nodes:
            tag = tags.get(node.name)
            if tag is not None and node.op != "output":
                node.meta[TAG] = f"{self.backend_id}_{tag}"
        for node in nodes:  # a getitem of an untagged producer (a delegate's output) is not taken
            if node.op == "call_function" and node.target is operator.getitem and TAG in node.meta:
                if node.args[0].meta.get(TAG) != node.meta[TAG]:
                    del node.meta[TAG]
        computing = {n.meta[TAG] for n in nodes if n.op == "call_function" and n.meta.get(TAG)
                     and n.target is not operator.getitem}
        for node in nodes:
            if node.meta.get(TAG) is not None and node.meta[TAG] not in computing:
                del node.meta[TAG]
        specs = {}
        for tag, spec in result.partition_tags.items():
            name = f"{self.backend_id}_{tag}"
            if name in computing:
                specs[name] = DelegationSpec(spec.backend_id, tuple(CompileSpec(c.key, bytes(c.value))
                                                                     for c in spec.compile_specs))
        return PartitionResult(exported_program, specs)


def anonymous_call_graph(program: ExportedProgram) -> ExportedProgram:
    """A copy of ``program`` whose module call signature names no nodes (ExecuTorch's
    ``create_exported_program_from_submodule`` makes them so)."""
    program = copy_program(program)
    entries = []
    for entry in program.module_call_graph:
        sig = entry.signature
        if sig is not None:
            sig = ModuleCallSignature(inputs=[], outputs=[], in_spec=sig.in_spec, out_spec=sig.out_spec)
        entries.append(ModuleCallEntry(fqn=entry.fqn, signature=sig))
    program._module_call_graph = entries
    return program


def et_edge_program(program: ExportedProgram) -> ExportedProgram:
    """The partition as ExecuTorch's edge program (``to_edge`` with its IR checks off), the
    ops stage 1 kept whole for the partitioner (``meta[KEPT]``) preserved, as
    ``to_edge_transform_and_lower`` preserves them."""
    from executorch.exir import EdgeCompileConfig, to_edge

    kept = list(dict.fromkeys(n.target for n in program.graph.nodes if n.op == "call_function" and n.meta.get(KEPT)))
    config = EdgeCompileConfig(_check_ir_validity=False, preserve_ops=kept)
    edge = to_edge(anonymous_call_graph(program), compile_config=config).exported_program()
    return with_input_names(edge, program)


def with_input_names(edge: ExportedProgram, program: ExportedProgram) -> ExportedProgram:
    """``edge`` with its user inputs named as in ``program``, in place: the retrace of an
    anonymous signature names them ``arg_0``, ..., and Core ML writes the names into the model.

    Before:: %arg_0 : placeholder     After:: %x : placeholder
    """
    names = dict(zip(edge.graph_signature.user_inputs, program.graph_signature.user_inputs))
    taken = {n.name for n in edge.graph.nodes} - set(names)
    if any(new in taken for new in names.values()):
        return edge  # (an input named like another node: left as the retrace named it)
    for node in edge.graph.nodes:
        if node.op == "placeholder" and node.name in names:
            node.name = node.target = names[node.name]
    for spec in edge.graph_signature.input_specs:
        if getattr(spec.arg, "name", None) in names:
            spec.arg.name = names[spec.arg.name]
    edge.graph_module.recompile()
    return edge


def et_compile_specs(compile_specs) -> list:
    from executorch.exir.backend.compile_spec_schema import CompileSpec as EtCompileSpec

    return [EtCompileSpec(s.key, bytes(s.value)) for s in compile_specs]


def et_preprocess(et_backend, program: ExportedProgram, compile_specs) -> PreprocessResult:
    """``et_backend.preprocess`` on the partition ``program``, as lowerflow's PreprocessResult."""
    with quiet():
        result = et_backend.preprocess(et_edge_program(program), et_compile_specs(compile_specs))
    return PreprocessResult(bytes(result.processed_bytes), named_data=named_data_of(result.data_store_output))


def named_data_of(store) -> dict[str, bytes]:
    """ExecuTorch's ``NamedDataStoreOutput`` as ``{key: bytes}`` (what the ``.pte`` stores inline)."""
    if store is None:
        return {}
    if store.external_data:
        raise BackendError(f"the backend put named data in external files {sorted(store.external_data)} "
                           "(.ptd); lowerflow writes named data into the .pte only")
    named = {}
    for key, entry in store.pte_data.items():
        if SEGMENT_ALIGNMENT % max(1, entry.alignment):
            raise BackendError(f"named data {key!r} wants alignment {entry.alignment}, which does not divide "
                               f"lowerflow's segment alignment {SEGMENT_ALIGNMENT}")
        named[key] = bytes(store.buffers[entry.buffer_index])
    return named
