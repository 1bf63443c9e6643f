"""Issue 27, store growth: a cold lowering writes each weight byte-string once.

The stages' programs share their weight blobs by digest (lowering.serialize); the emitted
``.pte`` holds the same bytes again, so once it is stored those blobs become windows of it
(``ArtifactStore.keep_as_windows``); the published ``outputs/<name>/<target>.pte`` is a hard
link to the stored object (``ArtifactStore.publish_object``).  ``lowerflow gc`` removes what a
re-lowering with new weights superseded, and the published programs still run.

Models: tiny random-weight Llama directories whose weights dominate their bytes (hidden 256,
vocabulary 4096), attention ``standard`` (aten SDPA: ExecuTorch's runtime runs it in this process).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
runtime = pytest.importorskip("executorch.runtime")

from tasks.store import ArtifactStore  # noqa: E402

HF = {"task": "text-generation", "max_seq_len": 16, "attn": "standard"}


def _llama(directory: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
    )).eval().save_pretrained(directory)
    return directory


def _store_bytes(root: Path) -> int:
    """Bytes of every file under ``root``, each hard-linked file once (as ``du`` counts)."""
    seen, total = set(), 0
    for path in root.rglob("*"):
        if path.is_file():
            st = path.stat()
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def _runs(pte: Path) -> torch.Tensor:
    """The published program's logits for a 3-token prompt on ExecuTorch's runtime."""
    method = runtime.Runtime.get().load_program(pte).load_method("forward")
    return method.execute([torch.tensor([[5, 9, 17]]), torch.arange(3)])[0]


def test_a_cold_lowering_stores_each_weight_once_and_publishes_a_link(prefect_api, tmp_path):
    from flows.lower_model import lower_model

    directory = _llama(tmp_path / "llama", 0)
    store_dir = tmp_path / "store"
    manifest = lower_model(f"hf:{directory}", ["portable", "xnnpack"], str(store_dir), hf=dict(HF))
    store = ArtifactStore(str(store_dir))
    sizes = []
    for target in ("portable", "xnnpack"):
        ref = manifest["targets"][target]["pte"]
        published = store_dir / "outputs" / "llama" / f"{target}.pte"
        assert published.samefile(store.object_path(ref["sha256"]))  # a link, not a copy
        sizes.append(ref["size"])
        assert _runs(published).shape == (1, 3, 4096)
    weights = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
    assert min(sizes) > 0.9 * weights  # the programs are mostly weights
    windows = list((store_dir / "windows").rglob("*"))
    assert windows  # the exported weights live inside the programs
    # two programs of the same weights (portable's constants, xnnpack's named data): ~one copy each
    assert _store_bytes(store_dir) <= 1.5 * sum(sizes), (_store_bytes(store_dir), sizes)
    # every stage's artifacts still read back, digest-checked (blobs out of the .pte's windows)
    from tasks.cache import records_location
    from tasks.gc import _record_refs

    records_fs, records_dir = records_location(store)
    programs = 0
    for target in ("portable", "xnnpack"):
        for record in manifest["targets"][target]["stages"]:
            for ref in _record_refs(records_fs.cat_file(f"{records_dir}/{record['key']}")):
                store.verify(ref, deep=True)
                if ref.kind == "program":
                    programs += 1
                    assert store.get_program(ref).graph is not None
    assert programs >= 4
    again = lower_model(f"hf:{directory}", ["portable", "xnnpack"], str(store_dir), hf=dict(HF))
    assert all(r["cached"] for t in again["targets"].values() for r in t["stages"])
    assert again["targets"]["xnnpack"]["pte"] == manifest["targets"]["xnnpack"]["pte"]


def test_gc_after_new_weights_removes_the_old_program_and_its_blobs(prefect_api, tmp_path):
    from flows.lower_model import lower_model
    from tasks.gc import collect

    directory = _llama(tmp_path / "llama", 0)
    store_dir = tmp_path / "store"
    first = lower_model(f"hf:{directory}", ["portable"], str(store_dir), hf=dict(HF), verify="off")
    old = first["targets"]["portable"]["pte"]
    _llama(directory, 1)  # new weights, same config
    second = lower_model(f"hf:{directory}", ["portable"], str(store_dir), hf=dict(HF), verify="off")
    new = second["targets"]["portable"]["pte"]
    assert new["sha256"] != old["sha256"]
    store = ArtifactStore(str(store_dir))
    assert store.has(old["sha256"])  # until collected
    report = collect(store, keep_days=0)
    assert old["sha256"] in report.removed_objects and not store.has(old["sha256"])
    assert store.has(new["sha256"])
    for digest, window in _stored_windows(store_dir).items():  # no window outlives its program
        assert store.has(window["object"]) if "object" in window else len(store.read_object(digest)) == window["size"]
    published = store_dir / "outputs" / "llama" / "portable.pte"
    assert published.samefile(store.object_path(new["sha256"]))
    assert _runs(published).shape == (1, 3, 4096)
    assert _store_bytes(store_dir) <= 1.5 * new["size"], _store_bytes(store_dir)
    # still fully cached: gc kept what the published manifest names
    third = lower_model(f"hf:{directory}", ["portable"], str(store_dir), hf=dict(HF), verify="off")
    assert all(r["cached"] for r in third["targets"]["portable"]["stages"])


def ran_keys(store_dir: Path) -> dict[str, str]:
    """``{stage: cache key}`` of the published manifest of the one model in ``store_dir``."""
    (manifest,) = (store_dir / "outputs").glob("*/manifest.json")
    return {r["stage"]: r["key"] for r in json.loads(manifest.read_text())["targets"]["xnnpack"]["stages"]}


def _result(store: ArtifactStore, keys: dict[str, str], stage: str) -> dict:
    """The stage's cached result, its refs as JSON objects."""
    from tasks.cache import records_location

    records_fs, records_dir = records_location(store)
    record = json.loads(records_fs.cat_file(f"{records_dir}/{keys[stage]}"))
    result = json.loads(record["result"]) if isinstance(record["result"], str) else record["result"]
    return {k: v["__lowerflow_artifact__"] if isinstance(v, dict) and "__lowerflow_artifact__" in v else v
            for k, v in result.items()}


