"""Garbage collection (tasks/gc.py, ``lowerflow gc``) on stores that real flows wrote."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from flows.lower_fleet import lower_fleet
from tasks import stages
from tasks.gc import collect
from tasks.store import ArtifactStore

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "examples" / "models.py"

FACTORY = """
import pathlib
import torch

def net():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    m.load_state_dict(torch.load(pathlib.Path(__file__).with_name("w.pt"), weights_only=True))
    return m.eval(), (torch.ones(2, 4),)
"""


pytestmark = pytest.mark.usefixtures("fresh_stages")


def save_weights(directory: Path, seed: int) -> None:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    torch.save(m.state_dict(), directory / "w.pt")


def fleet(tmp_path: Path, *names: str) -> dict:
    models = {"net": f"{tmp_path / 'net' / 'factory.py'}:net", "mlp": f"{MODELS}:mlp"}
    summary = lower_fleet({
        "store": str(tmp_path / "store"),
        "defaults": {"targets": ["portable", "reference"]},
        "models": [{"name": n, "model": models[n]} for n in names],
    })
    stages.LIVE.clear()
    return summary


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and "locks" not in p.parts}


def programs(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted((root / "outputs").rglob("*.pte"))}


def age(root: Path, days: float) -> None:
    """Make every object, record and quarantined file look ``days`` old."""
    stamp = time.time() - days * 86400
    for sub in ("objects", "prefect/results", "quarantine"):
        for p in (root / sub).rglob("*"):
            os.utime(p, (stamp, stamp))


@pytest.fixture
def two_generations(tmp_path):
    """A store holding two lowerings of `net` (weights retrained in between) and one of mlp."""
    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "factory.py").write_text(FACTORY)
    save_weights(tmp_path / "net", 1)
    assert fleet(tmp_path, "net", "mlp")["ok"]
    save_weights(tmp_path / "net", 2)
    assert fleet(tmp_path, "net", "mlp")["ok"]
    return tmp_path


def test_gc_removes_the_old_generation_and_keeps_everything_published(two_generations):
    root = two_generations / "store"
    published = programs(root)
    age(root, 30)
    report = collect(ArtifactStore(str(root)), keep_days=7)
    assert report.removed_objects and report.removed_records and not report.missing
    # The old export of net is gone (its program manifest and its old weight blobs) ...
    assert any(r.startswith("export-") for r in report.removed_records)
    # ... and everything published, and every stage behind it, is still there: a rerun
    # executes nothing and publishes the same bytes.
    before = stages.EXECUTIONS.copy()
    summary = fleet(two_generations, "net", "mlp")
    assert summary["ok"] and sum((stages.EXECUTIONS - before).values()) == 0
    assert programs(root) == published
    # A second collection finds nothing more to remove.
    age(root, 30)
    assert not collect(ArtifactStore(str(root)), keep_days=7).removed_objects


def test_gc_dry_run_and_recent_files_remove_nothing(two_generations):
    root = two_generations / "store"
    files = tree(root)
    recent = collect(ArtifactStore(str(root)), keep_days=7)  # everything is minutes old
    assert not recent.removed_objects and not recent.removed_records and recent.kept_recent > 0
    age(root, 30)
    dry = collect(ArtifactStore(str(root)), keep_days=7, dry_run=True)
    assert dry.removed_objects and dry.freed_bytes > 0
    assert tree(root) == files


def test_gc_releases_a_model_whose_outputs_were_deleted(two_generations):
    root = two_generations / "store"
    store = ArtifactStore(str(root))
    for p in (root / "outputs" / "net").iterdir():
        p.unlink()
    age(root, 30)
    report = collect(store, keep_days=7)
    # Only mlp's stages remain; its rerun is fully cached, net recomputes from scratch.
    before = stages.EXECUTIONS.copy()
    assert fleet(two_generations, "mlp")["ok"] and sum((stages.EXECUTIONS - before).values()) == 0
    before = stages.EXECUTIONS.copy()
    assert fleet(two_generations, "net")["ok"] and (stages.EXECUTIONS - before)["export"] == 1
    assert len(report.removed_records) >= 2 * 9  # net's two generations, all stages


def test_gc_removes_old_quarantine(two_generations):
    root = two_generations / "store"
    (root / "quarantine").mkdir(exist_ok=True)
    (root / "quarantine" / ("ab" * 32 + ".1")).write_bytes(b"bad")
    age(root, 30)
    report = collect(ArtifactStore(str(root)), keep_days=7)
    assert report.removed_quarantine == ["ab" * 32 + ".1"]
    assert not any((root / "quarantine").iterdir())


def test_gc_command_line(two_generations):
    root = two_generations / "store"
    age(root, 30)
    cli = [sys.executable, "-m", "flows.cli", "gc"]
    dry = subprocess.run([*cli, str(root), "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert dry.returncode == 0 and "would remove" in dry.stdout, dry.stderr
    files = tree(root)
    done = subprocess.run([*cli, str(root), "--keep-days", "7"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "removed" in done.stdout and len(tree(root)) < len(files)
    missing = subprocess.run([*cli, str(root / "nope")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and missing.stderr.strip().splitlines()[0].startswith("lowerflow: error: store")
    negative = subprocess.run([*cli, str(root), "--keep-days", "-1"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert negative.returncode == 2 and "--keep-days" in negative.stderr


def test_gc_on_an_s3_store(monkeypatch, s3_options, tmp_path):
    """The same rule on S3 (moto server): records live beside the objects, ages are S3's."""
    import datetime
    import uuid

    from flows.lower_model import lower_model

    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_options["client_kwargs"]["endpoint_url"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_options["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_options["secret"])
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    url = f"s3://lowerflow/{uuid.uuid4().hex}"
    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "factory.py").write_text(FACTORY)
    spec = f"{tmp_path / 'net' / 'factory.py'}:net"
    for seed in (1, 2):
        save_weights(tmp_path / "net", seed)
        assert lower_model(spec, ["portable"], store=url)["targets"]["portable"]["ok"]
        stages.LIVE.clear()
    store = ArtifactStore(url)
    later = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=30)
    assert not collect(store, keep_days=7).removed_objects  # all recent
    report = collect(store, keep_days=7, now=later)
    assert report.removed_objects and report.removed_records and not report.missing
    before = stages.EXECUTIONS.copy()
    assert lower_model(spec, ["portable"], store=url)["targets"]["portable"]["ok"]
    assert sum((stages.EXECUTIONS - before).values()) == 0


