"""Flow = library, always (issue 7): for every model and target, the ``.pte`` the flow
publishes is byte for byte the one ``lowering.lower`` returns, however each stage got
its inputs:

* cold (live objects handed from stage to stage), then warm (every stage cached);
* store only: ``LIVE`` disabled, so every stage reads its inputs back from the store,
  and every artifact every stage writes equals the cold run's;
* resumed after a fault injected at a middle stage;
* in a new process, every stage recomputed from stored inputs: all cache records
  deleted, ``LIVE`` disabled.  Each recomputed stage must reproduce the artifacts the
  first process stored (the store gains no object), which is what deleting one
  stage's records at a time would check, stage by stage, in one run.

Models: our test models (``examples/models.py``, ``tests/_models.py``) and real-world
architectures built from ``transformers`` configs with random weights
(``examples/hf_models.py``: MobileNetV2 with 63 reference partitions, ResNet, BERT,
GPT-2).  Targets: portable, reference, and xnnpack when that backend is installed.

Cost (2 cores): every model runs cold and warm.  Store-only runs are serde-bound
(a stored program is read by every stage that needs it), so they skip the LSTM (its
delegated program is read back by the resume test instead), the encoder layer
(BERT covers encoders), the MLP with a head (its partition is the MLP's) and the two
new-process models, whose new-process run is a store-only run too.  The new-process variant runs MobileNetV2 (the issue's model, many partitions)
and the buffer-mutation model (state moved into a delegate) in background processes
started with the module, so they overlap the in-process tests.  The fault variant
runs four models, a different middle stage each.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from flows.lower_model import ModelLoweringFailed, lower_model
from lowering import lower
from lowering.errors import LoweringError
from lowering.export import export
from lowering.partition import TAG, partition
from lowering.program import copy_program
from lowering.submodule import create_submodules, getitems_of
from lowering.targets import PORTABLE, partitioner_for
from tasks import stages
from tasks.store import ArtifactStore

ROOT = Path(__file__).resolve().parent.parent

OUR_MODELS = [
    "examples.models:mlp",
    "examples.models:cnn",
    "examples.models:lstm",
    "examples.models:buffer_mutation",
    "examples.models:transformer",
    "examples.models:lifted_constant",
    "examples.models:multi_output",
    "examples.models:integer_inputs",
    "tests._models:mlp_with_head",
]
HF_MODELS = [
    "examples.hf_models:mobilenet_v2",
    "examples.hf_models:resnet",
    "examples.hf_models:bert",
    "examples.hf_models:gpt2",
]
#: The stages of a delegate target, in DAG order (verify is off in these runs).
DELEGATE_STAGES = (
    "export", "partition", "create_submodule", "build_programs", "preprocess", "adjust", "memory_plan", "emit",
)


def _available(target: str) -> bool:
    """Whether ``target`` names an installed backend with a partitioner (or is portable)."""
    try:
        partitioner_for(target)
    except LoweringError:
        return False
    return True


TARGETS = [t for t in (PORTABLE, "reference", "xnnpack") if _available(t)]


pytestmark = pytest.mark.usefixtures("fresh_stages")


@pytest.fixture(scope="module", autouse=True)
def _transformers():
    pytest.importorskip("transformers")


# --------------------------------------------------------------------------- helpers


def build(spec: str):
    """``(module, example_inputs)`` from a ``module:factory`` spec, the caller's RNG untouched."""
    module_name, factory = spec.split(":")
    with torch.random.fork_rng():
        return getattr(importlib.import_module(module_name), factory)()


@functools.cache
def _exported(spec: str):
    module, inputs = build(spec)
    return export(module, inputs)


def exported(spec: str):
    """The model's program (exported once per session; a private copy each call)."""
    return copy_program(_exported(spec))


@functools.cache
def library_ptes(spec: str) -> dict[str, bytes]:
    """``lowering.lower``'s bytes for every target: the library, in memory, no store."""
    program = exported(spec)
    return {t: lower(program, partitioner=partitioner_for(t)).pte for t in TARGETS}


def published(manifest: dict, store: str) -> dict[str, bytes]:
    """The .pte bytes the flow published for each target (read from the store's outputs)."""
    s = ArtifactStore(store)
    out = {}
    for target, result in manifest["targets"].items():
        assert result["ok"], f"{manifest['name']}/{target}: {result['error']}"
        out[target] = s.get_named(f"{manifest['name']}/{target}.pte")
    return out


