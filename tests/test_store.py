"""The artifact store on real filesystems: local directory, memory://, s3 (moto server)."""

from __future__ import annotations

import hashlib
import json
import shutil
import threading

import pytest
import torch

from examples.models import MODELS
from lowering.export import export
from tasks.store import (
    DEFAULT_ROOT,
    STORE_ENV,
    ArtifactCorrupt,
    ArtifactMissing,
    ArtifactRef,
    ArtifactStore,
)


def _objects(store: ArtifactStore) -> list[str]:
    return [p for p in store.fs.find(f"{store.root}/objects")]


def test_put_get_roundtrip_is_content_addressed(store):
    data = b"lowerflow artifact \x00\xff" * 100
    ref = store.put_bytes(data, "pte")
    digest = hashlib.sha256(data).hexdigest()
    assert ref == ArtifactRef(store.uri(store.object_path(digest)), digest, len(data), "pte")
    assert ref.uri.endswith(f"/objects/{digest[:2]}/{digest[2:]}")
    assert ref.uri.startswith(store.url)
    assert store.get_bytes(ref) == data
    assert store.has(digest) and store.exists(ref)
    assert not store.exists(ArtifactRef(ref.uri, digest, len(data) + 1, "pte"))


def test_put_is_idempotent_and_does_not_rewrite(store):
    ref = store.put_bytes(b"A" * 64, "blob")
    assert store.put_bytes(b"A" * 64, "other kind") == ArtifactRef(ref.uri, ref.sha256, 64, "other kind")
    assert len(_objects(store)) == 1
    # Same size, different bytes in place: a second put does not rewrite (it only
    # checks the size), and reading detects the corruption.
    store.fs.pipe_file(store.object_path(ref.sha256), b"B" * 64)
    store.put_bytes(b"A" * 64, "blob")
    with pytest.raises(ArtifactCorrupt):
        store.get_bytes(ref)


def test_corrupt_object_is_quarantined_and_repaired_by_put(store):
    ref = store.put_bytes(b"payload" * 10, "blob")
    store.fs.pipe_file(store.object_path(ref.sha256), b"tampered" * 10)
    with pytest.raises(ArtifactCorrupt, match=ref.sha256):
        store.get_bytes(ref)
    # Moved aside: now missing, and a put writes it again.
    with pytest.raises(ArtifactMissing, match=ref.sha256):
        store.get_bytes(ref)
    assert len(store.fs.find(f"{store.root}/quarantine")) == 1
    assert store.put_bytes(b"payload" * 10, "blob") == ref
    assert store.get_bytes(ref) == b"payload" * 10


def test_truncated_object_is_rewritten_by_put(store):
    ref = store.put_bytes(b"x" * 1000, "blob")
    store.fs.pipe_file(store.object_path(ref.sha256), b"x" * 10)
    store.put_bytes(b"x" * 1000, "blob")
    assert store.get_bytes(ref) == b"x" * 1000


def test_missing_object_raises_artifact_missing(store):
    ref = ArtifactRef(store.uri(store.object_path("ab" * 32)), "ab" * 32, 3, "pte")
    with pytest.raises(ArtifactMissing, match="pte artifact abab"):
        store.get_bytes(ref)
    assert not store.has("ab" * 32)


def test_named_outputs_are_atomic_predictable_and_checked(store):
    ref = store.put_named("mlp/reference.pte", b"PTE1")
    assert ref.uri == f"{store.url}/outputs/mlp/reference.pte"
    assert store.get_named("mlp/reference.pte") == b"PTE1"
    assert store.get_bytes(ref) == b"PTE1" and store.exists(ref)
    store.put_named("mlp/reference.pte", b"PTE2")  # overwrites
    assert store.get_named("mlp/reference.pte") == b"PTE2"
    with pytest.raises(ArtifactCorrupt, match="named output 'mlp/reference.pte'"):
        store.get_bytes(ref)  # ref names the old content
    manifest = store.put_json("fleet.json", {"mlp": {"reference": ref.sha256}})
    assert store.get_json("fleet.json") == {"mlp": {"reference": ref.sha256}}
    assert manifest.uri.endswith("/outputs/fleet.json")
    with pytest.raises(ArtifactMissing, match="'nope.pte'"):
        store.get_named("nope.pte")


@pytest.mark.parametrize("name", ["", "/abs.pte", "../escape.pte", "a//b.pte", "a/./b.pte"])
def test_bad_output_names_are_rejected(tmp_path, name):
    with pytest.raises(ValueError, match="output name"):
        ArtifactStore(str(tmp_path)).put_named(name, b"x")


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_readers_never_see_half_written_outputs(tmp_path, kind):
    """A reader racing a writer that alternates two 4 MB payloads sees one or the other."""
    url = str(tmp_path / "s") if kind == "local" else f"memory://race-{tmp_path.name}"
    store = ArtifactStore(url)
    payloads = [b"a" * (4 << 20), b"b" * (4 << 20)]
    store.put_named("m/t.pte", payloads[0])
    done = threading.Event()

    def writer():
        for i in range(30):
            store.put_named("m/t.pte", payloads[i % 2])
        done.set()

    thread = threading.Thread(target=writer)
    thread.start()
    while not done.is_set():
        data = store.get_named("m/t.pte")
        assert data in payloads, f"read {len(data)} bytes, a partial write"
    thread.join()
    if kind == "local":
        assert sorted(p.name for p in (tmp_path / "s" / "outputs" / "m").iterdir()) == ["t.pte"]