def test_a_recent_unpublished_record_keeps_the_old_objects_it_names(two_generations):
    """A running flow's fresh cache record (nothing published yet) may name weight blobs
    written long ago: they are kept."""
    import json

    from tasks.gc import _record_refs

    root = two_generations / "store"
    summary = json.loads((root / "outputs" / "net" / "manifest.json").read_text())
    export_key = next(r["key"] for r in summary["targets"]["portable"]["stages"] if r["stage"] == "export")
    for p in (root / "outputs" / "net").iterdir():
        p.unlink()  # not published (yet)
    age(root, 30)
    record = root / "prefect" / "results" / export_key
    os.utime(record)  # just written by a running flow
    report = collect(ArtifactStore(str(root)), keep_days=7)
    assert report.removed_objects  # the other generation went
    store = ArtifactStore(str(root))
    for ref in _record_refs(record.read_bytes()):
        store.verify(ref, deep=True)  # the program manifest and every blob it names


def test_gc_removes_memos_unused_for_keep_days_and_keeps_recent_ones(tmp_path):
    """An hf: model's remembered description (``memo/``) is remade on a miss: gc drops it once
    unused (no hit refreshed it) for ``keep_days``; a recent one stays, and reads back as written."""
    store = ArtifactStore(str(tmp_path / "store"))
    store.put_memo("hf-description-old", {"constants": {"get_max_seq_len": 16}})
    store.put_memo("hf-description-new", {"constants": {"get_max_seq_len": 32}})
    stamp = time.time() - 30 * 86400
    os.utime(store.memo_path("hf-description-old"), (stamp, stamp))
    report = collect(store, keep_days=7)
    assert report.removed_records == ["memo/hf-description-old.json"]
    assert store.get_memo("hf-description-old") is None
    assert store.get_memo("hf-description-new") == {"constants": {"get_max_seq_len": 32}}
    # A memo whose value is not the one its digest names is no hit.
    path = Path(store.memo_path("hf-description-new"))
    path.write_text(path.read_text().replace("32", "64"))
    assert store.get_memo("hf-description-new") is None
