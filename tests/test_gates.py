"""Gates (issue 30): a program worse than the published one is not published.

The night's story, through the real ``lowerflow`` command (a process of its own, on the
session's Prefect server), one store: a model is lowered
and published; a deliberately slower variant of it (same name, the same layer applied 20
times) is refused by its latency gate, a bigger one (a 1 MB table it reads 8 rows of) by
its size gate — each exits 1 with one line naming the model, the target, the figure and
the ratio, and last night's files stay byte-identical; ``--accept-regressions`` publishes
the bigger one and says so.  The latency ratio comes from the benchmark stage, both programs
run interleaved on ExecuTorch's runtime in one process (×~5 here, far from the 1.5 gate).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flows.gates import Publisher, check_gates, gate_figures, gates_by_target
from flows.history import change_cell, history_lines, manifest_to_store
from flows.manifest import ManifestError, load_manifest
from tests.test_cli import assert_one_line_error, lowerflow

pytest.importorskip("executorch")

NET = """
import torch

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(64, 64)
        self.pad = torch.nn.Parameter(torch.randn({extra}, 64)) if {extra} else None

    def forward(self, x):
        for _ in range({repeat}):
            x = torch.relu(self.fc(x))
        return x if self.pad is None else x + self.pad[x.argmax(-1)]

def net():
    return Net(), (torch.randn(8, 64),)
"""


@pytest.fixture
def run(prefect_api, tmp_path):
    """``run(*args)``: ``lowerflow ARGS`` in a process of its own, in ``tmp_path``, on the
    session's Prefect server (an ephemeral server in each command would cost ~10 s of CPU)."""
    return lambda *args: lowerflow(*args, cwd=tmp_path, home=tmp_path / "home", api=prefect_api)


def published_files(store: Path) -> dict[str, bytes]:
    out = store / "outputs" / "net"
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name != "history.jsonl"}


def test_a_slower_and_a_bigger_program_are_refused_and_accepted_on_request(run, tmp_path):
    model, store = tmp_path / "net.py", tmp_path / "store"
    common = ["-t", "xnnpack", "--store", str(store), "-o", str(tmp_path / "out.pte")]
    model.write_text(NET.format(repeat=1, extra=0))
    first = run("lower", "net.py:net", *common, "--gates", '{"latency": 1.5, "size": 1.05}')
    assert first.returncode == 0, first.stderr  # a first lowering has nothing to compare: it passes
    night1 = published_files(store)
    assert {"xnnpack.pte", "manifest.json"} <= set(night1)

    model.write_text(NET.format(repeat=20, extra=0))  # slower, about as big
    slower = run("lower", "net.py:net", *common, "--gates", '{"latency": 1.5}')
    line = assert_one_line_error(slower, 1, "net: xnnpack: regressed: latency ×", "> 1.5")
    assert float(line.split("latency ×")[1].split()[0]) > 1.5
    assert published_files(store) == night1

    model.write_text(NET.format(repeat=1, extra=4096))  # a 1 MB table: bigger
    bigger = run("lower", "net.py:net", *common, "--gates", '{"size": 1.05}')
    assert_one_line_error(bigger, 1, "net: xnnpack: regressed: size ×", "> 1.05")
    assert published_files(store) == night1
    history = [json.loads(line) for line in (store / "outputs" / "net" / "history.jsonl").read_text().splitlines()]
    assert [h.get("regressed", False) for h in history] == [False, True, True]
    assert history[1]["change"]["latency"] > 1.5 and history[2]["change"]["size"] > 1.05

    accepted = run("lower", "net.py:net", *common, "--gates", '{"size": 1.05}', "--accept-regressions")
    assert accepted.returncode == 0, accepted.stderr
    assert "published although its gates refuse it (accepted): size ×" in accepted.stdout + accepted.stderr
    manifest = json.loads((store / "outputs" / "net" / "manifest.json").read_text())
    assert manifest["targets"]["xnnpack"]["accepted_regressions"][0].startswith("size ×")
    assert (store / "outputs" / "net" / "xnnpack.pte").read_bytes() == (tmp_path / "out.pte").read_bytes()
    assert published_files(store)["xnnpack.pte"] != night1["xnnpack.pte"]


