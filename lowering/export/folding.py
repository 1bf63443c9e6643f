"""Stage 1's constant folding: view-copies of weights become lifted constants.

After either path, with ``fold_constants=True``, a ``*_copy`` view of
parameters / tensor constants (e.g. a Linear's transposed weight) is
evaluated now and stored as a new lifted constant, so that it neither runs
nor occupies the arena at runtime; see :func:`fold_constant_views`.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, InputSpec, TensorArgument
from torch.utils import _pytree as pytree

#: ``node.meta`` key of a folded constant's placeholder: how it was computed,
#: ``(op name, args, kwargs)`` with each weight as ``("weight", target)``, so that a
#: retrain's weights can be folded the same way (:mod:`lowering.rebind`).  Kept in this
#: process only (the stored program does not carry it).
FOLDED_FROM = "folded_from"

#: Kinds of lifted inputs whose value is fixed at export time.
_CONSTANT_KINDS = (InputKind.PARAMETER, InputKind.CONSTANT_TENSOR)


def fold_constant_views(program: ExportedProgram) -> int:
    """Replace view-copies of parameters / tensor constants by new lifted constants.

    A ``*_copy`` view op (permute, view, transpose, squeeze, unsqueeze, select,
    slice, ...) whose tensor inputs are all parameters or tensor constants is
    evaluated now; its result (contiguous) becomes a ``CONSTANT_TENSOR`` input
    named after the weight and the view (:func:`folded_name`: ``fc2.weight#t``), the
    same in every method of a model and every night of a retrain.  Ops that would grow the data (``expand_copy``)
    and nodes the graph returns are left alone, and so is a view of a weight
    something else reads too (a tied weight: an embedding and its LM head):
    folding it would store the weight twice, growing the file by what the
    arena saves at most, so file + arena would not shrink.  The same view of the same
    weight (e.g. an LSTM's transposed weight at every time step) is folded
    once.  Returns the count of nodes removed; a parameter nothing else reads
    is then removed by :func:`remove_unused_constants`.

    Before::

        %p_fc2_weight = placeholder                          # PARAMETER fc2.weight
        %permute_1 = aten.permute_copy.default(%p_fc2_weight, [1, 0])
        %addmm_1 = aten.addmm.default(%p_fc2_bias, %relu, %permute_1)

    After::

        %c__folded_permute_1 = placeholder                   # CONSTANT_TENSOR fc2.weight#t
        %addmm_1 = aten.addmm.default(%p_fc2_bias, %relu, %c__folded_permute_1)
    """
    from torch._guards import detect_fake_mode

    graph = program.graph_module.graph
    specs = program.graph_signature.input_specs
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    spec_of = dict(zip(placeholders, specs))
    fake_mode = detect_fake_mode([n.meta.get("val") for n in placeholders])
    names = {n.name for n in graph.nodes}
    targets = {s.target for s in specs} | set(program.state_dict) | set(program.constants)
    folded: dict[tuple, torch.fx.Node] = {}  # the same view of the same weight once
    count = 0
    for node in list(graph.nodes):
        if not _foldable(node, spec_of):
            continue
        key = (node.target, repr(torch.fx.node.map_arg((node.args, node.kwargs), lambda a: spec_of[a].target)))
        if key in folded:
            node.replace_all_uses_with(folded[key])
            graph.erase_node(node)
            count += 1
            continue
        real = _constant_value(program, node, spec_of)
        target = _fresh(folded_name(node, spec_of), targets)
        placeholder_name = _fresh(f"c_folded_{node.name}", names)
        anchor = _first_user_input(graph, spec_of)
        with graph.inserting_before(anchor) if anchor is not None else graph.inserting_after(
            [n for n in graph.nodes if n.op == "placeholder"][-1]
        ):
            new = graph.placeholder(placeholder_name)
        new.meta = {k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta")}
        new.meta["val"] = fake_mode.from_tensor(real, static_shapes=True) if fake_mode else real
        new.meta[FOLDED_FROM] = (node.target.name(), *torch.fx.node.map_arg(
            (node.args, node.kwargs), lambda a: ("weight", spec_of[a].target)))
        spec = InputSpec(InputKind.CONSTANT_TENSOR, TensorArgument(new.name), target)
        ordered = [n for n in graph.nodes if n.op == "placeholder"]
        specs.insert(ordered.index(new), spec)
        spec_of[new] = spec
        program.constants[target] = real
        folded[key] = new
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        count += 1
    return count


def folded_name(node: torch.fx.Node, spec_of: Mapping[torch.fx.Node, InputSpec]) -> str:
    """A folded view's constant name: the weight's name and the view, never the node's (a
    node name is per program: two methods folding views of different weights would both
    say ``_folded_permute``)::

        permute_copy(fc2.weight, [1, 0])        fc2.weight#t
        permute_copy(conv.weight, [0, 2, 3, 1]) conv.weight#p0231
        view_copy(emb.weight, [4, 8])           emb.weight#view(4,8)
        select_copy(a, 0, 1) of weights a, b    a#select(0,1)+b   (each further weight after a +)
    """
    weights = [spec_of[a].target for a in node.all_input_nodes]
    rest = [a for a in pytree.tree_leaves((node.args[1:], node.kwargs)) if not isinstance(a, torch.fx.Node)]
    op = node.target._schema.name.split("::")[-1].removesuffix("_copy")
    if op == "permute" and all(isinstance(d, int) and 0 <= d < 10 for d in rest):
        role = "t" if rest == [1, 0] else "p" + "".join(map(str, rest))
    else:
        role = f"{op}({','.join(map(str, rest))})"
    return "+".join([f"{weights[0]}#{role}", *weights[1:]])


def _foldable(node: torch.fx.Node, spec_of: Mapping[torch.fx.Node, InputSpec]) -> bool:
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    if torch.Tag.view_copy not in node.target.tags or node.target is torch.ops.aten.expand_copy.default:
        return False
    inputs = [a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, torch.fx.Node)]
    if not inputs or any(a.op != "placeholder" or spec_of[a].kind not in _CONSTANT_KINDS for a in inputs):
        return False
    if any(user.op == "output" for user in node.users):
        return False
    if any(not _same_view(user, node) for a in inputs for user in a.users):
        return False  # the weight stays (it has other readers): folding would store it twice
    out, ins = node.meta.get("val"), [a.meta.get("val") for a in inputs]
    if not isinstance(out, torch.Tensor) or not all(isinstance(v, torch.Tensor) for v in ins):
        return False
    return out.numel() <= sum(v.numel() for v in ins)


def _same_view(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    """Whether ``a`` computes the same view as ``b`` (then both fold into one constant)."""
    return a is b or (a.target is b.target and a.args[1:] == b.args[1:] and a.kwargs == b.kwargs)


def _constant_value(program: ExportedProgram, node: torch.fx.Node, spec_of) -> torch.Tensor:
    """Run ``node`` on the real parameter / constant tensors; a dense copy.

    A ``*_copy`` op returns a new contiguous tensor already: copied again only when it
    is not (a second copy of every folded weight cost ~2.5 s on Qwen2.5-0.5B's 168)."""

    def real(arg: torch.fx.Node) -> torch.Tensor:
        target = spec_of[arg].target
        table = program.constants if target in program.constants else program.state_dict
        return table[target].detach()

    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), real)
    with torch.no_grad():
        value = node.target(*args, **kwargs)
    storages = {a.untyped_storage().data_ptr() for a in pytree.tree_leaves((args, kwargs))
                if isinstance(a, torch.Tensor)}
    if value.is_contiguous() and value.untyped_storage().data_ptr() not in storages:
        return value
    return value.contiguous().clone()


