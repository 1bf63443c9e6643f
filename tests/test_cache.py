"""Stage caching on real Prefect: content keys, hits across flow runs, repair, locking."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from examples.models import MODELS
from lowering.export import export
from tasks.cache import (
    CacheConfig,
    StageCachePolicy,
    decode_json_object,
    encode_json_object,
    save_results_block,
    stage_task,
)
from tasks.cache_keys import CacheKeyError, environment_versions
from tasks.locks import FileLockManager
from tasks.store import ArtifactRef

REPO = Path(__file__).resolve().parents[1]
REF = ArtifactRef("file:///a/objects/ab/cd", "ab" * 32, 3, "program")


# --------------------------------------------------------------------------- keys (no server)


def test_key_depends_on_stage_version_params_and_input_digests():
    policy = StageCachePolicy(stage="partition", version="1")
    inputs = {"program": REF, "backend": "reference", "options": {"max": 3, "ops": ["add"]}}
    key = policy.key_for(inputs)
    assert key.startswith("partition-") and len(key) == len("partition-") + 64
    assert policy.key_for(dict(reversed(list(inputs.items())))) == key  # order-free
    # Content, not location: the same digest elsewhere is the same input.
    moved = ArtifactRef("s3://b/p/objects/ab/cd", REF.sha256, 3, "program")
    assert policy.key_for({**inputs, "program": moved}) == key
    others = [
        StageCachePolicy(stage="partition", version="2").key_for(inputs),
        StageCachePolicy(stage="adjust", version="1").key_for(inputs),
        policy.key_for({**inputs, "backend": "xnnpack"}),
        policy.key_for({**inputs, "options": {"max": 4, "ops": ["add"]}}),
        policy.key_for({**inputs, "program": ArtifactRef(REF.uri, "cd" * 32, 3, "program")}),
    ]
    assert len({key, *others}) == 6
    document = policy.key_document(inputs)
    assert document["torch"] == torch.__version__ == environment_versions()["torch"]
    assert document["lowerflow"] == environment_versions()["lowerflow"] != "unknown"
    assert document["inputs"]["program"] == {"artifact": REF.sha256}


def test_key_is_the_same_in_another_process():
    script = textwrap.dedent(
        """
        from tasks.cache import StageCachePolicy
        from tasks.store import ArtifactRef
        ref = ArtifactRef("file:///a/objects/ab/cd", "ab" * 32, 3, "program")
        print(StageCachePolicy(stage="emit", version="7").key_for({"p": ref, "cfg": {"b": 1.5, "a": None}}))
        """
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True)
    expected = StageCachePolicy(stage="emit", version="7").key_for({"cfg": {"a": None, "b": 1.5}, "p": REF})
    assert result.stdout.strip() == expected


def test_key_refuses_torch_objects_unless_ignored():
    policy = StageCachePolicy(stage="export", version="1")
    with pytest.raises(CacheKeyError, match="stage 'export' parameter 'weights'.*torch.Tensor"):
        policy.key_for({"weights": torch.ones(2)})
    with pytest.raises(CacheKeyError, match=r"parameter 'cfg'\['x'\]\[1\]"):
        policy.key_for({"cfg": {"x": [1, torch.nn.Linear(1, 1)]}})
    with pytest.raises(CacheKeyError, match="non-finite"):
        policy.key_for({"scale": float("nan")})
    ignoring = StageCachePolicy(stage="export", version="1", ignore=("live",))
    assert ignoring.key_for({"ref": REF, "live": torch.ones(2)}) == ignoring.key_for({"ref": REF})


def test_dataclass_parameters_are_keyed_by_their_fields():
    @dataclass
    class Options:
        tile: int
        name: str

    policy = StageCachePolicy(stage="s", version="1")
    assert policy.key_for({"o": Options(4, "a")}) == policy.key_for({"o": Options(4, "a")})
    assert policy.key_for({"o": Options(4, "a")}) != policy.key_for({"o": Options(8, "a")})


def test_results_are_json_with_artifact_refs_only():
    result = {"program": REF, "pte": [REF], "n": 3}
    text = json.dumps(result, default=encode_json_object, sort_keys=True)
    assert json.loads(text, object_hook=decode_json_object) == result
    with pytest.raises(TypeError, match="stage result contains a Tensor"):
        json.dumps({"t": torch.ones(1)}, default=encode_json_object)


def test_verify_modes_of_cached_refs(tmp_path):
    from tasks.store import ArtifactCorrupt, ArtifactMissing, ArtifactStore

    store = ArtifactStore(str(tmp_path / "store"))
    ref = store.put_bytes(b"abc", "text")
    named = store.put_named("m/t.pte", b"pte")
    result = {"out": ref, "published": [named], "n": 1}
    digest = StageCachePolicy(stage="s", store_url=store.url, verify="digest")
    exists = StageCachePolicy(stage="s", store_url=store.url, verify="exists")
    digest.check_refs(result)
    exists.check_refs(result)
    store.fs.pipe_file(store.object_path(ref.sha256), b"abd")  # same size, other bytes
    exists.check_refs(result)  # cheap mode: presence and size only
    with pytest.raises(ArtifactCorrupt):
        digest.check_refs(result)
    with pytest.raises(ArtifactMissing):  # the failed check quarantined it
        exists.check_refs(result)


# --------------------------------------------------------------------------- locks


def test_lock_manager_serializes_two_holders(tmp_path):
    a, b = FileLockManager(tmp_path), FileLockManager(tmp_path)  # as two processes
    assert a.acquire_lock("k", "A")
    assert not b.acquire_lock("k", "B", acquire_timeout=0.3)
    threading.Timer(0.3, a.release_lock, ("k", "A")).start()
    started = time.monotonic()
    assert b.acquire_lock("k", "B", acquire_timeout=10)
    assert time.monotonic() - started >= 0.25
    assert json.loads((tmp_path / "k.lock").read_text())["holder"] == "B"
    b.release_lock("k", "B")
    assert not (tmp_path / "k.lock").exists()


def test_stale_lock_of_a_dead_process_is_removed(tmp_path, caplog):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    import socket

    (tmp_path / "k.lock").write_text(
        json.dumps({"holder": "gone", "expiration": None, "host": socket.gethostname(), "pid": dead.pid})
    )
    with caplog.at_level(logging.WARNING, logger="lowerflow.cache"):
        assert FileLockManager(tmp_path).acquire_lock("k", "me", acquire_timeout=2)
    assert "stale lock" in caplog.text


# --------------------------------------------------------------------------- Prefect


def _config(tmp_path, **kwargs) -> CacheConfig:
    return CacheConfig(store_url=str(tmp_path / "store"), **kwargs)


def test_second_flow_run_hits_and_changes_miss(prefect_api, tmp_path):
    from prefect import flow

    config = _config(tmp_path)
    store = config.artifact_store()
    calls = []

    @stage_task("scale", "1", config=config)
    def scale(data: ArtifactRef, factor: int) -> ArtifactRef:
        calls.append(factor)
        value = int(store.get_bytes(data)) * factor
        return store.put_bytes(str(value).encode(), "number")

    @flow
    def pipeline(data: ArtifactRef, factor: int):
        state = scale(data, factor, return_state=True)
        return state.result(), state.name

    three = store.put_bytes(b"3", "number")
    first, name = pipeline(three, 2)
    assert (name, store.get_bytes(first), calls) == ("Completed", b"6", [2])
    again, name = pipeline(three, 2)  # a new flow run: the cache hits
    assert (name, again, calls) == ("Cached", first, [2])
    pipeline(three, 5)  # another parameter: miss
    pipeline(store.put_bytes(b"4", "number"), 2)  # another input digest: miss
    assert calls == [2, 5, 2]
    records = sorted((tmp_path / "store" / "prefect" / "results").iterdir())
    assert len(records) == 3 and all(r.name.startswith("scale-") for r in records)
    assert b"pickle" not in records[0].read_bytes()


def test_corrupt_or_missing_artifacts_make_a_miss_with_a_warning(prefect_api, tmp_path, caplog):
    from prefect import flow

    config = _config(tmp_path)
    store = config.artifact_store()
    calls = []

    @stage_task("export", "1", config=config)
    def export_stage(model: str) -> ArtifactRef:
        calls.append(model)
        return store.put_program(export(*MODELS[model]()))

    @flow
    def pipeline(model: str):
        return export_stage(model)

    ref = pipeline("lifted_constant")
    assert pipeline("lifted_constant") == ref and len(calls) == 1
    # Corrupt one weight blob of the cached program: detected (deep check), recomputed.
    manifest = json.loads(store.get_bytes(ref))
    weight = manifest["constants"]["scale"]["blob"]
    path = store.object_path(weight)
    store.fs.pipe_file(path, b"\0" * store.fs.size(path))
    with caplog.at_level(logging.WARNING, logger="lowerflow.cache"):
        assert pipeline("lifted_constant") == ref
    assert len(calls) == 2 and "is unusable" in caplog.text and "corrupt" in caplog.text
    store.verify(ref)  # repaired by the recompute
    # A deleted manifest: missing, recomputed.
    store.fs.rm(store.object_path(ref.sha256))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lowerflow.cache"):
        assert pipeline("lifted_constant") == ref
    assert len(calls) == 3 and "missing" in caplog.text
    # A garbled result record is not a hit either; the recompute rewrites it.
    (record,) = (tmp_path / "store" / "prefect" / "results").iterdir()
    record.write_bytes(b"garbage")
    assert pipeline("lifted_constant") == ref and len(calls) == 4
    assert pipeline("lifted_constant") == ref and len(calls) == 4
    model, inputs = MODELS["lifted_constant"]()
    torch.testing.assert_close(store.get_program(ref).module()(*inputs), model(*inputs))


def test_failed_stage_releases_its_lock_and_bad_results_are_refused(prefect_api, tmp_path):
    from prefect import flow

    config = _config(tmp_path)
    calls = []

    @stage_task("flaky", "1", config=config)
    def flaky(x: int) -> dict:
        calls.append(x)
        if len(calls) == 1:
            raise RuntimeError("first attempt fails")
        return {"x": x}

    @stage_task("tensor", "1", config=config)
    def returns_tensor(x: int):
        return torch.ones(2)

    @flow
    def pipeline(x: int):
        return flaky(x)

    @flow
    def bad(x: int):
        return returns_tensor(x)

    with pytest.raises(RuntimeError, match="first attempt"):
        pipeline(1)
    assert list((tmp_path / "store" / "prefect" / "locks").iterdir()) == []
    assert pipeline(1) == {"x": 1} and pipeline(1) == {"x": 1} and calls == [1, 1]
    with pytest.raises(TypeError, match="stage 'tensor' returned a result that cannot be cached.*Tensor"):
        bad(1)


_WORKER = """
import os, sys, time
from pathlib import Path
from prefect import flow
from tasks.cache import CacheConfig, stage_task

