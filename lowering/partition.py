"""Stage 2 — partition: tag the nodes a backend will take.

A :class:`Partitioner` returns a :class:`PartitionResult`: the program with
``node.meta["delegation_tag"]`` set on the nodes of each partition, and a
:class:`DelegationSpec` per tag saying which backend lowers it.  A partitioner
only tags; :func:`check_partition_result` verifies that it changed nothing
else and that no tag lands on a node that cannot be delegated.

Before (an MLP, nothing tagged)::

    %p_fc1_weight : placeholder   %x : placeholder
    %permute_copy = aten.permute_copy(%p_fc1_weight, [1, 0])
    %addmm        = aten.addmm(%p_fc1_bias, %x, %permute_copy)
    %relu         = aten.relu(%addmm)
    return (%relu,)

After ``OpSupportPartitioner("ReferenceBackend", {addmm, permute_copy})`` and
``tag_constant_data``::

    %p_fc1_weight {tag: ReferenceBackend_0}   %x {no tag: user input}
    %permute_copy {tag: ReferenceBackend_0}
    %addmm        {tag: ReferenceBackend_0}
    %relu         {no tag}
"""

from __future__ import annotations

import abc
import dataclasses
import operator
from collections import defaultdict
from typing import Callable, Iterable, Mapping

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from .control_flow_graph import is_control_flow
from .delegation import (  # re-exported here
    SHARED_STATE,
    SHARED_WITH_TOP_LEVEL,
    TAG,
    CompileSpec,
    DelegationSpec,
    find_backend,
    with_external_weights,
)
from .errors import PartitionError
from .partition_proposal import propose_partitions

#: A constant node marked ``node.meta[NO_COPY] = True`` is never duplicated.
NO_COPY = "no_copy"


@dataclasses.dataclass
class PartitionResult:
    tagged_exported_program: ExportedProgram
    partition_tags: dict[str, DelegationSpec]


class Partitioner(abc.ABC):
    """Tags the nodes of ``exported_program`` that a backend should take.

    It may only set ``node.meta["delegation_tag"]`` (and ``no_copy``); any other
    change to the graph is rejected by :func:`check_partition_result`.  The
    graph changes a backend wants are declared in ``fused_ops``
    (:class:`lowering.backend_ops.FusedOp`), applied by :func:`partition` first.
    """

    #: The backend's fused ops, applied before :meth:`partition` runs.
    fused_ops: tuple = ()
    #: Stage 1 folds a parameter's view copies into constants (``permute_copy(W)`` -> ``W.T``) for it;
    #: False: the backend sees them as ops (ExecuTorch's own backends, which expect ExecuTorch's graph).
    fold_constants: bool = True

    @abc.abstractmethod
    def partition(self, exported_program: ExportedProgram) -> PartitionResult: ...

    def ops_to_not_decompose(self, exported_program: ExportedProgram) -> tuple[list, Callable | None]:
        """ATen ops the backend wants whole, asked on the program before decomposition, and an
        optional per-node check (ExecuTorch's form): stage 1 leaves them whole, stage 2 decomposes
        those no partition took (:mod:`lowering.export.kept`).  None by default."""
        return [], None

    def quantizer(self, recipe) -> object | None:
        """The backend's own PT2E quantizer for ``recipe`` (a :class:`~lowering.quantize.QuantRecipe`),
        applied to the model before decomposition (:func:`lowering.quantize.quantize_module`); None,
        the default: lowerflow's recipe applies."""
        return None

    def __call__(self, exported_program: ExportedProgram) -> PartitionResult:
        return self.partition(exported_program)


