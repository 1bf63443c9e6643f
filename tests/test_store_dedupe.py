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
    for window in (store_dir / "windows").rglob("*"):
        if window.is_file():
            assert store.has(json.loads(window.read_text())["object"])  # no window outlives its program
    published = store_dir / "outputs" / "llama" / "portable.pte"
    assert published.samefile(store.object_path(new["sha256"]))
    assert _runs(published).shape == (1, 3, 4096)
    assert _store_bytes(store_dir) <= 1.5 * new["size"], _store_bytes(store_dir)
    # still fully cached: gc kept what the published manifest names
    third = lower_model(f"hf:{directory}", ["portable"], str(store_dir), hf=dict(HF), verify="off")
    assert all(r["cached"] for r in third["targets"]["portable"]["stages"])


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
