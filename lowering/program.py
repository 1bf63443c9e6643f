"""Helpers on ExportedProgram shared by the stages: copy, rebuild."""

from __future__ import annotations

import copy
import dataclasses

import torch
from torch.export import ExportedProgram


def copy_program(exported_program: ExportedProgram) -> ExportedProgram:
    """A copy whose graph can be rewritten freely; weights are shared, not copied.

    Lowering never writes into weight tensors, so sharing them keeps the copy
    cheap for large models (ExecuTorch deep-copies the whole program).  Mutated
    buffers are cloned: running the copy must not change the original's state.
    """
    gm = exported_program.graph_module
    mutated = set(exported_program.graph_signature.buffers_to_mutate.values())
    state_dict = {
        k: (v.clone() if k in mutated else v) for k, v in exported_program.state_dict.items()
    }
    constants = {
        k: (v.clone() if k in mutated and isinstance(v, torch.Tensor) else v)
        for k, v in exported_program.constants.items()
    }
    memo = {id(t): t for t in (*state_dict.values(), *constants.values())}
    new_gm = copy.deepcopy(gm, memo)
    _keep_node_names(gm.graph, new_gm)
    return ExportedProgram(
        root=new_gm,
        graph=new_gm.graph,
        graph_signature=copy.deepcopy(exported_program.graph_signature),
        state_dict=state_dict,
        range_constraints=dict(exported_program.range_constraints),
        module_call_graph=copy.deepcopy(exported_program.module_call_graph),
        example_inputs=exported_program.example_inputs,
        constants=constants,
        verifiers=[exported_program.verifier],
    )


def with_tables(exported_program: ExportedProgram) -> ExportedProgram:
    """A program that shares ``exported_program``'s graph (never to be rewritten) but has its
    own weight tables and its own submodule table: what binding other weights to the same
    program changes, without :func:`copy_program`'s deep copy of the graph (and of every
    delegate's program in it)::

        bound = with_tables(program)
        bound.state_dict["fc.weight"] = new        # program.state_dict unchanged
        setattr(bound.graph_module, "lowered_module_0", other)   # program's delegate unchanged

    Mutated buffers are cloned, as :func:`copy_program` does.
    """
    mutated = set(exported_program.graph_signature.buffers_to_mutate.values())
    gm = exported_program.graph_module
    shallow_gm = gm.__class__.__new__(gm.__class__)  # fx's own __copy__ would re-own (and recompile) the graph
    shallow_gm.__dict__ = {**gm.__dict__, "_modules": dict(gm._modules)}
    shallow = copy.copy(exported_program)
    shallow._graph_module = shallow_gm
    shallow._state_dict = {k: (v.clone() if k in mutated else v) for k, v in exported_program.state_dict.items()}
    shallow._constants = {k: (v.clone() if k in mutated and isinstance(v, torch.Tensor) else v)
                          for k, v in exported_program.constants.items()}
    return shallow


def _keep_node_names(original: torch.fx.Graph, copied: torch.fx.GraphModule) -> None:
    """Give the copy's nodes the original's names.

    fx's namespace never hands out a builtin's name, so copying renames a
    placeholder that torch.export called ``input`` (``nn.Sequential``'s argument)
    to ``input_1``, and the copy no longer matches its graph signature::

        before copy: %input : placeholder   signature: USER_INPUT 'input'
        after copy:  %input_1 : placeholder signature: USER_INPUT 'input'   (SpecViolationError)
        after this:  %input : placeholder   signature: USER_INPUT 'input'
    """
    renamed = False
    for old, new in zip(original.nodes, copied.graph.nodes):
        if new.name != old.name:
            new.name = old.name
            renamed = True
    if renamed:
        copied.recompile()


def _restore_input_names(gm: torch.fx.GraphModule, sig) -> None:
    """Placeholders take the names their input specs give them (graph rewrites that copy
    nodes, e.g. a topological sort, rename a builtin-named ``input`` to ``input_1``)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    taken = {n.name for n in gm.graph.nodes}
    renamed = False
    for node, spec in zip(placeholders, sig.input_specs):
        want = getattr(spec.arg, "name", None)
        if want and node.name != want and want not in taken:
            taken.discard(node.name)
            node.name = want
            taken.add(want)
            renamed = True
    if renamed:
        gm.recompile()


def rebuild_program(exported_program: ExportedProgram) -> ExportedProgram:
    """A new ExportedProgram over the (rewritten) graph of ``exported_program``.

    Output specs and the module call graph are renamed to the nodes the output
    node now returns (fusion replaces output values by getitems), and entries
    of the state dict and constants that no input spec names any more are dropped.
    """
    gm = exported_program.graph_module
    sig = exported_program.graph_signature
    _restore_input_names(gm, sig)
    outputs = list(gm.graph.output_node().args[0])
    renamed = {}
    output_specs = []
    for spec, node in zip(sig.output_specs, outputs):
        if hasattr(spec.arg, "name") and isinstance(node, torch.fx.Node):
            renamed[spec.arg.name] = node.name
            spec = dataclasses.replace(spec, arg=type(spec.arg)(name=node.name))
        output_specs.append(spec)
    new_sig = dataclasses.replace(sig, output_specs=output_specs)
    targets = {s.target for s in new_sig.input_specs if s.target is not None}
    state_dict = {k: v for k, v in exported_program.state_dict.items() if k in targets}
    constants = {k: v for k, v in exported_program.constants.items() if k in targets}
    call_graph = copy.deepcopy(exported_program.module_call_graph)
    for entry in call_graph:
        if entry.fqn == "" and entry.signature is not None:
            for arg in entry.signature.outputs:
                if hasattr(arg, "name") and arg.name in renamed:
                    arg.name = renamed[arg.name]
    return ExportedProgram(
        root=gm,
        graph=gm.graph,
        graph_signature=new_sig,
        state_dict=state_dict,
        range_constraints=exported_program.range_constraints,
        module_call_graph=call_graph,
        example_inputs=exported_program.example_inputs,
        constants=constants,
        verifiers=[exported_program.verifier],
    )


#: Node metadata that records where a node came from (source lines, module
#: paths, tracing provenance) and does not change what the program computes.
DEBUG_METADATA = ("stack_trace", "nn_module_stack", "source_fn_stack", "from_node", "torch_fn", "seq_nr")


def strip_debug_metadata(exported_program: ExportedProgram) -> ExportedProgram:
    """Drop :data:`DEBUG_METADATA` from every node (in place); returns the program.

    What remains (``val``, ``tensor_meta``, tags) is a function of the program
    alone, so a stored program's digest does not depend on the machine, the
    checkout path or the model class that produced it: identical partitions of
    different models are identical artifacts.
    """
    for node in exported_program.graph.nodes:
        for key in DEBUG_METADATA:
            node.meta.pop(key, None)
    return exported_program