class ChainPartitioner(Partitioner):
    """An ordered chain of partitioners (ExecuTorch's list of partitioners): the first
    takes what it can, each next one what the ones before it left, the rest runs on
    portable kernels.  It is lowered step by step (:func:`lowering.to_backend.to_backend`
    delegates with each in turn), so it never partitions in one pass itself.

    Before:: conv ─ relu ─ gelu ─ linear    After ``[vulkan, xnnpack]`` (vulkan lacks gelu)::
             call_delegate[VulkanBackend](conv, relu) ─ call_delegate[XnnpackBackend](gelu, linear)
    """

    def __init__(self, partitioners, names=None) -> None:
        self.partitioners = tuple(partitioners)
        if not self.partitioners or not all(isinstance(p, Partitioner) for p in self.partitioners):
            raise PartitionError("ChainPartitioner: expected a non-empty list of lowering.Partitioner")
        self.names = tuple(names) if names is not None else tuple(type(p).__name__ for p in self.partitioners)

    def ops_to_not_decompose(self, exported_program: ExportedProgram) -> tuple[list, Callable | None]:
        """Every step's ops, each node kept when a step that keeps its op would."""
        answers = [p.ops_to_not_decompose(exported_program) for p in self.partitioners]
        ops = list(dict.fromkeys(op for step_ops, _ in answers for op in step_ops))
        if all(check is None for _, check in answers):
            return ops, None

        def check(node: torch.fx.Node) -> bool:
            return any(node.target in step_ops and (c is None or c(node)) for step_ops, c in answers)

        return ops, check

    def quantizer(self, recipe) -> object | None:
        """The first step's backend quantizer (the backend the chain prefers)."""
        return self.partitioners[0].quantizer(recipe)

    @property
    def fold_constants(self) -> bool:
        """Folded unless no step wants it."""
        return any(p.fold_constants for p in self.partitioners)

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        raise PartitionError("a ChainPartitioner is lowered step by step: call to_backend (or lower) with it, "
                             "which delegates with each of its partitioners in turn")


class ExternalWeightsPartitioner(Partitioner):
    """Another partitioner's partitions, each asking its backend for external weights
    (:data:`lowering.delegation.EXTERNAL_WEIGHTS_SPEC` added to its compile specs)."""

    def __init__(self, inner: Partitioner) -> None:
        self.inner = inner
        self.fused_ops = tuple(getattr(inner, "fused_ops", ()))

    def ops_to_not_decompose(self, exported_program: ExportedProgram) -> tuple[list, Callable | None]:
        return self.inner.ops_to_not_decompose(exported_program)

    def quantizer(self, recipe) -> object | None:
        return self.inner.quantizer(recipe)

    @property
    def fold_constants(self) -> bool:
        return self.inner.fold_constants

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        result = self.inner.partition(exported_program)
        tags = {tag: with_external_weights(spec) for tag, spec in result.partition_tags.items()}
        return PartitionResult(result.tagged_exported_program, tags)

    def __getattr__(self, name: str):
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)  # the inner partitioner's options and reasons


def external_weights_partitioner(partitioner: "Partitioner | None", on: bool) -> "Partitioner | None":
    """``partitioner`` whose backends store weights externally when ``on`` (itself otherwise)."""
    if not on or partitioner is None or isinstance(partitioner, ExternalWeightsPartitioner):
        return partitioner
    return ExternalWeightsPartitioner(partitioner)