def _first_user_input(graph: torch.fx.Graph, spec_of) -> torch.fx.Node | None:
    for n in graph.nodes:
        if n.op == "placeholder" and spec_of[n].kind == InputKind.USER_INPUT:
            return n
    return None


def _fresh(name: str, taken: set[str]) -> str:
    candidate, i = name, 1
    while candidate in taken:
        candidate, i = f"{name}_{i}", i + 1
    taken.add(candidate)
    return candidate


def folded_recipes(program: ExportedProgram) -> dict[str, list]:
    """``{constant target: recipe}`` of every folded constant whose placeholder carries
    :data:`FOLDED_FROM`, as JSON (a weight ``("weight", t)`` is ``{"weight": t}``): what a
    stored program keeps beside it so a retrain's weights can be folded the same way
    (:func:`restore_folded`).  A recipe with a value JSON cannot hold is left out (then
    :func:`lowering.rebind.folded_views` refuses that program: lower again)."""
    specs = {s.arg.name: s.target for s in program.graph_signature.input_specs if hasattr(s.arg, "name")}
    recipes = {}
    for node in program.graph.nodes:
        if node.op == "placeholder" and FOLDED_FROM in node.meta and node.name in specs:
            try:
                recipes[specs[node.name]] = _to_json(node.meta[FOLDED_FROM])
            except TypeError:
                continue
    return recipes


def restore_folded(program: ExportedProgram, recipes: Mapping[str, list]) -> None:
    """Put :func:`folded_recipes` back on the placeholders of ``program`` (read back from a
    store, where ``node.meta`` does not keep them), in place."""
    targets = {s.arg.name: s.target for s in program.graph_signature.input_specs if hasattr(s.arg, "name")}
    folded = folded_from_json(recipes)
    for node in program.graph.nodes:
        if node.op == "placeholder" and targets.get(node.name) in folded:
            node.meta[FOLDED_FROM] = folded[targets[node.name]]


def folded_from_json(recipes: Mapping[str, list]) -> dict[str, tuple]:
    """:func:`folded_recipes` read back: ``{constant target: (op, args, kwargs)}``, each as
    :data:`FOLDED_FROM` holds it (what :func:`lowering.rebind.folded_views` gives of a program)."""
    folded = {}
    for target, recipe in recipes.items():
        op, args, kwargs = _from_json(recipe)
        folded[target] = (op, tuple(args), kwargs)
    return folded


def _to_json(value):
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "weight":
        return {"weight": value[1]}
    if isinstance(value, (list, tuple)):
        return [_to_json(v) for v in value]
    if isinstance(value, dict):
        return {"kwargs": {str(k): _to_json(v) for k, v in value.items()}}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"a folded recipe holds a {type(value).__name__}")


def _from_json(value):
    if isinstance(value, dict):
        if "weight" in value:
            return ("weight", value["weight"])
        return {k: _from_json(v) for k, v in value["kwargs"].items()}
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    return value