def assert_library_bytes(spec: str, ptes: dict[str, bytes], variant: str) -> None:
    """Every target's published bytes equal the library's; the message says where not."""
    expected = library_ptes(spec)
    assert set(ptes) == set(expected)
    differ = {
        t: f"flow {len(ptes[t])} B sha {_sha(ptes[t])}, library {len(expected[t])} B sha {_sha(expected[t])}"
        for t in expected if ptes[t] != expected[t]
    }
    assert not differ, f"{spec} ({variant}): the flow's .pte is not the library's: {differ}"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:12]


def run_flow(spec: str, store: str) -> tuple[dict, dict[str, int]]:
    """Lower ``spec`` for every target (no verify); (manifest, stage executions in this run)."""
    before = stages.EXECUTIONS.copy()
    manifest = lower_model(spec, TARGETS, store=store, verify=False)
    return manifest, dict(stages.EXECUTIONS - before)


def stored_objects(store: Path) -> set[str]:
    """The digests of every artifact in a local store (content-addressed objects)."""
    return {p.parent.name + p.name for p in (store / "objects").glob("*/*")}


# --------------------------------------------------------------------------- new processes

#: Models whose every stage is recomputed in a new process (run in the background).
NEW_PROCESS_MODELS = ["examples.hf_models:mobilenet_v2", "examples.models:buffer_mutation"]
#: Models without an in-process store-only run (see the module docstring).
NO_STORE_ONLY = {"examples.models:lstm", "examples.models:transformer", "tests._models:mlp_with_head", *NEW_PROCESS_MODELS}

#: One phase, in a process of its own.  ``cold``: lower the model into an empty store.
#: ``recompute``: delete every stage's cache record, then lower it again with no live
#: objects, so every stage recomputes from inputs read back from the store.
_PHASE = textwrap.dedent(
    """
    import contextlib, hashlib, json, sys
    from pathlib import Path
    from flows.lower_model import lower_model
    from tasks import stages
    from tasks.store import ArtifactStore

    phase, spec, store, targets = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    root = Path(store)

    def objects():
        return {p.parent.name + p.name for p in (root / "objects").glob("*/*")}

    deleted = 0
    if phase == "recompute":
        for record in (root / "prefect" / "results").iterdir():
            record.unlink()
            deleted += 1
    before = objects()
    with stages.LIVE.disabled() if phase == "recompute" else contextlib.nullcontext():
        manifest = lower_model(spec, targets, store=store, verify=False)
    ptes = {t: hashlib.sha256(ArtifactStore(store).get_named(manifest["name"] + "/" + t + ".pte")).hexdigest()
            for t in targets}
    print("RESULT=" + json.dumps({"deleted": deleted, "ran": dict(stages.EXECUTIONS), "ptes": ptes,
                                  "new_objects": sorted(objects() - before)}), flush=True)
    """
)


class NewProcesses:
    """A model lowered cold in one process, then recomputed in another (a background thread
    runs both, one after the other); :meth:`results` waits for them."""

    def __init__(self, spec: str, store: Path, env: dict[str, str]) -> None:
        self.spec, self.store, self.env = spec, store, env
        self._results: dict[str, dict] = {}
        self._error: str | None = None
        self._proc: subprocess.Popen | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=f"new-processes {spec}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for phase in ("cold", "recompute"):
            if self._stopped:
                return
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _PHASE, phase, self.spec, str(self.store), json.dumps(TARGETS)],
                env=self.env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )
            out, err = self._proc.communicate()
            lines = [line for line in out.splitlines() if line.startswith("RESULT=")]
            if self._proc.returncode != 0 or not lines:
                self._error = f"{phase} process of {self.spec} failed ({self._proc.returncode}): {err[-3000:]}"
                return
            self._results[phase] = json.loads(lines[-1][len("RESULT="):])

    def results(self) -> dict[str, dict]:
        self._thread.join(timeout=900)
        assert not self._thread.is_alive(), f"{self.spec}: the new processes did not finish in 15 minutes"
        assert self._error is None, self._error
        return self._results

    def stop(self) -> None:
        """End the process still running, if any (the module's tests are over)."""
        self._stopped = True
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
        self._thread.join(timeout=60)


@pytest.fixture(scope="module", autouse=True)
def new_processes(request, prefect_api, tmp_path_factory):
    """Started before the module's first test (when the new-process test is selected),
    so the new processes overlap the in-process tests."""
    wanted = any(item.originalname == NEW_PROCESS_TEST for item in request.session.items)
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    running = {
        spec: NewProcesses(spec, tmp_path_factory.mktemp("new-process"), env)
        for spec in (NEW_PROCESS_MODELS if wanted else [])
    }
    yield running
    for background in running.values():
        background.stop()


NEW_PROCESS_TEST = "test_every_stage_recomputed_in_a_new_process_reproduces_every_artifact"


# --------------------------------------------------------------------------- variants


