"""Graph edits the quantize passes share, on an edge-form ExportedProgram.

- :func:`constant_value` / :func:`add_constant`: read a lifted weight, lift a new one;
- :func:`unfold_linear_weights`: put the transpose of a linear's weight back in the graph;
- :func:`call`: a new ``call_function`` node with its ``meta["val"]`` computed on fake tensors;
- :func:`kept_fp32`: whether a node belongs to a module the recipe keeps fp32.

Unfolding (``lowering.export`` folds ``permute_copy(W)`` into a constant ``[K, N]``)::

    before:  %c__folded_permute = placeholder            # CONSTANT_TENSOR [K, N]
             %addmm = aten.addmm.default(%b, %x, %c__folded_permute)
    after:   %c__q_weight_addmm = placeholder            # CONSTANT_TENSOR [N, K]
             %permute_copy = aten.permute_copy.default(%c__q_weight_addmm, [1, 0])
             %addmm = aten.addmm.default(%b, %x, %permute_copy)
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, InputSpec, TensorArgument

#: Lifted inputs whose value is fixed when the program is built.
CONSTANT_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)

#: The edge form's linear layers: ``addmm(bias, x, W^T)`` and ``mm(x, W^T)``.
GEMMS = (torch.ops.aten.addmm.default, torch.ops.aten.mm.default)


def copy_program(program: ExportedProgram) -> ExportedProgram:
    """A copy of ``program`` that the passes may edit: new graph (node meta dicts copied,
    values shared), new signature lists and weight tables; the weight tensors themselves
    are shared, never copied (the passes only add and drop entries), so a large model
    does not need twice its memory."""
    from torch.export.graph_signature import ExportGraphSignature

    graph = torch.fx.Graph()
    val_map: dict[torch.fx.Node, torch.fx.Node] = {}
    graph.output(graph.graph_copy(program.graph, val_map))
    graph.output_node().meta = dict(program.graph.output_node().meta)
    for old, new in val_map.items():
        if new.name != old.name:  # graph_copy renames a name that shadows a builtin
            new.name = old.name
            if old.op == "placeholder":
                new.target = old.target
            graph._graph_namespace._rename_object(new, old.name)
    signature = program.graph_signature
    copied = ExportedProgram(
        root=program.graph_module,
        graph=graph,
        graph_signature=ExportGraphSignature(list(signature.input_specs), list(signature.output_specs)),
        state_dict=dict(program.state_dict),
        range_constraints=dict(program.range_constraints),
        module_call_graph=list(program.module_call_graph),
        example_inputs=program.example_inputs,
        constants=dict(program.constants),
        verifiers=list(program.verifiers),
    )
    copied.graph_module.meta.update(program.graph_module.meta)
    return copied


def spec_of(program: ExportedProgram) -> dict[torch.fx.Node, InputSpec]:
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
    return dict(zip(placeholders, program.graph_signature.input_specs))


def constant_value(program: ExportedProgram, node: torch.fx.Node) -> torch.Tensor | None:
    """The tensor behind a lifted parameter / buffer / constant placeholder (None otherwise).

    A mutated buffer is not constant: None.
    """
    if node.op != "placeholder":
        return None
    spec = spec_of(program).get(node)
    if spec is None or spec.kind not in CONSTANT_KINDS:
        return None
    if spec.kind == InputKind.BUFFER and spec.target in program.graph_signature.buffers_to_mutate.values():
        return None
    table = program.constants if spec.target in program.constants else program.state_dict
    value = table.get(spec.target)
    return value.detach() if isinstance(value, torch.Tensor) else None


def fake_mode_of(program: ExportedProgram):
    """The fake mode of the program's placeholder values: the first fake one's (an exported
    program has one mode; torch's ``detect_fake_mode`` would check every placeholder, at every
    constant a pass adds)."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensor

    for node in program.graph.find_nodes(op="placeholder"):
        if isinstance(node.meta.get("val"), FakeTensor):
            return detect_fake_mode([node.meta["val"]])
    return detect_fake_mode([])


#: ``graph_module.meta`` key: how the pass computed each constant it lifted from a weight,
#: ``{target: {"recipe": [kind, source target, *params], "source": digest, "value": digest}}``
#: (:func:`derived_value`; the digests, :func:`value_digest`, of the source and of the constant as
#: computed), so that a retrain's weights are quantized without the graph pass (:mod:`lowering.rebind`).
DERIVED_META = "derived_constants"