def _stored_windows(store_dir: Path) -> dict[str, dict]:
    return {"".join(p.parts[-2:]): json.loads(p.read_text()) for p in (store_dir / "windows").rglob("*") if p.is_file()}


def test_an_8da4w_lowering_stores_its_weights_about_once_and_a_moved_checkpoint_only_exports_again(
        prefect_api, tmp_path):
    """8da4w: the fp32 export's weights are ranges of the checkpoint (its linears' folded
    ``weight#t`` transposed ranges), the quantized program's 4-bit weights are stored packed,
    the .pte's bytes once: the store holds at most 1.5x the program (session 17: 4.1x on
    SmolLM2-135M).  A cached rerun hits; the checkpoint moved elsewhere (same bytes, so the
    same fingerprint) makes the export's windows missing: export runs again, the rest hits."""
    import shutil

    from flows.lower_model import lower_model
    from tasks import stages

    def lower(directory: Path) -> dict:
        stages.LIVE.clear()
        done = lower_model(f"hf:{directory}", ["xnnpack"], str(store_dir), hf=dict(HF), quantize={"recipe": "8da4w"},
                           verify="off")
        return {r["stage"]: r["cached"] for r in done["targets"]["xnnpack"]["stages"]}, done["targets"]["xnnpack"]["pte"]

    store_dir = tmp_path / "store"
    first = _llama(tmp_path / "a" / "llama", 0)
    ran, pte = lower(first)
    assert not any(ran.values())
    windows = _stored_windows(store_dir)
    assert any(w.get("transpose") for w in windows.values()) and any("file" in w for w in windows.values())
    assert _store_bytes(store_dir) <= 1.5 * pte["size"] + 256 * 1024, (_store_bytes(store_dir), pte["size"])
    store = ArtifactStore(str(store_dir))
    quantized = json.loads(store.read_object(_result(store, ran_keys(store_dir), "quantize")["program"]["sha256"]))
    packed = [m["blob"] for name, m in quantized["constants"].items() if m.get("encoding") == "int4"
              and "_q_weight" in name]  # the 4-bit weights (their zero points are packed too)
    assert packed and all(store.window(b)["object"] == pte["sha256"] for b in packed)  # XNNPACK's bytes, kept once
    cached, again = lower(first)
    assert all(cached.values()) and again == pte, cached

    second = tmp_path / "b" / "llama"
    shutil.copytree(first, second)
    shutil.rmtree(tmp_path / "a")
    moved, again = lower(second)
    assert again == pte
    assert [stage for stage, hit in moved.items() if not hit] == ["export"], moved
    for digest, window in _stored_windows(store_dir).items():  # every window reads back, none into the old copy
        assert str(tmp_path / "a") not in window.get("file", "")
        assert len(store.read_object(digest)) == window["size"]


def test_gc_after_new_weights_reclaims_the_old_8da4w_lowering_with_its_checkpoint_windows(prefect_api, tmp_path):
    """New weights saved over the checkpoint: the old export's windows into it no longer hold
    their bytes; ``lowerflow gc`` removes them with the old quantized program and .pte, and the
    new lowering stays whole and fully cached."""
    from flows.lower_model import lower_model
    from tasks import stages
    from tasks.gc import collect

    directory, store_dir = tmp_path / "llama", tmp_path / "store"

    def lower() -> dict:
        stages.LIVE.clear()
        return lower_model(f"hf:{directory}", ["xnnpack"], str(store_dir), hf=dict(HF), quantize={"recipe": "8da4w"},
                           verify="off")

    _llama(directory, 0)
    old_windows = _stored_windows(store_dir) if lower() else {}
    _llama(directory, 1)
    second = lower()
    new = second["targets"]["xnnpack"]["pte"]
    store = ArtifactStore(str(store_dir))
    report = collect(store, keep_days=0)
    stale = {d for d, w in old_windows.items() if "file" in w} - set(_stored_windows(store_dir))
    assert stale and stale <= set(report.removed_objects), report.summary()
    for digest, window in _stored_windows(store_dir).items():  # what is left reads back
        assert len(store.read_object(digest)) == window["size"]
    assert _store_bytes(store_dir) <= 1.5 * new["size"] + 256 * 1024, _store_bytes(store_dir)
    third = lower()
    assert all(r["cached"] for r in third["targets"]["xnnpack"]["stages"])
    assert third["targets"]["xnnpack"]["pte"] == new


