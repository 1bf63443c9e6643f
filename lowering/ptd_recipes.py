"""How each entry of a program's ``.ptd`` derives from its weights (issue 29): recorded and
checked once, when the program is emitted, so that a retrain's ``.ptd`` is written straight
from the new weights: no graph read, no preprocess, no emit::

    record = record_recipes(program, plan, pte, ptd)    # cold night (stage emit), once per structure
    ptd2 = replay(record, bindings)                     # a retrain: target -> tensor of the new weights

One recipe per ``.ptd`` key (JSON)::

    {"fn": "tensor", "name": n}                  a portable EXTERNAL tensor: weight n's bytes, row-major
    {"fn": "view", "name": n, "source": [shape, stride], "view": [size, stride, offset],
     "dtype": d, "pack": p}                      a delegate's blob: a view of weight n (XNNPACK's transposes,
                                                 permutes, reshapes), cast to dtype d, packed by p (``int4``)
    {"fn": "conv_filter" | "conv_bias", ...}    a convolution's filter / bias with a BatchNorm folded in
                                                 (:func:`lowering.backends.xnnpack.ops.convolution.conv_constants`)
    {"fn": "fixed", "data": base64}             bytes no weight changes (an averaging vector)

The backend names them while it preprocesses (:func:`note`, only while :data:`RECORDING`).

**The check** (:func:`record_recipes`): the program is bound to *perturbed* weights (every
floating-point weight ``x * 1.5 + 0.25``, every int8 one ``-x - 1`` but all-zero ones (a
symmetric recipe's zero points): each value changes, none leaves its domain), every delegate preprocessed and the program emitted again: its ``.pte``
must be byte-identical (nothing in the program depends on those values: an inline per-tensor
scale would differ) and every key's recipe must give the perturbed ``.ptd``'s bytes and the
cold ``.ptd``'s bytes.  Weights of other dtypes (int64 indices, bool masks) and all-zero int8 ones are not perturbed:
their digests are recorded (``pinned``) and a retrain that changes one is not replayed.  It is
a check on two points, not a proof over all values: a blob that depended on, say, only the
signs of a weight would pass it.  Where anything fails, the record says why (``unproven``)
and the retrain is bound the slow way (:func:`lowering.rebind.rebind_stored`), which emits the
program again and compares.
"""

from __future__ import annotations

import base64
from contextvars import ContextVar
from typing import Any, Mapping

import torch

from .delegation import same_blob
from .pte.flat_tensor import PtdEntry, TensorLayout, deserialize_ptd, ptd_parts
from .rebind import NotWeightsOnly, with_partition_copies
from .serialize import tensor_memory

#: While a program's recipes are recorded: ``{key: recipe or None}`` (None: the backend
#: cannot say how it computed that blob).
RECORDING: ContextVar[dict | None] = ContextVar("lowerflow_ptd_recipes", default=None)

#: Packing functions a ``view`` recipe names (``pack``), imported when a recipe needs one.
PACKS = {"int4": ("lowering.backends.xnnpack.ops.quantized", "pack_int4")}

#: Recipes computed by a backend's own function (``fn``): where it lives.
FUNCTIONS = {"conv_filter": ("lowering.backends.xnnpack.ops.convolution", "conv_recipe"),
             "conv_bias": ("lowering.backends.xnnpack.ops.convolution", "conv_recipe")}

VERSION = 1
FIXED_LIMIT = 1 << 20  # bytes of fixed blobs a record holds; more: unproven
PERTURB_SLICE = 1 << 18  # values :func:`perturbed` computes at once (2 MB of float64)


def recording() -> bool:
    return RECORDING.get() is not None


def note(key: str, recipe: dict | None) -> None:
    """Record how the blob ``key`` was computed (while :data:`RECORDING`; the first say wins,
    but a recipe replaces an unknown)."""
    recorded = RECORDING.get()
    if recorded is not None and recorded.get(key) is None:
        recorded[key] = recipe