@pytest.mark.parametrize("spec", OUR_MODELS + HF_MODELS)
def test_cold_warm_and_store_only_runs_publish_the_library_bytes(spec, tmp_path):
    live_store = str(tmp_path / "live")
    cold, ran = run_flow(spec, live_store)
    assert ran["export"] == 1
    assert_library_bytes(spec, published(cold, live_store), "cold")

    stages.LIVE.clear()
    warm, ran = run_flow(spec, live_store)
    assert sum(ran.values()) == 0, f"warm run executed {ran}"
    assert all(r["cached"] for t in warm["targets"].values() for r in t["stages"])
    assert_library_bytes(spec, published(warm, live_store), "warm")

    if spec in NO_STORE_ONLY:
        return
    store_only = str(tmp_path / "store-only")
    with stages.LIVE.disabled():
        read_back, ran = run_flow(spec, store_only)
    assert ran["export"] == 1
    assert_library_bytes(spec, published(read_back, store_only), "every input read back from the store")
    # Not just the .pte: every artifact every stage wrote is the same.
    live, stored = stored_objects(tmp_path / "live"), stored_objects(tmp_path / "store-only")
    assert live == stored, f"{len(live ^ stored)} artifacts differ between live and store-read inputs"


@pytest.mark.parametrize("spec", NEW_PROCESS_MODELS)
def test_every_stage_recomputed_in_a_new_process_reproduces_every_artifact(spec, new_processes):
    results = new_processes[spec].results()
    expected = {t: hashlib.sha256(pte).hexdigest() for t, pte in library_ptes(spec).items()}
    assert results["cold"]["ptes"] == expected, f"{spec}: the cold flow's .pte is not the library's"
    recompute = results["recompute"]
    assert recompute["deleted"] >= len(DELEGATE_STAGES)
    assert set(recompute["ran"]) >= set(DELEGATE_STAGES), f"not every stage recomputed: {recompute['ran']}"
    assert not recompute["new_objects"], (
        f"{spec}: recomputing every stage in a new process from stored inputs wrote "
        f"{len(recompute['new_objects'])} artifacts the first process did not"
    )
    assert recompute["ptes"] == expected, f"{spec}: the recomputed flow's .pte is not the library's"


#: (model, the middle stage that fails, whether live objects survive until the resume)
FAULT_CASES = [
    ("examples.hf_models:resnet", "adjust", True),
    ("examples.hf_models:bert", "build_programs", False),
    ("examples.models:lstm", "memory_plan", False),
    ("examples.models:cnn", "preprocess", True),
]


@pytest.mark.parametrize(
    "spec,stage,keep_live", FAULT_CASES, ids=[f"{s.split(':')[1]}-{st}" for s, st, _ in FAULT_CASES]
)
def test_resume_after_a_fault_publishes_the_library_bytes(spec, stage, keep_live, tmp_path):
    store = str(tmp_path / "store")
    stages.FAULTS.add(stage)
    with pytest.raises(ModelLoweringFailed, match=f"{stage}: InjectedFault") as failure:
        run_flow(spec, store)
    failed = {t for t, r in failure.value.manifest["targets"].items() if not r["ok"]}
    assert failed, "the fault failed no target"
    stages.FAULTS.clear()
    if not keep_live:
        stages.LIVE.clear()

    resumed, ran = run_flow(spec, store)
    assert_library_bytes(spec, published(resumed, store), f"resumed after a fault in {stage}")
    done_before = set(DELEGATE_STAGES[: DELEGATE_STAGES.index(stage)])
    assert not done_before & set(ran), f"stages finished before the fault ran again: {ran}"
    assert ran.get(stage, 0) >= 1 and ran["emit"] == len(failed)


@pytest.mark.parametrize("spec", HF_MODELS)
def test_the_library_programs_of_the_transformers_models_are_correct(spec):
    """The bytes every variant above compares with run and match eager (our executor, and
    ExecuTorch's runtime where it has the backends), so the flow's are correct too."""
    from lowering.verify import verify

    module, inputs = build(spec)
    for target, pte in library_ptes(spec).items():
        report = verify(pte, module, inputs).to_dict()
        assert report["ok"], f"{spec}/{target}: {report['checks']}"
        assert any(c["runtime"] == "lowerflow" and c["ok"] for c in report["checks"])


# --------------------------------------------------------------------------- the case, by hand