def test_windows_read_back_digest_checked_and_a_missing_program_makes_the_blob_missing(tmp_path):
    """The store's contract for a window: read as the object it replaced; storing the same
    bytes again writes nothing while its program is there, and writes the object again
    once the program is gone."""
    from tasks.store import ArtifactCorrupt, ArtifactMissing

    store = ArtifactStore(str(tmp_path / "store"))
    blob = os.urandom(10_000)
    ref = store.put_bytes(blob, "blob")
    container = b"head" + blob + b"tail"
    program = store.put_bytes(container, "pte")
    assert store.keep_as_windows(program, [(4, len(blob))], container) == len(blob)
    assert not Path(store.object_path(ref.sha256)).exists() and store.exists(ref)
    assert store.read_object(ref.sha256) == blob
    store.put_bytes(blob, "blob")
    assert not Path(store.object_path(ref.sha256)).exists()
    # a program corrupted outside its windows is quarantined; the blob gets its own file back
    path = Path(store.object_path(program.sha256))
    path.write_bytes(b"HEAD" + path.read_bytes()[4:])
    with pytest.raises(ArtifactCorrupt):
        store.read_object(program.sha256)
    assert Path(store.object_path(ref.sha256)).read_bytes() == blob and store.window(ref.sha256) is None
    program = store.put_bytes(container, "pte")
    store.keep_as_windows(program, [(4, len(blob))], container)
    store.fs.rm_file(store.object_path(program.sha256))
    assert not store.exists(ref)
    with pytest.raises(ArtifactMissing, match="a window of object"):
        store.read_object(ref.sha256)
    store.put_bytes(blob, "blob")
    assert Path(store.object_path(ref.sha256)).read_bytes() == blob


def test_file_windows_read_a_checkpoints_ranges_and_a_changed_file_makes_the_object_missing(tmp_path):
    """An object kept as a range of a file outside the store (``keep_in_file``: an hf:
    checkpoint's tensor, as it is or transposed) reads back digest-checked; the file is never
    the store's: changed or removed, the object is missing (the stage that wrote it runs
    again), never corrupt, and the file is left as it is."""
    import hashlib

    from tasks.store import ArtifactMissing

    store = ArtifactStore(str(tmp_path / "store"))
    plain, matrix = os.urandom(4096), torch.randn(8, 16)
    transposed = matrix.t().contiguous().numpy().tobytes()
    checkpoint = tmp_path / "model.safetensors"
    checkpoint.write_bytes(b"header" + plain + matrix.numpy().tobytes())
    digest = {name: hashlib.sha256(b).hexdigest() for name, b in (("plain", plain), ("t", transposed))}
    assert not store.keep_in_file(digest["plain"], str(checkpoint), 5, len(plain))  # not those bytes
    assert store.keep_in_file(digest["plain"], str(checkpoint), 6, len(plain))
    assert store.keep_in_file(digest["t"], str(checkpoint), 6 + len(plain), len(transposed), (8, 16, 4))
    assert not (tmp_path / "store" / "objects").exists()
    ref = store.put_bytes(transposed, "blob")  # held by the window: nothing written
    assert not Path(store.object_path(ref.sha256)).exists() and store.exists(ref)
    assert store.read_object(digest["plain"]) == plain and store.read_object(digest["t"]) == transposed
    store.verify(ref)
    assert store.checked(digest["t"])  # the file's stamp: a cached rerun does not hash it again
    # the bytes also in a stored program: the window points into the program instead
    program = store.put_bytes(b"pte!" + plain, "pte")
    store.keep_as_windows(program, [(4, len(plain))], b"pte!" + plain)
    assert store.window(digest["plain"])["object"] == program.sha256

    data = bytearray(checkpoint.read_bytes())
    data[-1] ^= 0xFF  # the checkpoint rewritten in place, same size
    checkpoint.write_bytes(bytes(data))
    with pytest.raises(ArtifactMissing, match="no longer holds its bytes"):
        store.verify(ref)
    assert checkpoint.read_bytes() == bytes(data) and store.window(digest["t"]) is None
    assert not list((tmp_path / "store").glob("quarantine/*"))
    store.put_bytes(transposed, "blob")  # stored again: now an object of its own
    assert Path(store.object_path(ref.sha256)).read_bytes() == transposed

    other = os.urandom(2048)
    checkpoint.write_bytes(other)
    assert store.keep_in_file(hashlib.sha256(other).hexdigest(), str(checkpoint), 0, len(other))
    checkpoint.unlink()
    assert not store.has(hashlib.sha256(other).hexdigest())
    with pytest.raises(ArtifactMissing, match="which is gone"):
        store.read_object(hashlib.sha256(other).hexdigest())