def test_gate_settings_are_checked_per_target_and_in_the_manifest(tmp_path):
    assert gates_by_target({"latency": 1.1}, ["portable", "xnnpack"]) == {
        "portable": {"latency": 1.1}, "xnnpack": {"latency": 1.1}}
    assert gates_by_target({"xnnpack": {"size": 1.05}}, ["portable", "xnnpack"]) == {"xnnpack": {"size": 1.05}}
    with pytest.raises(ValueError, match=r"unknown gates \['latncy'\]"):
        gates_by_target({"latncy": 1.1}, ["portable"])
    (tmp_path / "m.py").write_text("import torch\ndef m():\n    return torch.nn.Linear(2, 2), (torch.randn(1, 2),)\n")
    doc = {"defaults": {"gates": {"latency": 1.2}, "benchmark": {"seconds": 0.1}},
           "models": [{"name": "a", "model": "m.py:m", "accept_regressions": True},
                      {"name": "b", "model": "m.py:m", "gates": {"portable": {"size": 1.0}}, "benchmark": False}]}
    (tmp_path / "fleet.json").write_text(json.dumps(doc))
    a, b = load_manifest(tmp_path / "fleet.json").models
    assert a.gates == {"portable": {"latency": 1.2}} and a.accept_regressions and a.benchmark == {"seconds": 0.1}
    assert b.gates == {"portable": {"size": 1.0}} and b.benchmark is False and not b.accept_regressions
    doc["models"][0]["gates"] = {"speed": 2}
    (tmp_path / "fleet.json").write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match=r"models\[0\] \('a'\): 'gates': unknown gates \['speed'\]"):
        load_manifest(tmp_path / "fleet.json")


def test_figures_of_a_quantized_program_and_the_change_cell():
    def record(size, sqnr, error, latency=None):
        check = {"runtime": "executorch", "ok": True, "accuracy": {"max_error": error, "sqnr_db": sqnr}}
        return {"ok": True, "pte": {"size": size, "sha256": "x", "uri": "u"}, "verify": {"ok": True, "checks": [check]},
                **({"benchmark": {"ratios": {"latency": latency}}} if latency else {})}

    figures = gate_figures(record(1000, 30.0, 0.01), {**record(1100, 27.5, 0.02, latency=0.97), "program_bytes": 1100})
    assert figures == {"size": 1.1, "latency": 0.97, "error": 2.0, "sqnr_drop_db": 2.5}
    assert check_gates("m", "xnnpack", figures, {"latency": 1.1, "size": 1.05, "sqnr_drop_db": 1.0}) == [
        "size ×1.10 > 1.05", "sqnr_drop_db +2.50 dB > 1"]
    assert change_cell({"change": figures}) == "latency ×0.97, size ×1.10, error ×2.00, sqnr -2.5 dB"
    assert change_cell({}) == "—"


def test_a_run_whose_every_target_regressed_leaves_the_manifest_alone(tmp_path):
    from tasks.store import ArtifactStore

    store = ArtifactStore(str(tmp_path))
    published = {"name": "m", "targets": {"portable": {"ok": True, "pte": None, "stages": []}}}
    store.put_json("m/manifest.json", published)
    tonight = {"name": "m", "targets": {"portable": {"ok": False, "regressed": {"size": 2.0}, "stages": []}}}
    assert manifest_to_store(tonight, Publisher(store)) is None
    two = {"name": "m", "targets": {**tonight["targets"], "xnnpack": {"ok": True, "pte": None, "stages": []}}}
    stored = manifest_to_store(two, Publisher(store))
    assert "portable" not in stored["targets"] and stored["targets"]["xnnpack"]["ok"]  # no published record to keep
    assert [line["regressed"] for line in history_lines(tonight)] == [True]