class OpSupportPartitioner(Partitioner):
    """Partitions by operator support: torch.fx's ``CapabilityBasedPartitioner``'s partitions
    (found by :func:`lowering.partition_proposal.propose_partitions`, in near-linear time).

    ``supported`` is a collection of ``OpOverload``/``OpOverloadPacket`` or a
    predicate on nodes.  Each maximal cycle-free group of supported nodes
    becomes one partition tagged ``f"{tag_prefix}{i}"``; constants used only by
    one partition (and mutated buffers, if ``take_mutated_buffers``) are tagged
    with it; constants shared by partitions are duplicated into each if
    ``duplicate_shared_constants``, else passed to them from the top level.
    """

    def __init__(
        self,
        backend_id: str,
        supported: Iterable[object] | Callable[[torch.fx.Node], bool],
        *,
        compile_specs: Iterable[CompileSpec] = (),
        tag_prefix: str | None = None,
        take_constants: bool = True,
        take_mutated_buffers: bool = True,
        duplicate_shared_constants: bool = False,
        allows_single_node_partition: bool = True,
    ) -> None:
        self.delegation_spec = DelegationSpec(backend_id, tuple(compile_specs))
        self.tag_prefix = tag_prefix if tag_prefix is not None else f"{backend_id}_"
        self.take_constants = take_constants
        self.take_mutated_buffers = take_mutated_buffers
        self.duplicate_shared_constants = duplicate_shared_constants
        self.allows_single_node_partition = allows_single_node_partition
        if callable(supported):
            self._is_supported = supported
        else:
            ops = set(supported)
            self._is_supported = lambda n: n.target in ops or getattr(
                n.target, "overloadpacket", None
            ) in ops

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        gm = exported_program.graph_module
        partitions = self.propose(gm, lambda node: node.op == "call_function" and self._is_supported(node))
        # Number partitions by their first node in graph order: deterministic.
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        partitions.sort(key=lambda p: min(order[n] for n in p.nodes))
        tags: dict[str, DelegationSpec] = {}
        for i, part in enumerate(partitions):
            tag = f"{self.tag_prefix}{i}"
            tags[tag] = self.delegation_spec
            for node in part.nodes:
                node.meta[TAG] = tag
        if self.take_constants:
            tag_constant_data(exported_program, duplicate_shared=self.duplicate_shared_constants)
        if self.take_mutated_buffers:
            tag_mutated_buffer(exported_program)
        return PartitionResult(exported_program, tags)

    def propose(self, graph_module: torch.fx.GraphModule, is_supported: Callable[[torch.fx.Node], bool]) -> list:
        """torch.fx's capability-based partitions of the supported nodes
        (:func:`lowering.partition_proposal.propose_partitions`)."""
        return propose_partitions(graph_module, is_supported,
                                  allows_single_node_partition=self.allows_single_node_partition)


def tag_constant_data(
    exported_program: ExportedProgram, *, duplicate_shared: bool = False
) -> list[torch.fx.Node]:
    """Tag each parameter, buffer and lifted constant used only by one partition.

    A constant used by several partitions (and nothing else) stays in the
    top-level program and is passed to each delegate as an input, stored once.
    With ``duplicate_shared=True`` it is tagged with the first of them (sorted)
    instead, and ``to_backend`` gives every other partition its own copy (see
    :func:`duplicate_shared_constants`) unless it is marked ``no_copy``: each
    delegate then owns its data, at the price of one copy per partition.
    Without ``duplicate_shared`` a constant with an untagged user stays
    top-level; with it, it is tagged too and the partitions get copies while
    the original stays top-level for its untagged users (a tied embedding /
    lm_head weight: XNNPACK runs a fully-connected layer with a static weight
    ~5x faster than with a weight passed as an input; the .pte stores equal
    bytes once, see :mod:`lowering.pte.format`).  Mutated buffers are left
    to :func:`tag_mutated_buffer`.  Returns the nodes tagged.
    """
    sig = exported_program.graph_signature
    mutated = set(sig.buffers_to_mutate.values())
    tagged = []
    for node in exported_program.graph.nodes:
        if node.op != "placeholder" or not node.users:
            continue
        spec = _input_spec(exported_program, node)
        if spec.kind not in _CONSTANT_KINDS or spec.target in mutated or node.meta.get(SHARED_STATE):
            continue
        user_tags = {u.meta.get(TAG) for u in node.users}
        if not duplicate_shared and (None in user_tags or len(user_tags) > 1):
            continue
        if user_tags == {None} or node.meta.get(NO_COPY) and len(user_tags) > 1:
            continue
        node.meta[TAG] = sorted(t for t in user_tags if t is not None)[0]
        tagged.append(node)
    return tagged


