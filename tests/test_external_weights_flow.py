"""Issue 29 through the flow: a fleet manifest with ``external_weights: true`` publishes
``<target>.pte`` + ``<target>.ptd``, byte for byte what ``lowering.lower(...,
external_weights=True)`` returns; the manifest says which ``.ptd`` each ``.pte`` needs
(with the sha256 of each); verify ran the pair on both runtimes; the option off keeps
every stage key; ``lowerflow lower --external-weights`` writes both files and
``lowerflow verify x.pte --data x.ptd`` checks the pair (one line, exit 2, when wrong)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from flows.cli import EXIT_USAGE, CLIError, check_program_data
from flows.lower_fleet import lower_fleet
from flows.manifest import ManifestError, external_by_target
from lowering import lower
from lowering.targets import partitioner_for
from tasks import stages
from tests._lowering import executions_during
from tests.test_cli import assert_one_line_error, lowerflow

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "examples" / "models.py"
TARGETS = ("portable", "xnnpack")

pytestmark = pytest.mark.usefixtures("fresh_stages")


def fleet(store, external=True):
    entry = {"name": "cnn", "model": f"{MODELS}:cnn"}
    if external is not None:
        entry["external_weights"] = external
    return {"store": str(store), "defaults": {"targets": list(TARGETS)}, "models": [entry]}


def published(ref: dict) -> bytes:
    return Path(ref["uri"].removeprefix("file://")).read_bytes()


def test_fleet_publishes_the_pair_equal_to_the_library(tmp_path):
    from examples.models import cnn

    summary, ran = executions_during(lower_fleet, fleet(tmp_path / "store"))
    assert summary["ok"], summary
    targets = summary["models"]["cnn"]["targets"]
    for target in TARGETS:
        entry = targets[target]
        assert entry["ok"] and entry["external_weights"], entry["error"]
        pte, ptd = published(entry["pte"]), published(entry["ptd"])
        assert entry["pte"]["needs"] == f"{target}.ptd"
        assert entry["pte"]["sha256"] == hashlib.sha256(pte).hexdigest()
        assert entry["ptd"]["sha256"] == hashlib.sha256(ptd).hexdigest()
        library = lower(*cnn(), partitioner=partitioner_for(target), external_weights=True)
        assert pte == library.pte and ptd == library.ptd, target  # flow = library, both files
        runtimes = {c["runtime"] for c in entry["verify"]["checks"] if c["ok"]}
        assert runtimes == {"lowerflow", "executorch"}, entry["verify"]
    # warm: nothing runs again
    _, again = executions_during(lower_fleet, fleet(tmp_path / "store"))
    assert sum(again.values()) == 0, dict(again)


def test_the_option_off_keeps_every_stage_key(tmp_path):
    """The keys of a run without the option are those of a run that never heard of it."""
    store = tmp_path / "store"
    lower_fleet(fleet(store, external=None))
    _, ran = executions_during(lower_fleet, fleet(store, external=False))
    assert sum(ran.values()) == 0, dict(ran)
    _, ran = executions_during(lower_fleet, fleet(store, external=["xnnpack"]))
    # on: keyed on the model's structure (flows/weights_only.py), from export on; portable's keys stay
    assert ran["emit"] == 1 and ran["partition"] == 1 and ran["export"] == 1 and ran["verify"] == 1, dict(ran)


def test_external_weights_setting_is_validated():
    assert external_by_target(True, ["portable", "xnnpack"]) == {"portable": True, "xnnpack": True}
    assert external_by_target({"xnnpack": True, "portable": False}, ["portable", "xnnpack"]) == {"xnnpack": True}
    assert external_by_target(False, ["portable"]) is None
    with pytest.raises(ManifestError, match="names targets not lowered: \\['reference'\\]"):
        external_by_target(["reference"], ["portable"])
    with pytest.raises(ManifestError, match="must be true, false"):
        external_by_target("yes", ["portable"])


def test_cli_lower_writes_both_files_and_verify_checks_the_pair(tmp_path, prefect_api):
    out = tmp_path / "out"
    result = lowerflow("lower", "examples/models.py:mlp", "-t", "xnnpack", "--external-weights", "-o", str(out) + "/",
                       "--store", str(tmp_path / "store"), "--verify", "off", home=tmp_path / "prefect",
                       api=prefect_api)  # the session's server: no ephemeral one to start
    assert result.returncode == 0, result.stderr
    pte, ptd = out / "mlp.xnnpack.pte", out / "mlp.xnnpack.ptd"
    assert pte.exists() and ptd.exists() and "the weights mlp.xnnpack.pte needs" in result.stdout
    ok = lowerflow("verify", str(pte), "--data", str(ptd))
    assert ok.returncode == 0 and "every weight it needs is in" in ok.stdout, ok.stderr
    assert_one_line_error(lowerflow("verify", str(pte), "--model", "examples/models.py:mlp"), 2,
                          "needs external data", "no .ptd was given")
    # the other bad pairs, in this process: one line, exit 2, before any runtime loads them
    other = tmp_path / "other.ptd"
    other.write_bytes(lower(torch.nn.Linear(3, 2).eval(), (torch.randn(1, 3),), external_weights=True).ptd)
    for data, fragment in ((tmp_path / "nope.ptd", "cannot read"), (other, "the data of another program"),
                           (pte, "not an ExecuTorch data file")):
        with pytest.raises(CLIError, match=fragment) as info:
            check_program_data(str(pte), str(data))
        assert info.value.code == EXIT_USAGE and "\n" not in str(info.value)


def test_stage_versions_did_not_move():
    """The option is in the keys of partition / emit / verify only when on (STAGE_OPTIONAL)."""
    for stage in ("partition", "emit", "emit_methods", "lower_control_flow"):
        assert "external_weights" in stages.STAGE_OPTIONAL[stage]
    assert "ptd" in stages.STAGE_OPTIONAL["verify"] and "ptd" in stages.STAGE_OPTIONAL["verify_sequence"]


def test_a_retrain_publishes_the_same_pte_and_says_what_a_device_downloads(tmp_path):
    """Same code, new weights (the factory reads its seed from a file): the manifest says
    ``changed: [weights]``; the .pte is unchanged, so a device downloads the .ptd only."""
    (tmp_path / "seed.txt").write_text("1")
    (tmp_path / "retrained.py").write_text(
        "import pathlib\nimport torch\nfrom examples.models import MLP\n\n\n"
        "def model():\n"
        "    torch.manual_seed(int((pathlib.Path(__file__).parent / 'seed.txt').read_text()))\n"
        "    m = MLP().eval()\n"
        "    torch.manual_seed(0)\n"
        "    return m, (torch.randn(4, 64),)\n")
    manifest = {"store": str(tmp_path / "store"), "defaults": {"targets": ["xnnpack"]},
                "models": [{"name": "m", "model": f"{tmp_path / 'retrained.py'}:model", "external_weights": True}]}
    first = lower_fleet(manifest)["models"]["m"]
    assert first["targets"]["xnnpack"]["update"]["program"] == "new"
    (tmp_path / "seed.txt").write_text("2")
    second = lower_fleet(manifest)["models"]["m"]
    entry, before = second["targets"]["xnnpack"], first["targets"]["xnnpack"]
    assert second["changed"] == ["weights"]
    assert entry["pte"]["sha256"] == before["pte"]["sha256"] and entry["ptd"]["sha256"] != before["ptd"]["sha256"]
    assert entry["update"] == {"program": "unchanged", "download_bytes": entry["ptd"]["size"],
                               "whole_bytes": entry["ptd"]["size"] + entry["pte"]["size"]}
    from flows.reports import target_section

    assert ".ptd only (the program is unchanged)" in target_section("xnnpack", entry)