def view_spec(name: str, source: torch.Tensor, tensor: torch.Tensor) -> dict:
    """``tensor`` as a view of weight ``name`` (whose memory, ``source``, it views)."""
    return {"name": name, "source": [list(source.shape), list(source.stride())],
            "view": [list(tensor.shape), list(tensor.stride()), tensor.storage_offset() - source.storage_offset()]}


def view_of(spec: dict, bindings: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The view ``spec`` (:func:`view_spec`) of the weight it names, in ``bindings``."""
    name = spec["name"]
    if name not in bindings:
        raise NotWeightsOnly(f"the new weights have no {name!r}: another architecture")
    source = bindings[name]
    shape, stride = (tuple(x) for x in spec["source"])
    if tuple(source.shape) != shape:
        raise NotWeightsOnly(f"{name!r} is {list(source.shape)} in the new weights, {list(shape)} in the program")
    if source.stride() != stride:  # lay the new weight out as the program's was
        source = torch.empty_strided(shape, stride, dtype=source.dtype).copy_(source)
    size, vstride, offset = spec["view"]
    return source.as_strided(size, vstride, source.storage_offset() + offset)


def _import(where: tuple[str, str]):
    import importlib

    return getattr(importlib.import_module(where[0]), where[1])


def entry_bytes(recipe: dict, bindings: Mapping[str, torch.Tensor]) -> bytes | memoryview:
    """The bytes ``recipe`` gives on ``bindings`` (target -> tensor): a view of a tensor's memory
    where they are one (not copied again)."""
    fn = recipe["fn"]
    if fn == "tensor":
        return tensor_memory(view_of(recipe, bindings).contiguous())
    if fn == "view":
        tensor = view_of(recipe, bindings)
        if recipe.get("pack"):
            return bytes(_import(PACKS[recipe["pack"]])(tensor))
        return tensor_memory(tensor.to(getattr(torch, recipe["dtype"])).contiguous())
    if fn == "fixed":
        return base64.b64decode(recipe["data"])
    if fn in FUNCTIONS:
        tensor = _import(FUNCTIONS[fn])(recipe, {k: view_of(v, bindings) if isinstance(v, dict) else None
                                                 for k, v in recipe["args"].items()})
        return tensor_memory(tensor.to(getattr(torch, recipe["dtype"])).contiguous())
    raise NotWeightsOnly(f"a .ptd recipe of unknown kind {fn!r} (recorded by another version): bind again")


def tables_of(program) -> dict[str, torch.Tensor]:
    """target -> tensor of every weight ``program`` (delegated) and its delegates hold, but
    the buffers it mutates (state, not weights)."""
    from .lowered_module import LoweredBackendModule

    tables: dict[str, torch.Tensor] = {}

    def add(ep) -> None:
        mutated = set(ep.graph_signature.buffers_to_mutate.values())
        for name, value in {**ep.state_dict, **ep.constants}.items():
            if isinstance(value, torch.Tensor) and name not in mutated:
                tables.setdefault(name, value.detach())
        for node in ep.graph.nodes:
            lowered = getattr(ep.graph_module, node.target, None) if node.op == "get_attr" else None
            if isinstance(lowered, LoweredBackendModule):
                add(lowered.original_module)

    add(program)
    return tables


def perturbed(tensor: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor | None:
    """``tensor`` with every value changed and none out of its domain, or None (not perturbed):
    ``x * 1.5 + 0.25`` (computed in float64) or ``-x - 1`` (int8).  A contiguous floating-point
    tensor is computed a slice at a time in ``scratch`` (float64, one-dimensional; default: one of
    :data:`PERTURB_SLICE` values): no float64 copy of the whole tensor, the same values."""
    if tensor.is_floating_point():
        tensor = tensor.detach()
        if not tensor.is_contiguous():
            return tensor.to(torch.float64).mul_(1.5).add_(0.25).to(tensor.dtype)
        scratch = torch.empty(PERTURB_SLICE, dtype=torch.float64) if scratch is None else scratch
        out = torch.empty_like(tensor)
        source, target = tensor.reshape(-1), out.view(-1)
        for start in range(0, source.numel(), scratch.numel()):
            part = slice(start, start + scratch.numel())
            values = scratch[:source[part].numel()]
            target[part].copy_(values.copy_(source[part]).mul_(1.5).add_(0.25))
        return out
    if tensor.dtype == torch.int8 and bool(tensor.any()):  # all zeros: a symmetric recipe's zero points
        return (-tensor.detach().to(torch.int16) - 1).to(torch.int8)
    return None


def perturbed_tables(tables: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
    """name -> :func:`perturbed` of each of ``tables``; names of one tensor (the same memory,
    view and dtype: a tied weight and a partition's copy of it,
    :func:`lowering.partition.duplicate_shared_constants`) get one perturbed tensor, as the
    program holds one."""
    changed: dict[str, torch.Tensor | None] = {}
    first: dict[tuple, str] = {}
    scratch = torch.empty(PERTURB_SLICE, dtype=torch.float64)  # one for every tensor: no float64 garbage
    for name, tensor in tables.items():
        same = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
                tensor.stride(), tensor.dtype) if tensor.numel() else None
        if same is not None and same in first:
            changed[name] = changed[first[same]]
        else:
            if same is not None:
                first[same] = name
            changed[name] = perturbed(tensor, scratch)
    return changed


def record_recipes(emit_again, tables: Mapping[str, torch.Tensor], ptd: "bytes | Mapping[str, PtdEntry]") -> dict:
    """The record of a program whose weights are ``tables`` (:func:`tables_of`; every method's,
    for a program of several methods) and whose cold ``.ptd`` is ``ptd`` (its bytes, or the
    entries it was written from: key -> ``PtdEntry``, e.g. ``PteData.external``, views of the
    program's weights): ``{"version", "recipes": {key: recipe}, "layouts": {key: layout or None},
    "weights": {name: [dtype, shape]}, "pinned": {name: digest}}``, or ``{"unproven": why}``.
    ``emit_again(bindings)``: the ``.ptd`` of the program bound to ``bindings``, or its entries
    (not serialized: one copy of the weights less), raising :class:`NotWeightsOnly` when its
    ``.pte`` differs (:func:`lowering.rebind.emit_bound_entries`).

    Memory: one perturbed copy of the weights (one per tensor, however many names it has) and
    what the second emit computes beside views of it; bytes are read in place (a ``.ptd``'s
    entries are views of it, a recipe's bytes a view of its weight where they are one), and
    each entry of the second emit is let go once it is compared."""
    from .quantize.graph import value_digest

    changed = perturbed_tables(tables)
    bindings = {name: t if changed[name] is None else changed[name] for name, t in tables.items()}
    recorded: dict = {}
    token = RECORDING.set(recorded)
    try:
        ptd_p = emit_again(bindings)
    except Exception as exc:  # NotWeightsOnly, or a backend refusing the perturbed values: bind the slow way
        return {"unproven": f"{type(exc).__name__}: {exc}".splitlines()[0]}
    finally:
        RECORDING.reset(token)
    cold = _entries(ptd)
    other = _entries(ptd_p) if isinstance(ptd_p, (bytes, bytearray, memoryview)) else dict(ptd_p)
    del ptd_p
    if set(cold) != set(other):
        return {"unproven": "the perturbed weights give a .ptd of other keys"}
    recipes, fixed = {}, 0
    for key in sorted(cold):  # the .ptd's order: the first failure is the one the file shows first
        entry, perturbed_entry = cold[key], other.pop(key)
        recipe = recorded.get(key)
        if recipe is None and key not in recorded and key in tables:  # a portable EXTERNAL tensor
            recipe = {"fn": "tensor", **view_spec(key, tables[key], tables[key])}
        if recipe is None:
            if not same_blob(entry.data, perturbed_entry.data):
                return {"unproven": f"the .ptd entry {key!r} depends on the weights in a way the backend "
                                    "did not record"}
            fixed += len(entry.data)
            if fixed > FIXED_LIMIT:
                return {"unproven": f"more than {FIXED_LIMIT} bytes of fixed blobs"}
            recipe = {"fn": "fixed", "data": base64.b64encode(bytes(entry.data)).decode()}
        try:
            same = same_blob(entry_bytes(recipe, tables), entry.data) and \
                same_blob(entry_bytes(recipe, bindings), perturbed_entry.data)
        except NotWeightsOnly as exc:
            return {"unproven": f"{key!r}: {exc}"}
        if not same:
            return {"unproven": f"the recipe of .ptd entry {key!r} does not give its bytes"}
        recipes[key] = recipe
    return {"version": VERSION, "recipes": recipes,
            "layouts": {k: _layout_json(cold[k].layout) for k in sorted(cold)},
            "weights": {n: [str(t.dtype), list(t.shape)] for n, t in tables.items() if changed[n] is not None},
            "pinned": {n: value_digest(t) for n, t in tables.items() if changed[n] is None}}


def _entries(ptd: "bytes | bytearray | memoryview | Mapping[str, PtdEntry]") -> Mapping[str, PtdEntry]:
    """A ``.ptd``'s entries: read in place from its bytes (views of them), or as given."""
    if isinstance(ptd, (bytes, bytearray, memoryview)):
        return deserialize_ptd(memoryview(ptd))
    return ptd


def replay(record: Mapping[str, Any], bindings: Mapping[str, torch.Tensor]) -> bytes:
    """The ``.ptd`` of the recorded program (:func:`record_recipes`) bound to ``bindings``
    (target -> tensor of tonight's weights): :func:`replay_parts` joined."""
    return b"".join(replay_parts(record, bindings))


def replay_parts(record: Mapping[str, Any], bindings: Mapping[str, torch.Tensor]) -> list:
    """:func:`replay`'s ``.ptd`` as its pieces in order (:func:`~lowering.pte.flat_tensor.ptd_parts`:
    a weight stored as it is stays a view of its tensor, for a store to write without a joined
    copy).  Raises :class:`NotWeightsOnly` when the record is unproven or of another version, a
    weight is missing or of another dtype or shape, or a pinned weight (not perturbed by the
    check) changed."""
    from .quantize.graph import value_digest

    if record.get("version") != VERSION:
        raise NotWeightsOnly(record.get("unproven") or "the .ptd recipes were recorded by another version")
    bindings = with_partition_copies(bindings, [*record["weights"], *record["pinned"]])
    for name, (dtype, shape) in record["weights"].items():
        tensor = bindings.get(name)
        if tensor is None:
            raise NotWeightsOnly(f"the new weights have no {name!r}: another architecture")
        if str(tensor.dtype) != dtype or list(tensor.shape) != shape:
            raise NotWeightsOnly(f"{name!r} is {tensor.dtype} {list(tensor.shape)} in the new weights, "
                                 f"{dtype} {shape} in the program: another architecture")
    for name, digest in record["pinned"].items():
        if name not in bindings or value_digest(bindings[name]) != digest:
            raise NotWeightsOnly(f"{name!r} ({'missing' if name not in bindings else 'changed'}) is not a "
                                 "weight the .ptd recipes were checked with: bind again")
    return ptd_parts({key: PtdEntry(entry_bytes(recipe, bindings), _layout(record["layouts"][key]))
                      for key, recipe in record["recipes"].items()})


def _layout_json(layout: TensorLayout | None) -> list | None:
    return None if layout is None else [layout.scalar_type, list(layout.sizes), list(layout.dim_order)]


def _layout(data: list | None) -> TensorLayout | None:
    return None if data is None else TensorLayout(int(data[0]), tuple(data[1]), tuple(data[2]))