def tag_mutated_buffer(exported_program: ExportedProgram) -> list[torch.fx.Node]:
    """Tag a mutated buffer with the partition that computes its new value,
    when every user of the buffer is in that same partition.

    Before::  %b_acc (BUFFER, mutated)      %add = aten.add(%b_acc, %sum) {tag: T}
              return (%add  [BUFFER_MUTATION acc], ...)
    After::   %b_acc {tag: T}  — the mutation moves inside the delegate.
    """
    sig = exported_program.graph_signature
    producer = {}
    output_node = exported_program.graph.output_node()
    for spec, arg in zip(sig.output_specs, output_node.args[0]):
        if spec.kind == OutputKind.BUFFER_MUTATION:
            producer[spec.target] = arg
    tagged = []
    for node in exported_program.graph.nodes:
        if node.op != "placeholder":
            continue
        spec = _input_spec(exported_program, node)
        if spec.kind != InputKind.BUFFER or spec.target not in producer:
            continue
        tag = producer[spec.target].meta.get(TAG)
        if tag is not None and all(u.meta.get(TAG) == tag for u in node.users):
            node.meta[TAG] = tag
            tagged.append(node)
    return tagged


_CONSTANT_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


def _input_spec(exported_program: ExportedProgram, placeholder: torch.fx.Node):
    for spec in exported_program.graph_signature.input_specs:
        if getattr(spec.arg, "name", None) == placeholder.name:
            return spec
    raise PartitionError(f"placeholder {placeholder.name!r} has no input spec")


# ---------------------------------------------------------------------------
# Checks the framework runs on every PartitionResult.
# ---------------------------------------------------------------------------


def graph_fingerprint(graph: torch.fx.Graph) -> list[tuple]:
    """Everything about a graph a partitioner must not change: nodes, ops, targets, edges."""
    return [
        (n.name, n.op, _target_name(n.target), _arg_names(n.args), _arg_names(n.kwargs))
        for n in graph.nodes
    ]


def check_partition_result(
    result: PartitionResult,
    before: list[tuple],
    partitioner: object,
) -> None:
    """Reject a partitioner that changed the graph or tagged what cannot be delegated."""
    name = type(partitioner).__name__
    if not isinstance(result, PartitionResult):
        raise PartitionError(
            f"partitioner {name}: partition() must return a PartitionResult, "
            f"got {type(result).__name__}"
        )
    ep = result.tagged_exported_program
    after = graph_fingerprint(ep.graph)
    if after != before:
        raise PartitionError(
            f"partitioner {name} changed the graph ({_first_difference(before, after)}); "
            f"a partitioner may only set node.meta[{TAG!r}]"
        )
    for tag, spec in result.partition_tags.items():
        if not isinstance(spec, DelegationSpec):
            raise PartitionError(
                f"partitioner {name}: tag {tag!r} maps to {type(spec).__name__}, "
                "expected a DelegationSpec"
            )
    user_inputs = set(ep.graph_signature.user_inputs)
    for node in ep.graph.nodes:
        tag = node.meta.get(TAG)
        if tag is None:
            continue
        if node.op == "output":
            raise PartitionError(
                f"partitioner {name} tagged the output node with {tag!r}; "
                "outputs cannot be delegated, tag the nodes that compute them"
            )
        if is_control_flow(node):
            raise PartitionError(
                f"partitioner {name} tagged {node.target.__name__} node {node.name!r} with {tag!r}; "
                "a cond / map is not delegated as a whole: the partitions inside its branches "
                "or body are found and lowered separately"
            )
        if node.op == "placeholder" and node.name in user_inputs:
            raise PartitionError(
                f"partitioner {name} tagged user input {node.name!r} with {tag!r}; "
                "user inputs are passed to a delegate, never consumed by it"
            )
        if tag not in result.partition_tags:
            raise PartitionError(
                f"partitioner {name} tagged node {node.name!r} with {tag!r}, "
                "which is not in partition_tags"
            )