def add_constant(program: ExportedProgram, name: str, value: torch.Tensor, meta_from: torch.fx.Node | None = None,
                 derived: tuple[list, torch.Tensor] | None = None, *, view: bool = False) -> torch.fx.Node:
    """Lift ``value`` as a new CONSTANT_TENSOR placeholder ``c_<name>`` (placed before the
    first user input, as export orders them); returns the placeholder.  The constant is a
    contiguous copy of ``value``, or with ``view`` ``value`` itself (sharing its memory: for
    a constant the caller replaces or makes contiguous before the program is used).
    ``derived``: how ``value`` was computed from a weight, ``(recipe, the weight's value or
    its value_digest)`` (recorded under :data:`DERIVED_META`)."""
    graph = program.graph
    specs = program.graph_signature.input_specs
    taken = {s.target for s in specs} | set(program.state_dict) | set(program.constants)
    target = _fresh(name, taken)
    node_name = _fresh(f"c_{target}", {n.name for n in graph.nodes})
    placeholders = list(graph.find_nodes(op="placeholder"))
    index = next((i for i, s in enumerate(specs) if s.kind == InputKind.USER_INPUT), len(placeholders))
    where = graph.inserting_before(placeholders[index]) if index < len(placeholders) else \
        graph.inserting_after(placeholders[-1])
    with where:
        node = graph.placeholder(node_name)
    if meta_from is not None:
        node.meta.update({k: v for k, v in meta_from.meta.items() if k in ("nn_module_stack", "stack_trace")})
    value = value.detach() if view else value.detach().contiguous().clone()
    mode = fake_mode_of(program)
    node.meta["val"] = mode.from_tensor(value, static_shapes=True) if mode is not None else value
    specs.insert(index, InputSpec(InputKind.CONSTANT_TENSOR, TensorArgument(node.name), target))
    program.constants[target] = value
    if derived is not None:
        recipe, source = derived
        entry = {"recipe": recipe, "source": source if isinstance(source, str) else value_digest(source),
                 "value": value_digest(value)}
        program.graph_module.meta[DERIVED_META] = {**program.graph_module.meta.get(DERIVED_META, {}), target: entry}
    return node


