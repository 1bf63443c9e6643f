"""Unattended nights (issue 23), the parts that need no deployment:

* every command in deployments/README.md's code blocks exists as written: ``prefect``
  commands resolve to a command of the installed Prefect CLI (``prefect worker ls`` does
  not), ``lowerflow`` ones parse, ``server.sh`` ones name one of its subcommands;
* the bucket is created as the README's step 3 says, on a moto S3 server, with the
  environment its worker block sets (``AWS_ENDPOINT_URL_S3``, ``AWS_MAX_ATTEMPTS``);
* the nightly's manifest (examples/nightly-fleet.yaml) fails validation naming its
  placeholder until its store is set; the demo's keeps its local store;
* the automations' options are checked before anything reaches a server.

The deployment itself (automations installed, a lost worker, a timeout, a notification)
is tests/test_deployment.py's; server.sh and the systemd units are tests/test_server_sh.py's.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from flows.manifest import ManifestError, load_manifest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "deployments" / "README.md"
SERVER_SH_COMMANDS = {"start", "stop", "status", "db", "psql"}


def readme_commands() -> list[list[str]]:
    """The commands of the README's ```bash blocks, as argument lists (continuations
    joined, comments dropped, split at ``&&``, ``;``, ``|``, ``&``, loops unwrapped)."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
    commands = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            try:
                tokens = shlex.split(line, comments=True)
            except ValueError as exc:
                pytest.fail(f"deployments/README.md: cannot parse {line!r}: {exc}")
            tokens = [t for t in tokens if not re.match(r"\d*[<>]", t)]  # redirections (>log, 2>&1)
            command: list[str] = []
            for token in [*tokens, ";"]:
                if token in ("&&", ";", "|", "&", "||", "do", "done", "then", "fi") or token.endswith(";"):
                    if token.endswith(";") and token != ";":
                        command.append(token[:-1])
                    if command:
                        commands.append(command)
                    command = []
                elif not command and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", token):
                    continue  # VAR=value before a command
                elif not command and token in ("until", "while", "if", "!"):
                    continue  # the command of a loop's or a test's condition
                else:
                    command.append(token)
    return commands


def readme_inline_commands() -> list[list[str]]:
    """The `prefect ...`, `lowerflow ...` and `server.sh ...` spans of the README's prose."""
    prose = re.sub(r"```.*?```", "", README.read_text(), flags=re.S)
    spans = re.findall(r"`((?:prefect|lowerflow|deployments/server\.sh|server\.sh) [^`]*)`", prose)
    return [shlex.split(span.replace("\n", " ").replace("<", "").replace(">", "")) for span in spans]


def check_prefect_command(command: list[str]) -> None:
    from prefect.cli._app import _app

    words = [w for w in command[1:] if not w.startswith("-")]
    chain, apps, _ = _app.parse_commands(words)
    leaf = apps[-1]
    assert leaf.default_command is not None, f"`{shlex.join(command)}`: no such Prefect command " \
        f"(`prefect {' '.join(chain)}` has {sorted(n for n in leaf if not n.startswith('-'))})"


def test_readme_commands_exist_as_written():
    from flows.cli import build_parser

    parser = build_parser()
    subcommands = set(next(a for a in parser._actions if a.dest == "command").choices)
    checked = {"prefect": 0, "lowerflow": 0, "server.sh": 0}
    for command in readme_commands():
        program = Path(command[0]).name
        if program == "prefect":
            check_prefect_command(command)
        elif program == "lowerflow":
            try:
                parser.parse_args(command[1:])
            except SystemExit:
                pytest.fail(f"`{shlex.join(command)}`: lowerflow does not accept it")
        elif program == "server.sh":
            assert command[1] in SERVER_SH_COMMANDS, command
        checked[program] = checked.get(program, 0) + 1
    for command in readme_inline_commands():  # in the prose: the command itself exists
        program = Path(command[0]).name
        if program == "prefect":
            check_prefect_command(command)
        elif program == "lowerflow":
            assert command[1] in subcommands, command
        else:
            assert command[1] in SERVER_SH_COMMANDS, command
        checked[program] += 1
    assert checked["prefect"] >= 15 and checked["lowerflow"] >= 8 and checked["server.sh"] >= 5, checked


def test_the_prefect_command_check_can_fail():
    """The check above tells a Prefect command from a group (``prefect worker ls``)."""
    from prefect.cli._app import _app

    assert _app.parse_commands(["worker", "ls"])[1][-1].default_command is None
    assert _app.parse_commands(["flow-run", "retry", "0"])[1][-1].default_command is not None