def test_reports_say_regressed_first_with_the_change_and_where_latency_was_measured(tmp_path):
    from flows.reports import fleet_report_markdown, fleet_rows, model_report_markdown
    from flows.report_pictures import png_size, trend_png
    from flows.trends import trend_images
    from tasks.store import ArtifactStore

    bench = {"figures": {"latency_ms": 0.5, "p90_ms": 1.2, "spread": 2.4, "load_ms": 0.3, "rounds": 40},
             "ratios": {"latency": 1.42}, "host": {"cpu": "Some CPU", "threads": 2}, "load_average": 9.5}
    regressed = {"ok": False, "regressed": {"latency": 1.42}, "change": {"latency": 1.42, "size": 1.0},
                 "error": "regressed: latency ×1.42 > 1.1", "stages": [], "benchmark": bench}
    fine = {"ok": True, "change": {"latency": 0.97, "size": 1.0}, "stages": []}
    summary = {"store": "memory://s", "ok": False, "failed": ["b"],
               "models": {"a": {"name": "a", "targets": {"portable": fine}},
                          "b": {"name": "b", "targets": {"xnnpack": regressed}}}}
    assert [(r["model"], r["ok"], r["change"]) for r in fleet_rows(summary)] == [
        ("b", "regressed", "latency ×1.42, size ×1.00"), ("a", "ok", "latency ×0.97, size ×1.00")]
    md = fleet_report_markdown(summary)
    # The change column (compact), regressions first; a quantized program's accuracy on a second line.
    assert "| b | xnnpack | regressed | lat ×1.42 · size ×1.00 |" in md
    assert md.index("| b | xnnpack |") < md.index("| a | portable | ok | lat ×0.97 · size ×1.00 |")
    quantized = {"change": {"latency": 1.0, "size": 0.5, "error": 2.0, "sqnr_drop_db": 2.5}}
    assert change_cell(quantized, compact=True) == "lat ×1.00 · size ×0.50\nerr ×2.00 · sqnr -2.5 dB"
    summary["models"]["a"]["targets"]["portable"] = {**fine, **quantized}
    assert "| a | portable | ok | lat ×1.00 · size ×0.50<br>err ×2.00 · sqnr -2.5 dB |" in fleet_report_markdown(summary)
    report = model_report_markdown({"name": "b", "targets": {"xnnpack": regressed}})
    assert "## xnnpack — regressed" in report
    assert "this host's CPU (Some CPU, 2 threads, load average 9.5); a device's latency differs" in report
    assert "spread 2.40 (p90/median): a loaded machine" in report and "vs published: latency ×1.42" in report
    # The trend picture: from the second night on, inlined in the model report.
    store = ArtifactStore(str(tmp_path))
    lines = [{"target": "xnnpack", "pte_bytes": 1000 + i, "latency_ms": 0.5, "spread": 1.1} for i in range(3)]
    store.put_named("b/history.jsonl", "".join(json.dumps(line) + "\n" for line in lines).encode(), "history")
    assert set(trend_images(store, {"name": "b", "targets": {"xnnpack": regressed}})) == {"xnnpack"}
    assert png_size(trend_png(lines, title="b / xnnpack")) == (800, 220)


def test_the_plan_lists_the_benchmark_stage_where_it_runs(run, tmp_path):
    (tmp_path / "net.py").write_text(NET.format(repeat=1, extra=0))
    (tmp_path / "fleet.yaml").write_text(
        "store: store\nmodels:\n"
        "  - {name: gated, model: net.py:net, targets: [portable], gates: {latency: 1.5}}\n"
        "  - {name: plain, model: net.py:net, targets: [portable]}\n")

    def plan() -> dict[str, list[str]]:
        out = run("plan", "fleet.yaml")
        assert out.returncode == 0, out.stderr
        return {line.split()[0]: line.split()[2:] for line in out.stdout.splitlines()
                if line.startswith(("gated ", "plain "))}

    # Cold: the gated model's stages end with the benchmark (its gate needs the latency); not the other's.
    assert plan() == {"gated": ["0/5", "export,", "memory_plan,", "emit,", "verify,", "benchmark"],
                      "plain": ["0/4", "export,", "memory_plan,", "emit,", "verify"]}
    night = run("fleet", "fleet.yaml")
    assert night.returncode == 0, night.stderr
    assert plan() == {"gated": ["5/5", "-"], "plain": ["4/4", "-"]}  # a warm night: the benchmark cached too