def _target_name(target: object) -> str:
    return target if isinstance(target, str) else getattr(target, "__name__", repr(target))


def _arg_names(args: object) -> object:
    return torch.fx.node.map_arg(args, lambda n: ("%", n.name))


def _first_difference(before: list[tuple], after: list[tuple]) -> str:
    for b, a in zip(before, after):
        if b != a:
            return f"node {b[0]!r} became {a[0]!r} {a[1]} {a[2]}"
    if len(after) > len(before):
        return f"node {after[len(before)][0]!r} was added"
    return f"node {before[len(after)][0]!r} was removed"


def partition(exported_program: ExportedProgram, partitioner: Partitioner) -> PartitionResult:
    """Stage 2: run ``partitioner`` on a copy of the program, check and normalise its tags.

    The partitioner's fused ops (:mod:`lowering.backend_ops`) replace their
    patterns first, so it tags the fused calls.  The input program is not
    modified.  The result's program has every getitem
    tagged like its producer and every constant shared by several partitions
    duplicated (:func:`duplicate_shared_constants`); every backend id is known.  A node
    stage 1 kept whole for a partitioner (:mod:`lowering.export.kept`) that no partition took
    is decomposed.
    """
    from .export.decompose import decompose_kept
    from .program import copy_program

    if not isinstance(partitioner, Partitioner):
        raise PartitionError(f"expected a lowering.Partitioner, got {type(partitioner).__name__}")
    program = copy_program(exported_program)
    for node in program.graph.nodes:  # tags of an earlier partitioning (a chain's previous step) are spent
        node.meta.pop(TAG, None)
    program = apply_backend_fused_ops(program, partitioner)
    before = graph_fingerprint(program.graph)
    result = partitioner.partition(program)
    check_partition_result(result, before, partitioner)
    program = result.tagged_exported_program
    for spec in result.partition_tags.values():
        find_backend(spec.backend_id)  # unknown ids fail before any rewriting
    tag_getitems_with_producer(program.graph)
    duplicate_shared_constants(program)
    decompose_kept(program, lambda node: node.meta.get(TAG) is not None)  # what stage 1 kept and no partition took
    return PartitionResult(program, dict(sorted(result.partition_tags.items())))


def apply_backend_fused_ops(program: ExportedProgram, partitioner: Partitioner) -> ExportedProgram:
    """Replace the patterns of ``partitioner.fused_ops`` (if it has any) by the fused ops.

    Before::  %addmm = aten.addmm(%b, %x, %w)   %relu = aten.relu(%addmm)
    After::   %addmm_relu = lowerflow_reference.addmm_relu(%b, %x, %w)
    """
    from .backend_ops import apply_fused_ops, fused_ops_of

    fused = fused_ops_of(partitioner)
    return apply_fused_ops(program, fused) if fused else program


def partition_tags_of(graph: torch.fx.Graph) -> dict[str, str]:
    """node name -> tag, for every tagged node: how a tagged program is stored."""
    return {n.name: n.meta[TAG] for n in graph.nodes if n.meta.get(TAG) is not None}


def apply_partition_tags(graph: torch.fx.Graph, tags: Mapping[str, str]) -> None:
    """Set the tags recorded by :func:`partition_tags_of` on a (reloaded) graph."""
    nodes = {n.name: n for n in graph.nodes}
    missing = sorted(set(tags) - set(nodes))
    if missing:
        raise PartitionError(f"tagged nodes {missing[:5]} are not in the program")
    for name, tag in tags.items():
        nodes[name].meta[TAG] = tag


# ---------------------------------------------------------------------------
# Normalisations the framework applies after the checks.
# ---------------------------------------------------------------------------


