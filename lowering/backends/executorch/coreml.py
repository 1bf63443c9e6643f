"""A Core ML payload made deterministic: same partition, same bytes, in any process, on any day.

ExecuTorch's Core ML ``preprocess`` returns an mlpackage flattened into one buffer
(``executorchcoreml.flatten_directory_contents``).  Four things in it change from one
lowering to the next although the model does not (measured: two processes, one MLP)::

    metadata.json   "identifier": "executorch_<uuid4>"          random per lowering
    Manifest.json   "itemInfoEntries": {"<uuid4>": {...}, ...}  random ids, written sorted by id,
                    "rootModelIdentifier": "<uuid4>"             so the entries' order is random too
    model.mlmodel   protobuf maps (the MIL ops' inputs, the      serialized in hash order, which
                    user-defined metadata)                       upb seeds per process
                    "com.github.apple.coremltools.conversion_date": "2026-11-28"   the day

:func:`deterministic_payload` rewrites each in place, every rewrite the same length, so
the flattened directory's offsets hold: the model spec re-serialized with protobuf's
deterministic (key-sorted) map order and the date pinned to :data:`CONVERSION_DATE`;
the manifest's entries ordered by path; then every uuid replaced by one derived from the
payload's bytes with the uuids blanked (the device runtime caches compiled models by the
identifier: another partition gets another one), and the manifest written sorted by the
new ids, as coremltools writes it.  Applied to ExecuTorch's own payload of the same
partition it gives the same bytes (tests/test_et_identical.py).
"""

from __future__ import annotations

import hashlib
import json
import re
import tempfile
import uuid
from pathlib import Path

from ...errors import BackendError

#: A uuid as text (ExecuTorch's identifier, the manifest's item ids).
UUID_TEXT = re.compile(rb"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
#: coremltools' conversion-date metadata key, and the date lowerflow writes there.
CONVERSION_DATE_KEY = "com.github.apple.coremltools.conversion_date"
CONVERSION_DATE = "1970-01-01"


def deterministic_payload(payload: bytes) -> bytes:
    """``payload`` (a flattened mlpackage) with its per-lowering bytes made canonical; same length."""
    out = bytearray(payload)
    manifests = []
    for path, data in flattened_files(payload).items():
        if Path(path).name == "model.mlmodel":
            replace_in_place(out, data, canonical_spec(data))
        elif Path(path).name == "Manifest.json":
            manifests.append(manifest_by_path(data))
            replace_in_place(out, data, manifests[-1])
    stable = derived_uuids(bytes(out))
    out = bytearray(with_uuids(bytes(out), stable))
    for manifest in manifests:
        manifest = with_uuids(manifest, stable)
        replace_in_place(out, manifest, manifest_by_id(manifest))
    return bytes(out)


def flattened_files(payload: bytes) -> dict[str, bytes]:
    """The files of a flattened directory, by relative path (ExecuTorch's own unflatten)."""
    from executorch.backends.apple.coreml import executorchcoreml

    with tempfile.TemporaryDirectory(prefix="lowerflow-coreml-") as tmp:
        if not executorchcoreml.unflatten_directory_contents(payload, tmp):
            raise BackendError("the Core ML payload is not a flattened directory ExecuTorch can read")
        return {str(p.relative_to(tmp)): p.read_bytes() for p in sorted(Path(tmp).rglob("*")) if p.is_file()}


def replace_in_place(buffer: bytearray, old: bytes, new: bytes) -> None:
    """Overwrite the one occurrence of file contents ``old`` in ``buffer`` with ``new`` (same length)."""
    start = bytes(buffer).find(old)
    if len(new) != len(old) or start < 0 or bytes(buffer).find(old, start + 1) >= 0:
        raise BackendError("cannot make the Core ML payload deterministic: a file's bytes are not unique "
                           "in the payload or its canonical form has another length")
    buffer[start:start + len(old)] = new


def canonical_spec(data: bytes) -> bytes:
    """A ``model.mlmodel`` re-serialized with sorted map keys and the conversion date pinned.

    Before: ``userDefined {conversion_date: 2026-11-28, version: 9.0, ...}`` in upb's hash order.
    After:  the same entries sorted by key, ``conversion_date: 1970-01-01``.
    """
    from coremltools.proto import Model_pb2

    spec = Model_pb2.Model()
    spec.ParseFromString(data)
    metadata = spec.description.metadata.userDefined
    if CONVERSION_DATE_KEY in metadata and len(metadata[CONVERSION_DATE_KEY]) == len(CONVERSION_DATE):
        metadata[CONVERSION_DATE_KEY] = CONVERSION_DATE
    return spec.SerializeToString(deterministic=True)


def manifest_by_path(data: bytes) -> bytes:
    """The manifest with its item entries ordered by path (not by their random ids)."""
    manifest = json.loads(data)
    entries = manifest["itemInfoEntries"]
    manifest["itemInfoEntries"] = dict(sorted(entries.items(), key=lambda kv: (kv[1].get("path", ""), kv[0])))
    return manifest_text(manifest, sort_keys=False)


def manifest_by_id(data: bytes) -> bytes:
    """The manifest sorted by key, as coremltools writes it."""
    return manifest_text(json.loads(data), sort_keys=True)


def manifest_text(manifest: dict, sort_keys: bool) -> bytes:
    if not sort_keys:  # the entries' own keys sorted, their order kept
        manifest = {k: ({i: dict(sorted(e.items())) for i, e in v.items()} if k == "itemInfoEntries" else v)
                    for k, v in sorted(manifest.items())}
    return (json.dumps(manifest, indent=4, sort_keys=sort_keys) + "\n").encode()


def derived_uuids(payload: bytes) -> dict[bytes, bytes]:
    """Every uuid in ``payload`` -> one derived from the payload's bytes (the uuids blanked) and
    its order of first appearance: the same canonical payload always gets the same ids."""
    digest = hashlib.sha256(UUID_TEXT.sub(b"0" * 36, payload)).digest()
    return {old: str(uuid.UUID(bytes=hashlib.sha256(digest + i.to_bytes(4, "little")).digest()[:16],
                               version=4)).encode()
            for i, old in enumerate(dict.fromkeys(UUID_TEXT.findall(payload)))}


def with_uuids(data: bytes, stable: dict[bytes, bytes]) -> bytes:
    """``data`` with each uuid that ``stable`` maps replaced (same length)."""
    return UUID_TEXT.sub(lambda m: stable.get(m.group(0), m.group(0)), data)