root, log = sys.argv[1], Path(sys.argv[2])
config = CacheConfig(store_url=root)
store = config.artifact_store()

@stage_task("slow", "1", config=config)
def slow(text: str):
    with log.open("a") as f:
        f.write(f"compute {os.getpid()} {time.time()}\\n")
    time.sleep(2)
    return store.put_bytes(text.encode(), "text")

@flow
def pipeline(text: str):
    return slow(text)

(Path(root).parent / f"ready-{os.getpid()}").touch()
while len(list(Path(root).parent.glob("ready-*"))) < 2:  # start both flow runs together
    time.sleep(0.05)
with log.open("a") as f:
    f.write(f"flow {os.getpid()} {time.time()}\\n")
print(pipeline("same input").sha256)
"""


def test_concurrent_flow_runs_compute_once(prefect_api, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    log = tmp_path / "log.txt"
    env = dict(os.environ, PREFECT_API_URL=prefect_api, PREFECT_LOGGING_LEVEL="WARNING")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    workers = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / "store"), str(log)],
            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for _ in range(2)
    ]
    outputs = [w.communicate(timeout=120) for w in workers]
    assert all(w.returncode == 0 for w in workers), [err[-2000:] for _, err in outputs]
    digests = {out.strip().splitlines()[-1] for out, _ in outputs}
    events = [line.split() for line in log.read_text().splitlines()]
    computes = [float(t) for kind, _, t in events if kind == "compute"]
    flows = [float(t) for kind, _, t in events if kind == "flow"]
    assert len(computes) == 1, events
    assert len(flows) == 2 and max(flows) < computes[0] + 2  # the runs overlapped
    assert len(digests) == 1


def test_stage_on_s3_store_with_results_on_s3(prefect_api, s3_options, tmp_path):
    from prefect import flow

    config = CacheConfig(
        store_url=f"s3://lowerflow/{tmp_path.name}", storage_options=s3_options, lock_dir=tmp_path / "locks"
    )
    with pytest.raises(ValueError, match="not local"):
        config.result_storage()
    config = dataclasses.replace(config, results=save_results_block(config, "lowerflow-test-results"))
    store = config.artifact_store()
    calls = []

    @stage_task("upper", "1", config=config)
    def upper(text: str) -> ArtifactRef:
        calls.append(text)
        return store.put_bytes(text.upper().encode(), "text")

    @flow
    def pipeline(text: str):
        return upper(text)

    ref = pipeline("abc")
    assert pipeline("abc") == ref and calls == ["abc"]
    assert ref.uri.startswith("s3://lowerflow/") and store.get_bytes(ref) == b"ABC"
    assert store.fs.find(f"{store.root}/prefect/results")