def tag_getitems_with_producer(graph: torch.fx.Graph) -> None:
    """A ``getitem`` always follows the node it unpacks into (or out of) a partition.

    Before:: %max_pool {tag: T}   %getitem = getitem(%max_pool, 0) {no tag}
    After::  %max_pool {tag: T}   %getitem {tag: T}
    """
    for node in graph.nodes:
        if node.op == "call_function" and node.target is operator.getitem:
            src = node.args[0]
            tag = src.meta.get(TAG) if isinstance(src, torch.fx.Node) else None
            if tag is None:
                node.meta.pop(TAG, None)
            else:
                node.meta[TAG] = tag


def duplicate_shared_constants(exported_program: ExportedProgram) -> list[torch.fx.Node]:
    """Give each partition its own copy of a tagged constant other partitions use too.

    Before::  %p_w {tag: A}      %mm_a = mm(%x, %p_w) {tag: A}    %mm_b = mm(%y, %p_w) {tag: B}
    After::   %p_w {tag: A}      %mm_a = mm(%x, %p_w) {tag: A}
              %p_w_dup_B {tag: B}   %mm_b = mm(%y, %p_w_dup_B) {tag: B}

    The copy shares the tensor (no extra memory at lowering time) under a new
    state-dict name; it gets its own input spec right after the original's.
    Users outside any partition keep the original, which then stays top-level
    (untagged); its own partition gets a copy too.
    A node marked ``node.meta["no_copy"] = True`` raises instead.  Returns the copies.
    """
    sig = exported_program.graph_signature
    copies = []
    for node in list(exported_program.graph.nodes):
        if node.op != "placeholder" or node.meta.get(TAG) is None:
            continue
        own = node.meta[TAG]
        by_tag: dict[str, list[torch.fx.Node]] = defaultdict(list)
        for user in node.users:
            other = user.meta.get(TAG)
            if other is not None and other != own:
                by_tag[other].append(user)
        shared_with_top_level = any(u.meta.get(TAG) is None for u in node.users)
        if not by_tag and not shared_with_top_level:
            continue
        if node.meta.get(NO_COPY):
            raise PartitionError(
                f"constant {node.name!r} is used by partitions {sorted([own, *by_tag])}"
                f"{' and the top-level program' if shared_with_top_level else ''} "
                f"but is marked {NO_COPY!r}; tag its users into one partition or "
                "leave it untagged so it stays in the top-level program"
            )
        if shared_with_top_level:
            # Shared with the top-level program too: the original stays there
            # for its untagged users; every partition, its own included, gets a copy.
            node.meta.pop(TAG)
            by_tag[own] = [u for u in node.users if u.meta.get(TAG) == own]
        index = next(i for i, s in enumerate(sig.input_specs) if s.arg.name == node.name)
        spec = sig.input_specs[index]
        anchor = node
        for offset, tag in enumerate(sorted(by_tag), start=1):
            anchor = _copy_placeholder(
                exported_program, node, anchor, spec, index + offset, tag, by_tag[tag]
            )
            if shared_with_top_level:
                anchor.meta[SHARED_WITH_TOP_LEVEL] = True
            copies.append(anchor)
    return copies


def _copy_placeholder(ep, node, anchor, spec, spec_index, tag, users):
    """Insert a copy of placeholder ``node`` after ``anchor`` for the ``users`` tagged ``tag``."""
    graph = ep.graph
    target = f"{spec.target}_dup_{_safe(tag)}"
    name = f"{node.name}_dup_{_safe(tag)}"
    with graph.inserting_after(anchor):
        dup = graph.placeholder(name)
    dup.meta = dict(node.meta)
    dup.meta[TAG] = tag
    for user in users:
        user.replace_input_with(node, dup)
    table = ep.constants if spec.kind == InputKind.CONSTANT_TENSOR or (
        spec.kind == InputKind.BUFFER and not spec.persistent
    ) else ep.state_dict
    table[target] = table[spec.target]
    new_spec = dataclasses.replace(spec, arg=type(spec.arg)(name=dup.name), target=target)
    ep.graph_signature.input_specs.insert(spec_index, new_spec)
    return dup


def _safe(tag: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in tag)