def test_fusing_the_reloaded_mobilenet_again_reproduces_the_plan(tmp_path):
    """Issue 7's failure, at the stage level: with 63 partitions the tagged program leaves
    the live-object cache, and adjust fused the program read back from the store."""
    store = ArtifactStore(str(tmp_path / "store"))
    program = stages.put_program(store, exported("examples.hf_models:mobilenet_v2"))
    tagged = stages.run_partition(store, program, "reference", {})
    assert len(tagged["partitions"]) > 60, "no longer a many-partition model"
    plan = stages.run_create_submodule(store, tagged["tagged"])["plan"]
    live_program, live_calls, _ = stages._fused(store, tagged["tagged"], plan)
    with stages.LIVE.disabled():
        stored_program, stored_calls, _ = stages._fused(store, tagged["tagged"], plan)
    assert [n.name for n in live_program.graph.nodes] == [n.name for n in stored_program.graph.nodes]
    assert {t: c.name for t, c in live_calls.items()} == {t: c.name for t, c in stored_calls.items()}


def test_a_plan_that_does_not_match_names_what_differs(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    program = stages.put_program(store, exported("examples.models:cnn"))
    tagged = stages.run_partition(store, program, "reference", {})["tagged"]
    plan_ref = stages.run_create_submodule(store, tagged)["plan"]
    plan = json.loads(store.get_bytes(plan_ref))
    tag = sorted(plan)[0]
    plan[tag]["inputs"] = list(reversed(plan[tag]["inputs"])) + ["x_from_elsewhere"]
    wrong = stages.put_doc(store, plan, "submodule_plan")
    with pytest.raises(RuntimeError, match=rf"partition '{tag}': fusing again does not reproduce the stored plan: inputs \["):
        stages._fused(store, tagged, wrong)


# --------------------------------------------------------------------------- the invariants behind it


def test_a_program_read_back_from_the_store_has_the_stored_nodes(tmp_path):
    """torch's deserializer adds a getitem for every output no getitem read (batch norm's
    saved statistics); the store's loader drops them, so nothing else sees them."""
    program = exported("examples.models:cnn")
    assert any(n.target is torch.ops.aten._native_batch_norm_legit_no_training.default for n in program.graph.nodes)
    store = ArtifactStore(str(tmp_path / "store"))
    back = store.get_program(store.put_program(program))
    assert [(n.name, n.op, str(n.target)) for n in back.graph.nodes] == [
        (n.name, n.op, str(n.target)) for n in program.graph.nodes
    ]


def test_fusion_names_do_not_depend_on_the_graphs_history():
    """A graph that once had (and erased) nodes named like the ones fusion creates fuses
    to the same names as a fresh copy of it, e.g. one read back from the store."""
    tagged = partition(exported("examples.models:cnn"), partitioner_for("reference")).tagged_exported_program
    fresh, used = copy_program(tagged), copy_program(tagged)
    graph = used.graph
    some = next(n for n in graph.nodes if n.op == "call_function")
    with graph.inserting_after(some):
        for name in ("getitem", "getitem", "fused_0", "getitem_1"):
            graph.erase_node(graph.create_node("call_function", torch.ops.aten.relu.default, (some,), name=name))
    tags = {n.meta[TAG] for n in tagged.graph.nodes if TAG in n.meta}
    create_submodules(fresh.graph_module, tags)
    create_submodules(used.graph_module, tags)
    assert [n.name for n in used.graph.nodes] == [n.name for n in fresh.graph.nodes]


def test_fused_calls_are_followed_by_their_getitems_in_index_order():
    """The order a stored program reads back in: otherwise BERT's delegated program planned
    its memory differently live and reloaded (other .pte bytes)."""
    tagged = partition(exported("examples.hf_models:bert"), partitioner_for("reference")).tagged_exported_program
    calls = create_submodules(tagged.graph_module, {n.meta[TAG] for n in tagged.graph.nodes if TAG in n.meta})
    assert any(len(getitems_of(call)) > 1 for call in calls.values())
    for tag, call in calls.items():
        following, node = [], call.next
        for _ in getitems_of(call):
            following.append(node)
            node = node.next
        assert following == getitems_of(call), f"{tag}: getitems not right after {call.name}"


def test_the_live_program_has_no_partition_tags_the_store_would_drop(tmp_path):
    """Partitioning stores the tagged program, whose digest is the untagged one's: the
    object kept live under it must not carry the tags (the next target's partitioner
    got them: 'tagged node ... with ReferenceBackend_1, which is not in partition_tags')."""
    store = ArtifactStore(str(tmp_path / "store"))
    program = stages.put_program(store, exported("examples.models:cnn"))
    tagged = stages.run_partition(store, program, "reference", {})
    assert tagged["program"].sha256 == program.sha256  # tags are not part of the stored program
    live = stages.get_program(store, program)
    assert not [n.name for n in live.graph.nodes if TAG in n.meta]
    again = stages.run_partition(store, program, "reference", {"supported_ops": ["aten.addmm.default"]})
    assert again["partitions"] == ["ReferenceBackend_0"]
