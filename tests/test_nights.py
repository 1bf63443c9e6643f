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
    [line] = [l for l in text.splitlines() if "S3FileSystem().mkdir(" in l]
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
