"""External weights: a ``.pte`` (the program) and its ``.ptd`` (the weights), and the checks between them.

With ``external_weights`` (:func:`lowering.lower`), the emitter writes every weight as
an ``EXTERNAL`` tensor named by its fully qualified name, and each delegate asked for
external weights (:data:`lowering.delegation.EXTERNAL_WEIGHTS_SPEC`) names its blobs by
the weight's name and role (``layers.0.mlp.up_proj.weight#t``, ``…#scales``), never by
their bytes.  So the ``.pte`` depends on the program's structure only::

    lower(model_w1, external_weights=True)  ->  a.pte + w1.ptd
    lower(model_w2, external_weights=True)  ->  a.pte (same bytes) + w2.ptd
    a.pte + w2.ptd on a device              ->  model_w2's outputs

What binds a program to its data is only those key strings (and, for portable
tensors, dtype / sizes / dim order); ExecuTorch's runtime checks nothing more, and
crashes (1.5.1: SIGSEGV in ``load_method``) when a delegate's data is missing.
:func:`check_pair` checks, before anything runs, that every key the program needs is
in the ``.ptd`` with the right layout and size: one line naming what is wrong.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Union

from .errors import LoweringError
from .pte import PteData, serialize
from .pte.flat_tensor import PtdEntry, PtdFormatError, TensorLayout, deserialize_ptd, serialize_ptd
from .pte.format import decode_string, delegate_payload, program_table
from .pte.generated import program_generated as fb

#: Bytes, or a file's path.
Data = Union[bytes, str, os.PathLike]


class ExternalDataError(LoweringError):
    """A ``.pte`` and a ``.ptd`` that do not go together (or a ``.ptd`` missing); one line."""


def program_files(pte: PteData, external_weights: bool) -> tuple[bytes, bytes | None]:
    """``(.pte bytes, .ptd bytes)`` of an emitted program (:func:`lowering.emit.method.build_pte`);
    the ``.ptd`` is None without ``external_weights`` (and empty for a program without weights)."""
    return serialize(pte), serialize_ptd(pte.external) if external_weights else None


@dataclass(frozen=True)
class Need:
    """One blob a program binds from its ``.ptd``: who needs it, its layout (a portable
    tensor's) or its size in bytes (a delegate's)."""

    key: str
    where: str
    layout: TensorLayout | None = None
    size: int | None = None


def required_data(pte: Data) -> dict[str, Need]:
    """Every key the program (bytes or path) binds from external data, with what it must be.

    Portable tensors: ``EXTERNAL`` tensors of every method (layout from the tensor table).
    Delegates: the keys the backend's payload names and their sizes, when the backend says
    (``BackendDetails.external_keys(processed) -> {key: size}``); a delegate's key the
    program's own named data holds is not external.
    """
    data = _read(pte)
    needs: dict[str, Need] = {}
    table = program_table(data)
    for plan in table.executionPlan or []:
        method = decode_string(plan.name)
        for value in plan.values or []:
            if value.valType != fb.KernelTypes.Tensor or value.val.extraTensorInfo is None:
                continue
            info = value.val.extraTensorInfo
            if info.location != fb.TensorDataLocation.EXTERNAL or value.val.allocationInfo is not None:
                continue
            key = decode_string(info.fullyQualifiedName)
            layout = TensorLayout(int(value.val.scalarType), _ints(value.val.sizes), _ints(value.val.dimOrder))
            needs.setdefault(key, Need(key, f"method {method!r}", layout=layout))
    if any(plan.delegates for plan in table.executionPlan or []):
        named = {decode_string(entry.key) for entry in table.namedData or []}
        for plan in table.executionPlan or []:
            for delegate in plan.delegates or []:
                backend_id = decode_string(delegate.id)
                payload = delegate_payload(data, table, delegate)
                for key, size in _delegate_keys(backend_id, payload).items():
                    if key not in named:
                        needs.setdefault(key, Need(key, f"delegate {backend_id}", size=size))
    return needs


def _delegate_keys(backend_id: str, payload: bytes) -> dict[str, int]:
    from .delegation import UnknownBackendError, find_backend

    try:
        backend = find_backend(backend_id)
    except UnknownBackendError:
        return {}
    keys_of = getattr(backend, "external_keys", None)
    return dict(keys_of(payload)) if keys_of is not None else {}


def check_pair(pte: Data, ptd: "Data | None", *, pte_name: str = "program", ptd_name: str = "data") -> None:
    """Raise :class:`ExternalDataError` (one line) unless ``ptd`` has every key ``pte`` needs,
    each with the layout (portable tensor) or at least the size (delegate blob) it needs.

    ``ptd`` None: fine only for a program that needs no external data.  A ``.ptd`` of
    another program (another architecture) fails on its first missing or mis-shaped key.
    """
    needs = required_data(pte)
    if ptd is None:
        if needs:
            raise ExternalDataError(
                f"{pte_name} needs external data ({len(needs)} weights, e.g. {next(iter(needs))!r}) "
                f"and no .ptd was given: pass its .ptd (the stock runtime crashes without it)")
        return
    try:
        entries = deserialize_ptd(_read(ptd))
    except PtdFormatError as exc:
        raise ExternalDataError(f"{ptd_name}: {exc}") from None
    missing = [key for key in needs if key not in entries]
    if missing:
        raise ExternalDataError(
            f"{ptd_name} does not hold {len(missing)} of the {len(needs)} weights {pte_name} needs "
            f"(e.g. {missing[0]!r}, for {needs[missing[0]].where}): it is the data of another program")
    for key, need in needs.items():
        problem = _mismatch(need, entries[key])
        if problem:
            raise ExternalDataError(f"{ptd_name}: weight {key!r} ({need.where}) {problem}: "
                                    f"it is the data of another program")


def _mismatch(need: Need, entry: PtdEntry) -> str | None:
    if need.layout is not None:
        if entry.layout is None:
            return f"has no tensor layout, {need.layout.describe()} expected"
        if (entry.layout.scalar_type, tuple(entry.layout.sizes), tuple(entry.layout.dim_order)) != \
                (need.layout.scalar_type, need.layout.sizes, need.layout.dim_order):
            return f"is {entry.layout.describe()} (dim order {list(entry.layout.dim_order)}), " \
                   f"{need.layout.describe()} (dim order {list(need.layout.dim_order)}) expected"
        if len(entry.data) < need.layout.nbytes:
            return f"has {len(entry.data)} bytes, {need.layout.nbytes} expected"
    elif need.size is not None and len(entry.data) != need.size:
        return f"has {len(entry.data)} bytes, {need.size} expected"
    return None


def _ints(vector) -> tuple[int, ...]:
    """A flatbuffer int vector as the object API unpacks it (numpy array, list or None)."""
    return tuple(int(v) for v in vector) if vector is not None else ()


def _read(data: Data) -> bytes | memoryview:
    if isinstance(data, (bytes, memoryview)):
        return data
    if isinstance(data, bytearray):
        return bytes(data)
    return map_file(data)


def map_file(path: str | os.PathLike) -> memoryview:
    """The bytes of the file at ``path``, memory-mapped read-only: what is read of a big
    ``.pte`` or ``.ptd`` is only what is looked at (its table, a delegate's payload)."""
    import mmap

    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:  # an empty file cannot be mapped
            return memoryview(b"")
        return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