def test_default_root_is_dot_lowerflow_in_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(STORE_ENV, raising=False)
    store = ArtifactStore()
    assert DEFAULT_ROOT == "./.lowerflow"
    assert store.root == str(tmp_path / ".lowerflow") and store.is_local
    monkeypatch.setenv(STORE_ENV, "memory://from-env")
    assert ArtifactStore().url == "memory:///from-env"


def test_refs_stay_valid_when_a_store_is_copied(tmp_path):
    old = ArtifactStore(str(tmp_path / "old"))
    ref = old.put_bytes(b"weights", "blob")
    shutil.copytree(tmp_path / "old", tmp_path / "new")
    assert ArtifactStore(str(tmp_path / "new")).get_bytes(ref) == b"weights"


def test_artifact_ref_json_roundtrip_and_validation():
    ref = ArtifactRef("memory:///x/objects/ab/cd", "ab" * 32, 5, "pte")
    assert ArtifactRef.from_json(json.loads(json.dumps(ref.to_json()))) == ref
    with pytest.raises(ValueError, match="sha256"):
        ArtifactRef("u", "not-a-digest", 1, "pte")
    with pytest.raises(ValueError, match="not an ArtifactRef"):
        ArtifactRef.from_json({"uri": "u"})


def test_programs_are_stored_once_per_distinct_tensor(store):
    model, inputs = MODELS["mlp"]()
    ep = export(model, inputs)
    ref = store.put_program(ep)
    assert ref.kind == "program"
    n = len(_objects(store))
    assert n == 9  # manifest + graph + 6 weights + 1 example input
    assert store.put_program(ep) == ref and len(_objects(store)) == n
    # A different graph blob with the same weights adds only a graph and a manifest.
    store.put_program(ep, keep_stack_traces=False)
    assert len(_objects(store)) == n + 2
    loaded = store.get_program(ref)
    torch.testing.assert_close(loaded.module()(*inputs), ep.module()(*inputs), rtol=0, atol=0)
    store.verify(ref)


def test_deep_verify_finds_a_corrupt_weight(store):
    model, inputs = MODELS["lifted_constant"]()
    ep = export(model, inputs)
    ref = store.put_program(ep)
    weight = store.put_bytes(ep.constants["scale"].numpy().tobytes(), "blob")
    store.fs.pipe_file(store.object_path(weight.sha256), b"\0" * weight.size)
    store.verify(ref, deep=False)  # the manifest itself is fine
    with pytest.raises(ArtifactCorrupt, match=f"blob of program {ref.sha256[:12]}"):
        store.verify(ref)
    with pytest.raises(ArtifactMissing):  # quarantined by the failed check
        store.get_program(ref)


def test_programs_holding_lowered_modules_roundtrip_through_the_store(tmp_path):
    from lowering import to_backend
    from lowering.backends.reference import ReferencePartitioner

    store = ArtifactStore(str(tmp_path / "store"))
    model, inputs = MODELS["mlp"]()
    delegated = to_backend(export(model, inputs), ReferencePartitioner())
    ref = store.put_program(delegated)
    store.verify(ref)
    torch.testing.assert_close(store.get_program(ref).module()(*inputs), model(*inputs))


def test_programs_are_stored_and_read_without_a_second_copy_of_their_weights(tmp_path):
    """Storing writes views of the program's own tensors; reading puts each weight in the
    buffer read from the file (a local store), which the tensor then owns: no bytes + copy."""
    from lowering.serialize import serialize_program, tensor_to_blob

    store = ArtifactStore(str(tmp_path / "store"))
    model, inputs = MODELS["mlp"]()
    ep = export(model, inputs)
    weight = next(iter(ep.state_dict.values())).detach()
    _, view = tensor_to_blob(weight)
    assert isinstance(view, memoryview) and view.readonly
    assert view.obj.__array_interface__["data"][0] == weight.data_ptr()  # the tensor's memory itself
    blob = serialize_program(ep).blobs[hashlib.sha256(view).hexdigest()]
    assert isinstance(blob, memoryview) and blob == weight.numpy().tobytes()
    ref = store.put_program(ep)
    assert store.put_bytes(view, "blob").sha256 == hashlib.sha256(weight.numpy().tobytes()).hexdigest()
    buffer = store.read_object_buffer(hashlib.sha256(view).hexdigest())
    assert isinstance(buffer, bytearray) and buffer == view
    loaded = store.get_program(ref)
    torch.testing.assert_close(loaded.module()(*inputs), ep.module()(*inputs), rtol=0, atol=0)
    for tensor in loaded.state_dict.values():
        tensor.detach().add_(1)  # each loaded weight owns writable memory of its own
    torch.testing.assert_close(store.get_program(ref).module()(*inputs), ep.module()(*inputs), rtol=0, atol=0)