def test_bucket_created_as_the_readme_says(s3_endpoint):
    import boto3

    from tests.conftest import S3_KEY, S3_SECRET

    text = README.read_text()
    lines = [l.strip() for l in text.splitlines() if "S3FileSystem().mkdir(" in l]
    assert len(set(lines)) == 1, lines  # step 3's, and the single-host trial's (the same)
    line = lines[0]
    create = shlex.split(line, comments=True)
    assert create[0] == "python3"
    bucket = re.search(r'mkdir\("([^"]+)"\)', line).group(1)
    # The worker block's environment (step 5): the endpoint of an S3-compatible store.
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_MAX_ATTEMPTS", "AWS_DEFAULT_REGION", "LOWERFLOW_LOCKS"):
        assert f"export {name}=" in text or f" {name}=" in text, name
    env = {**os.environ, "AWS_ACCESS_KEY_ID": S3_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET,
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL_S3": s3_endpoint, "AWS_MAX_ATTEMPTS": "2"}
    result = subprocess.run([sys.executable, *create[1:]], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1", aws_access_key_id=S3_KEY,
                      aws_secret_access_key=S3_SECRET)
    assert bucket in [b["Name"] for b in s3.list_buckets()["Buckets"]]


def test_nightly_manifest_needs_its_store_url(tmp_path):
    nightly = ROOT / "examples" / "nightly-fleet.yaml"
    with pytest.raises(ManifestError, match=r"'store' 's3://<your-bucket>/lowerflow/nightly' still has the "
                                            r"placeholder <your-bucket>: set it to your object store URL"):
        load_manifest(nightly)
    # Set, it is a manifest like any other, its models relative to examples/.
    text = nightly.read_text().replace("<your-bucket>", "night-bucket")
    configured = ROOT / "examples" / f".nightly-{os.getpid()}.yaml"
    configured.write_text(text)
    try:
        fleet = load_manifest(configured)
    finally:
        configured.unlink()
    assert fleet.store == "s3://night-bucket/lowerflow/nightly"
    assert [m.name for m in fleet.models] == ["mlp", "cnn", "lstm", "transformer", "buffer_mutation"]
    # The single-machine demo keeps its local store.
    assert load_manifest(ROOT / "examples" / "fleet.yaml").store == str((ROOT / ".lowerflow").resolve())
    with pytest.raises(ManifestError, match="'locks' .* placeholder <password>: set it to your Redis URL"):
        load_manifest({"store": "memory://x", "locks": "redis://:<password>@redis:6379/0",
                       "models": [{"name": "m", "model": "examples/models.py:mlp"}]})


def test_prefect_yaml_nightly_uses_the_several_machine_manifest():
    import yaml

    doc = yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())
    nightly, model = doc["deployments"]
    assert nightly["parameters"]["manifest"] == "examples/nightly-fleet.yaml"
    assert nightly["parameters"]["timeout_seconds"] < 24 * 3600  # ends before the next nightly
    for d in (nightly, model):
        assert d["work_pool"]["job_variables"]["env"]["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] == "30"


def test_automation_options_are_checked_first():
    from flows import automations

    with pytest.raises(automations.AutomationError, match="more than the heartbeat interval"):
        automations.zombie_automation(30)
    assert automations.zombie_automation(90).trigger.within.total_seconds() == 90
    with pytest.raises(automations.AutomationError, match="<block type slug>/<name>"):
        automations.notification_block_id(None, None, "just-a-name")
    with pytest.raises(automations.AutomationError, match="not an http"):
        automations.notification_block_id(None, "ftp://x", None)


# --------------------------------------------------------------------------- what a night says (issue 31)


def _failed(error: str | None = None, targets: dict | None = None) -> dict:
    return {"error": error, "targets": targets or {}} if error else {"targets": targets or {}}


def test_a_failed_fleet_says_one_cause_once_with_the_models_it_hit():
    from flows.nights import failure_message

    redis = ("cannot reach the stage locks' Redis redis://:***@127.0.0.1:6399/0: ConnectionError: Error 111; "
             "check that it is up and reachable (LOWERFLOW_LOCKS, or locks: in the manifest), then run again")
    summary = {"models": {"mlp": _failed(redis), "cnn": _failed(redis), "ok": {"targets": {}}},
               "failed": ["mlp", "cnn"]}
    assert failure_message(summary) == f"2 of 3 models failed: mlp, cnn; {redis}"
    # The fleet's own fleet.json write failing the same way is not said twice; another cause is.
    assert failure_message({**summary, "store_error": redis}).count(redis) == 1
    assert failure_message({**summary, "store_error": "cannot write fleet.json"}).endswith(
        " | mlp, cnn: " + redis + " | fleet.json: cannot write fleet.json")


def test_a_failed_fleet_names_its_first_causes_each_with_its_models():
    from flows.nights import MAX_CAUSES, failure_message

    verify = {"portable": {"ok": False, "error": "verify: RuntimeError: sensor offline"},
              "reference": {"ok": False, "error": "verify: RuntimeError: sensor offline"}}
    summary = {"models": {"a": _failed(targets=verify), "b": _failed("export: ValueError: bad shape"),
                          "c": _failed(targets=verify), "d": {"targets": {}}}, "failed": ["a", "b", "c"]}
    assert failure_message(summary) == ("3 of 4 models failed: a, b, c | a, c: verify: RuntimeError: sensor offline"
                                        " | b: export: ValueError: bad shape")
    many = {"models": {f"m{i}": _failed(f"error {i}") for i in range(MAX_CAUSES + 2)},
            "failed": [f"m{i}" for i in range(MAX_CAUSES + 2)]}
    assert failure_message(many).endswith(" | 2 more causes in outputs/fleet.json")
    # Timed-out models are said by the timeout clause, not again as a cause.
    stuck = {"models": {"stuck": _failed("timed out: the fleet waited 15 s …")}, "failed": ["stuck"],
             "timed_out": ["stuck"]}
    assert failure_message(stuck) == "1 of 1 models failed: stuck (timed out waiting for stuck)"


def test_models_a_lost_machine_took_share_one_cause():
    from flows.nights import failure_message, lost_run_error

    a = lost_run_error(3, "no heartbeat for 90 s: its worker or machine was lost (run 0b7a6c2e-1111-4e0f-9a7e-"
                          "2a1b3c4d5e6f)")
    b = lost_run_error(3, "no heartbeat for 90 s: its worker or machine was lost (run 9f7a6c2e-2222-4e0f-9a7e-"
                          "2a1b3c4d5e6f)")
    assert a == b and a.startswith("its worker or machine was lost (3 times; the model run ended Crashed: no heart")
    summary = {"models": {"x": _failed(a), "y": _failed(b)}, "failed": ["x", "y"]}
    assert failure_message(summary) == f"2 of 2 models failed: x, y; {a}"


def test_recovered_line():
    from flows.nights import recovered_line

    assert recovered_line({"ok": True}) is None
    assert recovered_line({"try": {"run_count": 2, "submitted": ["sensor"], "waited_for": [], "done_before": ["mlp"]}}) \
        == "completed by retry 1, 1 models re-run (sensor)"
    assert recovered_line({"try": {"run_count": 3, "submitted": [], "waited_for": ["orphan"]}}) \
        == "completed by retry 2, 0 models re-run; waited for 1 left running by the lost try (orphan)"


def test_night_lines_give_the_cause_and_the_whole_retry_command():
    import datetime
    import uuid

    from prefect.client.schemas.objects import FlowRun
    from prefect.states import Completed, Failed

    from flows.nights import night_lines

    start = datetime.datetime(2026, 11, 27, 2, 0, tzinfo=datetime.timezone.utc)
    failed = FlowRun(id=uuid.uuid4(), name="witty-owl", flow_id=uuid.uuid4(), start_time=start, run_count=1,
                     total_run_time=datetime.timedelta(seconds=35),
                     state=Failed(message="Flow run encountered an exception: FleetFailed: 1 of 2 models failed: "
                                          "sensor; verify: RuntimeError: sensor offline"))
    healed = FlowRun(id=uuid.uuid4(), name="calm-fox", flow_id=uuid.uuid4(), start_time=start, run_count=2,
                     total_run_time=datetime.timedelta(seconds=300), state=Completed())
    lines = night_lines([(failed, "nightly-fleet"), (healed, None)])
    assert lines[0] == ("2026-11-27 02:00  Failed                35 s  witty-owl (nightly-fleet)  1 of 2 models "
                        "failed: sensor; verify: RuntimeError: sensor offline")
    assert lines[1] == f"  next: prefect flow-run retry {failed.id}"
    assert lines[2].startswith("2026-11-27 02:00  Completed (try 2)    5 min  calm-fox") and lines[3] == f"  id: {healed.id}"


def test_the_notifications_say_the_cause_and_what_comes_next():
    """Rendered as the server renders them (Prefect's user templates)."""
    import uuid

    from prefect.server.utilities.user_templates import render_user_template_sync

    from flows import automations
    from flows.nights import cause_of

    run_id = uuid.uuid4()
    for state, message, expected in (
            ("Failed", "Flow run encountered an exception: FleetFailed: 1 of 2 models failed: sensor; verify: "
                       "RuntimeError: sensor offline", f"next: fix the cause, then: prefect flow-run retry {run_id}"),
            ("Crashed", "no heartbeat for 30 s: its fleet worker or machine was lost", "a retry is scheduled")):
        context = {"flow_run": {"id": run_id, "name": "witty-owl", "state": {"name": state, "message": message},
                                "parameters": {"manifest": "examples/nightly-fleet.yaml"}},
                   "deployment": {"name": "nightly-fleet"}}
        body = render_user_template_sync(automations.NOTIFICATION_BODY.replace("{{ flow_run|ui_url }}", ""), context)
        subject = render_user_template_sync(automations.NOTIFICATION_SUBJECT, context)
        assert f"ended {state}: {cause_of(message)}" in body and expected in body, body
        assert ("a retry is scheduled" in subject) == (state == "Crashed"), subject
    with pytest.raises(automations.AutomationError, match="more than a fleet run's heartbeat interval"):
        automations.fleet_zombie_automation(10)
    fleet = automations.fleet_zombie_automation(30)
    assert fleet.trigger.within.total_seconds() == 30 and fleet.trigger.match_related


# --------------------------------------------------------------------------- the single-host trial


def trial_blocks() -> list[list[str]]:
    """The lines of the ```bash blocks of the README's "Try it on one machine" section."""
    text = README.read_text()
    section = text[text.index("## Try it on one machine"):]
    section = section[:section.index("\n## ", 1)]
    return [block.strip().splitlines() for block in re.findall(r"```bash\n(.*?)```", section, re.S)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_single_host_trial_services_start_and_stop(tmp_path):
    """The trial's own services as its lines start them (on free ports, set in the
    variables the block reads; the API's port taken): the port check names the taken one, Redis
    answers with its password, the bucket is made on the S3 server, and each stop line
    stops its service.  The deploy extra has moto's server."""
    import shutil
    import socket
    import time
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "moto[server]" in extras["deploy"]
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    setup, stop = trial_blocks()
    assert setup[0].startswith("git clone") and "pip install -e '.[deploy]'" in setup[1]
    wanted = ("export PORT=", "python3 -c 'import socket", "export TRIAL=", "export REDIS_PASSWORD=", "redis-server ",
              "moto_server ", "export AWS_", "export LOWERFLOW_LOCKS=", "python3 -c 'import s3fs; s3fs.S3FileSystem().mkdir")
    lines = [l for l in setup if l.startswith(wanted)]
    assert len(lines) == 10, lines
    ports = []
    for _ in range(3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    python = sys.executable
    script = "\n".join(l.replace("python3 -c", f"{python} -c") for l in lines)
    script += (f"\n{python} -c 'import redis, os; print(\"redis:\", redis.Redis.from_url(os.environ[\"LOWERFLOW_LOCKS\"])"
               ".ping())'\n" + f"{python} -c 'import s3fs; print(\"buckets:\", s3fs.S3FileSystem().ls(\"\"))'\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "LOWERFLOW_", "REDIS"))}
    env.update(HOME=str(tmp_path), PATH=f"{Path(python).parent}:{env.get('PATH', '/usr/bin:/bin')}",
               PORT=str(taken.getsockname()[1]), REDIS_PORT=str(ports[0]), S3_PORT=str(ports[1]),
               LOWERFLOW_PG_PORT=str(ports[2]))  # the block's ports: the API's taken
    trial = tmp_path / ".lowerflow" / "trial"
    pids = []
    try:
        result = subprocess.run(["bash", "-ec", script], env=env, capture_output=True, text=True, timeout=120,
                                cwd=tmp_path)
        pids = [int((trial / f"{name}.pid").read_text()) for name in ("redis", "moto") if (trial / f"{name}.pid").exists()]
        assert result.returncode == 0, result.stdout + result.stderr
        out = result.stdout.splitlines()
        assert [l for l in out if l.startswith("port ")] == [f"port {taken.getsockname()[1]} is taken"], out
        assert "redis: True" in out and any("lowerflow-artifacts" in l for l in out if l.startswith("buckets:")), out
        assert len(pids) == 2 and all(_alive(p) for p in pids), pids
        kills = [l for l in stop if l.startswith("kill \"$(cat \"$TRIAL/")]
        assert len(kills) == 2, stop
        result = subprocess.run(["bash", "-ec", f"export TRIAL={trial}\n" + "\n".join(kills)], env=env,
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in pids if _alive(p)], "a service outlived its stop line"
    finally:
        taken.close()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
