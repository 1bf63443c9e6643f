"""The ``lowerflow`` command line, run as a real subprocess (``python -m flows.cli``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flows.cli import CLIError, error_message, output_path, stage_lines

REPO = Path(__file__).resolve().parents[1]
MLP = "examples/models.py:mlp"


def lowerflow(*args: str, cwd: Path = REPO, home: Path | None = None, timeout: float = 600,
              env: dict[str, str] | None = None, module: str = "flows.cli",
              api: str | None = None) -> subprocess.CompletedProcess:
    """Run ``lowerflow ARGS`` (or ``python -m <module> ARGS``) with no Prefect configuration
    (ephemeral server) but ``env``.

    ``home``: a PREFECT_HOME of its own, so the ephemeral server's database is not
    shared with other processes on the machine.
    ``api``: the Prefect API to use instead (the session's server, ``prefect_api``): a
    command that runs a flow starts no ephemeral server then, ~10 s of CPU less each.
    """
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "LOWERFLOW_"))}
    base["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    if home is not None:
        base["PREFECT_HOME"] = str(home)
    if api is not None:
        base["PREFECT_API_URL"] = api
    base["PYTHONPATH"] = str(REPO)
    base.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd, env=base, capture_output=True, text=True, timeout=timeout,
    )


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("lowerflow: error:")]


def assert_one_line_error(result: subprocess.CompletedProcess, code: int, *fragments: str) -> str:
    assert result.returncode == code, result.stderr
    lines = error_lines(result.stderr)
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def mlp_pte(tmp_path_factory) -> Path:
    """A .pte of the MLP made by lowering.lower (no flows)."""
    from examples.models import mlp
    from lowering import lower

    path = tmp_path_factory.mktemp("pte") / "mlp.pte"
    path.write_bytes(lower(*mlp()).pte)
    return path


# --------------------------------------------------------------------------- in-process helpers


def test_output_path_templates(tmp_path):
    assert output_path("out.pte", "mlp", "portable", several=False) == Path("out.pte")
    assert output_path("{name}-{target}.pte", "mlp", "reference", several=True) == Path("mlp-reference.pte")
    assert output_path(str(tmp_path), "mlp", "portable", several=False) == tmp_path / "mlp.portable.pte"
    assert output_path("dist/", "cnn", "reference", several=False) == Path("dist/cnn.reference.pte")
    assert output_path("dist", "cnn", "reference", several=True) == Path("dist/cnn.reference.pte")
    with pytest.raises(CLIError, match="several targets"):
        output_path("out.pte", "mlp", "portable", several=True)
    with pytest.raises(CLIError, match="only {name} and {target}"):
        output_path("{model}.pte", "mlp", "portable", several=False)


def test_stage_lines_say_cached_ran_or_failed():
    lines = stage_lines("portable", [
        {"stage": "export", "cached": True, "seconds": 0.01, "state": "Cached", "bytes": 2258},
        {"stage": "emit", "cached": False, "seconds": 1.5, "state": "Completed", "bytes": None},
        {"stage": "verify", "cached": False, "seconds": 0.25, "state": "Failed", "bytes": None},
    ])
    assert [line.split()[:4] for line in lines] == [
        ["portable", "export", "cached", "0.01"],
        ["portable", "emit", "ran", "1.50"],
        ["portable", "verify", "FAILED", "0.25"],
    ]
    assert lines[0].endswith("2,258 B")


def test_error_message_is_one_line():
    assert error_message(ValueError("first\nsecond")) == "ValueError: first"
    assert error_message(CLIError("bad -o")) == "bad -o"
    assert error_message(KeyError()) == "KeyError"


# --------------------------------------------------------------------------- subprocess


def test_help_lists_the_subcommands():
    result = lowerflow("--help")
    assert result.returncode == 0, result.stderr
    for command in ("lower", "fleet", "plan", "verify"):
        assert command in result.stdout
    sub = lowerflow("verify", "--help")
    assert sub.returncode == 0 and "--model" in sub.stdout


def test_no_subcommand_is_a_usage_error():
    assert_one_line_error(lowerflow(), 2, "required: COMMAND")


def test_verify_a_pte_made_by_lower(mlp_pte):
    result = lowerflow("verify", str(mlp_pte), "--model", MLP)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[:3] == ["lowerflow", "ok", "max"]
    assert all(line.split()[1] in ("ok", "skipped") for line in lines)
    assert not error_lines(result.stderr)


def test_verify_mismatch_exits_1(mlp_pte, tmp_path):
    other = tmp_path / "other_mlp.py"
    other.write_text(textwrap.dedent(
        """
        import torch
        from examples.models import MLP

        def mlp():
            torch.manual_seed(1)  # other weights, same shapes
            return MLP().eval(), (torch.randn(4, 64),)
        """
    ))
    result = lowerflow("verify", str(mlp_pte), "--model", f"{other}:mlp")
    assert_one_line_error(result, 1, "does not match", "lowerflow")
    assert "MISMATCH" in result.stdout


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("not a spec", "expected 'path/file.py:factory'"),
        ("examples/missing.py:mlp", "cannot read 'examples/missing.py'"),
        ("examples/models.py:nope", "has no factory 'nope'"),
    ],
)
def test_verify_bad_spec_exits_2_with_one_line(mlp_pte, spec, fragment):
    assert_one_line_error(lowerflow("verify", str(mlp_pte), "--model", spec), 2, f"model spec {spec!r}", fragment)


def test_verify_missing_file(tmp_path):
    missing = tmp_path / "missing.pte"
    assert_one_line_error(lowerflow("verify", str(missing), "--model", MLP), 2, "cannot read", "missing.pte")


def test_debug_prints_the_traceback(mlp_pte):
    result = lowerflow("verify", str(mlp_pte), "--model", "not a spec", "--debug")
    assert result.returncode == 2
    assert "Traceback" in result.stderr and len(error_lines(result.stderr)) == 1


def test_lower_bad_spec_fails_before_any_flow_runs(tmp_path):
    bad = lowerflow("lower", "missing.py:mlp", "-o", str(tmp_path / "x.pte"), "--store", str(tmp_path / "store"))
    assert_one_line_error(bad, 2, "model spec 'missing.py:mlp'")
    assert not (tmp_path / "store").exists()
    several = lowerflow("lower", MLP, "-t", "portable", "-t", "reference", "-o", str(tmp_path / "x.pte"))
    assert_one_line_error(several, 2, "several targets")
    unknown = lowerflow("lower", MLP, "-t", "nowhere", "--store", str(tmp_path / "store"))
    assert_one_line_error(unknown, 2, "--target: unknown target 'nowhere'", "(targets: portable, coreml, ethos-u, openvino, qnn, reference, vulkan, xnnpack)")
    assert not (tmp_path / "store").exists()


def test_bad_manifest_exits_2(tmp_path):
    manifest = tmp_path / "fleet.yaml"
    manifest.write_text(f"models:\n  - name: a\n    model: {REPO}/examples/models.py:mlp\n    targets: [nowhere]\n")
    for command in ("fleet", "plan"):
        assert_one_line_error(lowerflow(command, str(manifest)), 2, "models[0] ('a')", "nowhere")
    assert_one_line_error(lowerflow("fleet", str(tmp_path / "absent.yaml")), 2, "does not exist")


def test_console_script_is_declared():
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["lowerflow"] == "flows.cli:main"
    assert any(d.startswith("pillow") for d in project["dependencies"])  # the memory-plan pictures


def test_fleet_progress_prints_a_line_per_finished_model():
    import logging

    from flows.fleet_progress import FleetProgress

    lines: list[str] = []
    progress = FleetProgress({"mlp": {"portable", "reference"}, "cnn": {"portable"}}, lines.append)
    logger = logging.getLogger("prefect.task_runs")
    with progress.listening():
        logger.info("%s/%s %-16s %-9s %.3fs", "mlp", "portable", "export", "cached", 0.01)  # a stage line
        logger.info("%s/%s %s", "mlp", "portable", "ok")
        logger.info("%s/%s %s", "other", "portable", "ok")  # not in the manifest
        logger.info("%s/%s %s", "cnn", "portable", "FAILED export: ValueError: no")
        logger.info("%s/%s %s", "mlp", "reference", "ok")
    logger.info("%s/%s %s", "cnn", "portable", "ok")  # after: not listening
    assert [line.split()[:3] for line in lines] == [["[1/2]", "cnn", "FAILED"], ["[2/2]", "mlp", "ok"]]
    assert progress not in logging.getLogger(FleetProgress.LOGGER).handlers


# --------------------------------------------------------------------------- flows (ephemeral Prefect server)


def test_lower_writes_each_target_then_reruns_from_cache(tmp_path):
    store, out = tmp_path / "store", tmp_path / "out"
    args = ("lower", "examples/models.py:buffer_mutation", "-t", "portable", "-t", "reference",
            "-o", str(out), "--store", str(store))
    home = tmp_path / "prefect-home"
    first = lowerflow(*args, home=home)
    assert first.returncode == 0, first.stderr
    assert not error_lines(first.stderr) and "Traceback" not in first.stderr
    for target in ("portable", "reference"):
        assert f"{target}: wrote {out / f'buffer_mutation.{target}.pte'}" in first.stdout
    stages = [line.split() for line in first.stdout.splitlines() if not line.split()[0].endswith(":")]
    assert {s[0] for s in stages} == {"portable", "reference"}
    assert [s[1] for s in stages if s[0] == "portable"] == ["export", "memory_plan", "emit", "verify"]  # no gates: no benchmark stage
    assert "partition" in [s[1] for s in stages if s[0] == "reference"]
    second = lowerflow(*args, home=home)
    assert second.returncode == 0, second.stderr
    rerun = [line.split() for line in second.stdout.splitlines() if not line.split()[0].endswith(":")]
    assert rerun and all(s[2] == "cached" for s in rerun), second.stdout
    # What `lower` wrote runs and matches the eager model.
    checked = lowerflow("verify", str(out / "buffer_mutation.reference.pte"), "--model", "examples/models.py:buffer_mutation")
    assert checked.returncode == 0, checked.stderr


def test_fleet_reports_progress_and_failures_then_plan_shows_the_cache(tmp_path, prefect_api):
    (tmp_path / "broken.py").write_text("def broken():\n    raise RuntimeError('no model today')\n")
    manifest = tmp_path / "fleet.yaml"
    manifest.write_text(textwrap.dedent(
        f"""
        store: {tmp_path / 'store'}
        defaults: {{targets: [portable]}}
        models:
          - name: mlp
            model: {REPO}/examples/models.py:mlp
          - name: broken
            model: broken.py:broken
        """
    ))
    home = tmp_path / "prefect-home"
    fleet = lowerflow("fleet", str(manifest), home=home, api=prefect_api)  # (the ephemeral server: the tests above and below)
    assert_one_line_error(fleet, 1, "1 of 2 models failed: broken")
    out = fleet.stdout.splitlines()
    progress = sorted(line.split()[1:3] for line in out if line.startswith("["))
    assert progress == [["broken", "FAILED"], ["mlp", "ok"]]
    rows = {line.split()[0]: line.split() for line in out if line.split()[:1] in (["mlp"], ["broken"])}
    assert rows["mlp"][1:3] == ["portable", "ok"] and rows["mlp"][5] == "0/4"  # no gates: no benchmark stage
    assert rows["broken"][2] == "FAILED" and "load: ModelSpecError" in " ".join(rows["broken"])

    plan = lowerflow("plan", str(manifest), home=home)  # validates and loads as fleet does: the same line
    assert assert_one_line_error(plan, 1, "1 of 2 models failed: broken") == error_lines(fleet.stderr)[0]
    rows = {line.split()[0]: line.split() for line in plan.stdout.splitlines() if line.split()[:1] in (["mlp"], ["broken"])}
    assert rows["mlp"][1:] == ["portable", "4/4", "-"]
    assert rows["broken"][1:5] == ["portable", "0/1", "cannot", "run:"] and "load: ModelSpecError" in " ".join(rows["broken"])
    assert "4 of 5 stages cached, 1 to run" in plan.stdout


# --------------------------------------------------------------------------- demo fleet and deployment files


def test_demo_fleet_manifest():
    from flows.manifest import load_manifest

    fleet = load_manifest(REPO / "examples" / "fleet.yaml")
    assert fleet.store == str(REPO / ".lowerflow")  # the CLI's default store when run from the repo root
    assert [m.name for m in fleet.models] == ["mlp", "cnn", "cnn-int8", "lstm", "transformer", "buffer_mutation"]
    for entry in fleet.models:
        if entry.name == "cnn-int8":  # the quantized one
            assert entry.targets == ("portable", "xnnpack") and entry.min_sqnr == 25
            assert dict(entry.quantize) == {t: {"recipe": "int8", "keep_fp32": []} for t in entry.targets}
            assert entry.calibration == f"{REPO / 'examples' / 'models.py'}:cnn_calibration"
            continue
        xnnpack = ("xnnpack",) if entry.name in ("mlp", "cnn") else ()
        assert entry.targets == ("portable", "reference", *xnnpack)
        assert entry.model == f"{REPO / 'examples' / 'models.py'}:{entry.name}"


def test_demo_imports_only_flows():
    import ast

    tree = ast.parse((REPO / "examples" / "demo.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
    ours = {m.split(".")[0] for m in imported} - {"__future__", "sys", "pathlib"}
    assert ours == {"flows"}


def test_nightly_deployment_declaration():
    import yaml
    from prefect.client.schemas.schedules import CronSchedule
    from prefect.flows import load_flow_from_entrypoint

    doc = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())
    fleet, member = doc["deployments"]
    assert fleet["name"] == "nightly-fleet" and fleet["work_pool"]["name"] == "lowerflow-pool"
    (schedule,) = fleet["schedules"]
    CronSchedule(cron=schedule["cron"], timezone=schedule["timezone"])  # raises if invalid
    assert schedule["timezone"] == "UTC"
    # The fleet's models run as lower-model/<pool>: the second deployment, named after the pool.
    pool = fleet["parameters"]["pool"]
    assert member["name"] == pool == member["work_pool"]["name"]
    # Paths are relative to the repo root, where `prefect deploy` runs.
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        flows = [load_flow_from_entrypoint(d["entrypoint"]) for d in (fleet, member)]
    finally:
        os.chdir(cwd)
    assert [f.name for f in flows] == ["lower-fleet", "lower-model"]
    assert (REPO / fleet["parameters"]["manifest"]).is_file()


# --------------------------------------------------------------------------- first run, quiet console


def test_first_run_gives_the_ephemeral_server_time_and_a_user_setting_wins():
    code = ("import os; from flows.cli import configure_environment; configure_environment(False); "
            "print(os.environ['PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS'])")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    default = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert default.stdout.strip() == "180"
    mine = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          env={**env, "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "45"})
    assert mine.stdout.strip() == "45"
    # Importing the flows package first does the same for Python users.
    flows_first = subprocess.run(
        [sys.executable, "-c", "import flows, prefect.settings as s; "
                               "print(s.PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value())"],
        cwd=REPO, env=env, capture_output=True, text=True)
    assert flows_first.stdout.strip() == "180", flows_first.stderr


def test_a_server_that_does_not_start_in_time_is_one_line_saying_what_to_do(tmp_path):
    """What a newcomer met on a busy machine: now one line naming the setting to raise.
    (A 1-second budget on a fresh PREFECT_HOME reproduces the time-out for certain.)"""
    slow = {"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "1"}
    result = lowerflow("lower", MLP, "-o", str(tmp_path / "x.pte"), "--store", str(tmp_path / "store"),
                       home=tmp_path / "home", env=slow)  # a fresh store: nothing cached, the server is needed
    line = assert_one_line_error(result, 1, "did not start in time", "STARTUP_TIMEOUT_SECONDS=1",
                                 "prefect server start")
    assert "--debug" in line and not (tmp_path / "x.pte").exists()
    demo = lowerflow(home=tmp_path / "home2", env=slow, module="examples.demo")
    assert demo.returncode == 1 and "Traceback" not in demo.stderr
    assert [l for l in demo.stderr.splitlines() if l.strip()][-1].startswith("demo: error: Prefect's temporary API")


#: A Prefect ephemeral server that takes this long to start (sleeping: no CPU) needs
#: more than Prefect's 20-s default and less than lowerflow's 180 s.
SLOW_START = 30


def test_a_slow_ephemeral_server_gets_lowerflows_timeout_even_if_prefect_came_first(tmp_path):
    """The nightly run on a busy machine: the temporary server takes 30 s to start.  The
    CLI is run by a script that imported Prefect first (as a profiling wrapper did: Prefect
    had read its settings, so its 20 s held although the environment said 180, and the run
    failed after ~25 s with a hint naming 180).  It lowers (fresh stores: nothing cached);
    a user's own small timeout still ends in the one-line hint naming that timeout."""
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(f"""
        import os, time
        if os.environ.get("PREFECT__SERVER_EPHEMERAL") == "1":  # only Prefect's server process
            time.sleep({SLOW_START})
    """))
    (tmp_path / "prefect_first.py").write_text(
        "import runpy, prefect  # noqa: F401\nrunpy.run_module('flows.cli', run_name='__main__', alter_sys=True)\n")
    slow = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    ok = lowerflow("lower", MLP, "-o", str(tmp_path / "x.pte"), "--store", str(tmp_path / "store"),
                   home=tmp_path / "home", env=slow, module="prefect_first")
    assert ok.returncode == 0, ok.stderr
    assert (tmp_path / "x.pte").stat().st_size > 0
    mine = {**slow, "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "5"}
    failed = lowerflow("lower", MLP, "-o", str(tmp_path / "y.pte"), "--store", str(tmp_path / "store2"),
                       home=tmp_path / "home2", env=mine, module="prefect_first")
    assert_one_line_error(failed, 1, "did not start in time", "STARTUP_TIMEOUT_SECONDS=5)")
    assert not (tmp_path / "y.pte").exists()


def test_console_shows_only_lowerflow_lines_unless_verbose(tmp_path):
    """A wrong-shape model beside a good one: torch's fake-tensor traceback, torchao's and
    the oracle's import noise stay off the console; --verbose brings them back."""
    (tmp_path / "models.py").write_text(textwrap.dedent("""
        import torch

        def wrong():
            return torch.nn.Linear(4, 3), (torch.randn(2, 5),)

        class Recurrent(torch.nn.Module):  # torch.export warns about the LSTM's _flat_weights
            def __init__(self):
                super().__init__()
                self.lstm = torch.nn.LSTM(4, 3, batch_first=True)

            def forward(self, x):
                return self.lstm(x)[0]

        def good():
            torch.manual_seed(0)
            return Recurrent(), (torch.randn(1, 2, 4),)
        """))
    (tmp_path / "fleet.yaml").write_text(
        "store: ./store\nmodels:\n  - {model: models.py:wrong}\n  - {model: models.py:good}\n")
    quiet = lowerflow("fleet", "fleet.yaml", cwd=tmp_path, home=tmp_path / "home")
    line = assert_one_line_error(quiet, 1, "1 of 2 models failed: wrong", "fails on its example inputs ((2, 5) float32)")
    assert [l for l in quiet.stderr.splitlines() if l.strip()] == [line], quiet.stderr  # nothing else at all
    assert "[2/2]" in quiet.stdout and "good" in quiet.stdout
    loud = lowerflow("fleet", "fleet.yaml", "--verbose", cwd=tmp_path, home=tmp_path / "home")
    assert loud.returncode == 1 and "fake_tensor" in loud.stderr


def test_quiet_console_mutes_torch_handlers_never_the_process_root_handlers():
    """``quiet_console`` silences torch's own stderr handlers; a handler the root logger has too
    (an embedding process's, e.g. pytest's log capture, which torch's loggers may share) keeps
    working: muting it silenced lowerflow's warnings for the rest of an in-process session."""
    import logging

    from flows.console import quiet_console

    shared, torch_own = logging.Handler(), logging.Handler()
    root, torch_logger = logging.getLogger(), logging.getLogger("torch._lowerflow_probe")
    root.addHandler(shared)
    torch_logger.addHandler(shared)
    torch_logger.addHandler(torch_own)
    try:
        quiet_console(False)
        assert shared.filters == []
        record = logging.LogRecord("torch._lowerflow_probe", logging.WARNING, __file__, 1, "x", None, None)
        assert not torch_own.filter(record) and shared.filter(record)
    finally:
        root.removeHandler(shared)
        torch_logger.removeHandler(shared)
        torch_logger.removeHandler(torch_own)