def value_digest(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and bytes (row-major)."""
    import hashlib

    from ..serialize import tensor_memory

    data = tensor.detach().contiguous()
    digest = hashlib.sha256(f"{data.dtype}{list(tensor.shape)}".encode())
    digest.update(tensor_memory(data))  # the tensor's memory, not a copy of it
    return digest.hexdigest()


def target_of(program: ExportedProgram, node: torch.fx.Node) -> str | None:
    """The target (FQN or constant name) of a placeholder of ``program``."""
    spec = spec_of(program).get(node)
    return None if spec is None else spec.target


def derived_value(recipe: list, source: torch.Tensor, memo: dict | None = None) -> torch.Tensor:
    """The constant a :data:`DERIVED_META` recipe computes from its source's value:
    ``["t", src]`` its transpose; ``["q", src, block, qmin, qmax, i]`` output ``i`` (qdata,
    scale, zero point) of :func:`~lowering.quantize.weights.quantize_weight` (``memo``: the
    three outputs of one weight computed once)."""
    from .weights import WeightScheme, quantize_weight

    kind = recipe[0]
    if kind == "t":
        return source.t().detach().clone(memory_format=torch.contiguous_format)  # one copy, row-major
    if kind == "q":
        block, qmin, qmax, index = recipe[2:]
        memo = {} if memo is None else memo
        key = ("q", recipe[1], int(block), int(qmin), int(qmax))
        if key not in memo:
            memo[key] = quantize_weight(source, WeightScheme(int(block), int(qmin), int(qmax)))
        return memo[key][int(index)].detach().contiguous()
    raise ValueError(f"unknown derived constant recipe {kind!r}")


def call(graph: torch.fx.Graph, target: Any, args: tuple, meta_from: torch.fx.Node | None = None) -> torch.fx.Node:
    """A ``call_function`` node of ``target(*args)`` (inserted at the graph's current
    insertion point) whose ``meta["val"]`` is computed from its inputs' fake values."""
    node = graph.call_function(target, args)
    if meta_from is not None:
        node.meta.update({k: v for k, v in meta_from.meta.items() if k in ("nn_module_stack", "stack_trace", "source_fn_stack")})
    fakes = torch.fx.node.map_arg(args, lambda n: n.meta["val"])
    mode = _mode_of(fakes)
    if mode is None:
        node.meta["val"] = target(*fakes)
    else:
        with mode:
            node.meta["val"] = target(*fakes)
    return node


def _mode_of(fakes: Any):
    from torch._guards import detect_fake_mode
    from torch.utils import _pytree as pytree

    return detect_fake_mode([x for x in pytree.tree_leaves(fakes) if isinstance(x, torch.Tensor)])


def gemm_weight(node: torch.fx.Node) -> torch.fx.Node:
    """The ``[K, N]`` operand of an edge-form linear (``addmm`` arg 2, ``mm`` arg 1)."""
    return node.args[2] if node.target is torch.ops.aten.addmm.default else node.args[1]


def unfold_linear_weights(program: ExportedProgram, views: bool = False) -> list[torch.fx.Node]:
    """Give every linear whose weight is a constant the form ``permute_copy(W[N, K])``.

    A weight already reached through ``permute_copy(<constant [N, K]>, [1, 0])`` stays;
    a folded constant ``[K, N]`` is replaced by a new constant ``W = folded.T`` and a
    ``permute_copy`` node.  Returns the gemm nodes whose weight is now
    ``permute_copy(constant)``, in graph order.  The caller recompiles.  ``views``: each new
    ``W`` is a view of its folded constant, no copy (:func:`add_constant`'s ``view``): the
    caller replaces it, or :func:`contiguous_constants` copies what is left.
    """
    graph = program.graph
    done = []
    natural_of: dict[torch.fx.Node, torch.fx.Node] = {}  # a folded weight shared by several linears
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in GEMMS:
            continue
        weight = gemm_weight(node)
        if not isinstance(weight, torch.fx.Node):
            continue
        if weight.target is torch.ops.aten.permute_copy.default and list(weight.args[1]) == [1, 0] and (
            constant_value(program, weight.args[0]) is not None and len(weight.users) == 1
        ):
            done.append(node)
            continue
        value = constant_value(program, weight)
        if value is None or value.dim() != 2 or not value.is_floating_point():
            continue
        natural = natural_of.get(weight)
        if natural is None:
            natural = natural_of[weight] = add_constant(program, f"_weight_{node.name}", value.t(), meta_from=node,
                                                        derived=(["t", target_of(program, weight)], value),
                                                        view=views)
        with graph.inserting_before(node):
            permute = call(graph, torch.ops.aten.permute_copy.default, (natural, [1, 0]), meta_from=node)
        node.replace_input_with(weight, permute)
        done.append(node)
    remove_unused(program)
    return done


def contiguous_constants(program: ExportedProgram) -> None:
    """Replace every lifted constant that is a non-contiguous view (:func:`add_constant`'s
    ``view``) with a contiguous copy, as every other pass leaves constants."""
    for name, value in list(program.constants.items()):
        if isinstance(value, torch.Tensor) and not value.is_contiguous():
            program.constants[name] = value.contiguous()


def remove_unused(program: ExportedProgram) -> None:
    """Drop lifted constants nothing reads any more (and their tensors)."""
    from ..export.cleanups import remove_unused_constants

    remove_unused_constants(program)


def module_path(node: torch.fx.Node) -> Iterator[tuple[str, str]]:
    """``(fqn, class name)`` of each module ``node`` was traced in, outermost first."""
    for fqn, cls in (node.meta.get("nn_module_stack") or {}).values():
        name = cls if isinstance(cls, str) else getattr(cls, "__name__", str(cls))
        yield fqn, name.rsplit(".", 1)[-1]


def kept_fp32(node: torch.fx.Node, keep_fp32: tuple[str, ...]) -> bool:
    """Whether ``node`` lies in a module named (fqn prefix at a dot boundary) or typed
    (class name) in ``keep_fp32``."""
    if not keep_fp32:
        return False
    for fqn, cls in module_path(node):
        fqn = _plain_fqn(fqn)
        for entry in keep_fp32:
            if cls == entry or fqn == entry or fqn.startswith(entry + "."):
                return True
    return False


def unmatched_keep_fp32(graph: torch.fx.Graph, keep_fp32: tuple[str, ...]) -> list[str]:
    """The ``keep_fp32`` entries that name no module of ``graph`` (a typo, most likely)."""
    names: set[str] = set()
    for node in graph.nodes:
        for fqn, cls in module_path(node):
            fqn = _plain_fqn(fqn)
            names.add(cls)
            parts = fqn.split(".")
            names.update(".".join(parts[: i + 1]) for i in range(len(parts)))
    return [entry for entry in keep_fp32 if entry not in names]


def _plain_fqn(fqn: str) -> str:
    """``L['self'].encoder.layer[0]`` / ``encoder.layer.0`` -> ``encoder.layer.0``."""
    import re

    fqn = re.sub(r"^L\['self'\]\.?", "", fqn)
    fqn = re.sub(r"\[(\d+)\]", r".\1", fqn)
    fqn = re.sub(r"\['([^']+)'\]", r".\1", fqn)
    return fqn.strip(".").replace("..", ".")


def _fresh(name: str, taken: set[str]) -> str:
    candidate, i = name, 1
    while candidate in taken:
        candidate, i = f"{name}_{i}", i + 1
    taken.add(candidate)
    return candidate