TWO_METHODS = """
import torch

def two():
    torch.manual_seed(0)
    encode = torch.nn.Sequential(torch.nn.Linear({inputs}, {width}), torch.nn.ReLU(), torch.nn.Linear({width}, 16))
    decode = torch.nn.Sequential(torch.nn.Linear(16, {width}), torch.nn.ReLU(), torch.nn.Linear({width}, 4))
    return {{"encode": (encode.eval(), (torch.randn(2, {inputs}),)), "decode": (decode.eval(), (torch.randn(2, 16),))}}
"""


def test_a_program_of_several_methods_is_benchmarked_method_by_method(run, tmp_path):
    from flows.reports import model_report_markdown

    model, store = tmp_path / "two.py", tmp_path / "store"
    args = ["lower", "two.py:two", "-t", "portable", "--store", str(store), "-o", str(tmp_path / "two.pte"),
            "--gates", '{"latency": 100}']
    def night(width: int, inputs: int = 16) -> dict:
        model.write_text(TWO_METHODS.format(width=width, inputs=inputs))
        done = run(*args)
        assert done.returncode == 0, done.stderr
        return json.loads((store / "outputs" / "two" / "manifest.json").read_text())["targets"]["portable"]

    night(8)
    record = night(24)
    bench = record["benchmark"]
    assert sorted(bench["methods"]) == ["decode", "encode"]
    each = bench["methods"].values()
    # A round is one call of each method; the program's ratio is its worst method's.
    assert bench["figures"]["latency_ms"] == pytest.approx(sum(r["figures"]["latency_ms"] for r in each), abs=1e-3)
    assert bench["ratios"]["latency"] == max(r["ratios"]["latency"] for r in each)
    assert record["change"]["latency"] == bench["ratios"]["latency"]
    assert [r["benchmark"]["figures"] for r in record["methods"].values()] == [r["figures"] for r in each]
    line = model_report_markdown({"name": "two", "targets": {"portable": record}})
    assert "per method: decode " in line and ", encode " in line
    # encode takes other inputs tonight: last night's program cannot run them; timed alone, said so.
    record = night(24, inputs=12)
    assert "ratios" not in record["benchmark"] and "latency" not in record["change"]
    assert record["benchmark"]["not_compared"].startswith("encode: the published program does not run tonight's calls")
    assert record["benchmark"]["methods"]["decode"]["ratios"]["latency"] > 0


def test_a_program_with_external_weights_is_benchmarked_with_them_and_gated_on_both_files(run, tmp_path):
    model, store = tmp_path / "net.py", tmp_path / "store"
    args = ["lower", "net.py:net", "-t", "portable", "--external-weights", "--store", str(store),
            "-o", str(tmp_path / "net.pte"), "--gates", '{"latency": 100, "size": 1.05}']
    model.write_text(NET.format(repeat=1, extra=0))
    assert run(*args).returncode == 0
    out = store / "outputs" / "net"
    night1 = {p: (out / p).read_bytes() for p in ("portable.pte", "portable.ptd")}
    # Retrained (other weights): the same .pte, another .ptd; benchmarked against the published pair.
    model.write_text(NET.format(repeat=1, extra=0).replace("manual_seed(0)", "manual_seed(1)"))
    retrained = run(*args)
    assert retrained.returncode == 0, retrained.stderr
    record = json.loads((out / "manifest.json").read_text())["targets"]["portable"]
    assert (out / "portable.pte").read_bytes() == night1["portable.pte"]
    assert (out / "portable.ptd").read_bytes() != night1["portable.ptd"]
    assert record["benchmark"]["ptd_bytes"] == record["ptd"]["size"] and record["benchmark"]["ratios"]["latency"] > 0
    assert record["change"]["size"] == 1.0
    # A 1 MB table in the .ptd: the size gate counts .pte + .ptd (the .pte alone barely grows).
    model.write_text(NET.format(repeat=1, extra=4096))
    bigger = run(*args)
    line = assert_one_line_error(bigger, 1, "net: portable: regressed: size ×", "> 1.05")
    assert float(line.split("size ×")[1].split()[0]) > 10
