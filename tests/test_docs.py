"""The README and the pages of docs/ say only what exists (deployments/README.md is
tests/test_nights.py's):

* every command of their ```bash blocks exists as written: ``lowerflow`` commands parse,
  ``prefect`` commands resolve to a command of the installed Prefect CLI, ``./run``
  commands name one of the script's subcommands (``bench`` one of bench/), ``python``
  scripts exist; ``lowerflow``, ``prefect`` and ``./run`` spans of the prose name an
  existing subcommand;
* ```python blocks compile; every relative link reaches a file, and its ``#anchor`` a
  heading of that file; every repository path in backticks exists;
* the README stays a front door (at most 200 lines), the reference lives in docs/.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tests.test_nights import check_prefect_command

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN_COMMANDS = {"demo", "test", "bench", "setup"}
#: Top-level directories whose paths a page may name in backticks.
REPO_DIRS = ("lowering/", "tasks/", "flows/", "tests/", "bench/", "examples/", "deployments/", "docs/", ".ci/")


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def bash_commands(text: str, where: str) -> list[list[str]]:
    """The commands of ```bash blocks, as argument lists (continuations joined, comments
    dropped, split at ``&&``, ``;``, ``|``, ``&``; ``VAR=value`` prefixes dropped)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            try:
                tokens = shlex.split(line, comments=True)
            except ValueError as exc:
                pytest.fail(f"{where}: cannot parse {line!r}: {exc}")
            command: list[str] = []
            for token in [*tokens, ";"]:
                if token in ("&&", ";", "|", "&", "||"):
                    if command:
                        commands.append(command)
                    command = []
                elif not command and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", token):
                    continue
                else:
                    command.append(token)
    return commands


def prose(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)


def inline_commands(text: str) -> list[list[str]]:
    """The `lowerflow ...`, `prefect ...` and `./run ...` spans of the prose."""
    spans = re.findall(r"`((?:lowerflow|prefect|\./run) [^`]*)`", prose(text))
    return [shlex.split(re.sub(r"[<>\[\]]", "", span.replace("\n", " ")).replace("|", " ")) for span in spans]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(h) for h in re.findall(r"^#+ (.*)$", prose(page.read_text()), re.M)}


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_commands_exist_as_written(page: Path):
    from flows.cli import build_parser

    parser = build_parser()
    subcommands = set(next(a for a in parser._actions if a.dest == "command").choices)
    benches = {p.stem.removeprefix("bench_") for p in (ROOT / "bench").glob("bench_*.py")}
    text = page.read_text()
    for command in bash_commands(text, page_id(page)):
        program = command[0]
        if program == "lowerflow":
            try:
                parser.parse_args(command[1:])
            except (SystemExit, Exception):  # lowerflow's parser raises CLIError
                pytest.fail(f"{page_id(page)}: `{shlex.join(command)}`: lowerflow does not accept it")
        elif program == "prefect":
            check_prefect_command(command)
        elif program == "./run":
            assert command[1] in RUN_COMMANDS, (page_id(page), command)
            if command[1] == "bench" and len(command) > 2:
                assert command[2] in benches, (page_id(page), command)
        elif program in ("python", "python3") and command[1].endswith(".py"):
            assert (ROOT / command[1]).is_file(), (page_id(page), command)
    for command in inline_commands(text):
        if command[0] == "lowerflow":
            assert command[1] in subcommands, (page_id(page), command)
        elif command[0] == "prefect":
            check_prefect_command(command)
        else:
            assert command[1] in RUN_COMMANDS, (page_id(page), command)
            if command[1] == "bench":
                for name in command[2:]:
                    assert name in benches, (page_id(page), command)


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_links_paths_and_python_blocks(page: Path):
    text = page.read_text()
    for block in re.findall(r"```python\n(.*?)```", text, re.S):
        compile(block, page_id(page), "exec")
    for target in re.findall(r"\]\(([^)\s]+)\)", prose(text)):
        if re.match(r"[a-z]+:", target):
            continue  # https://...
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page_id(page)}: link to {target} reaches nothing"
        if anchor:
            assert anchor in anchors(linked), f"{page_id(page)}: no heading #{anchor} in {path or page.name}"
    for span in re.findall(r"`([^`\s]+)`", prose(text)):
        path = span.rstrip(".,:;")
        if path.startswith(REPO_DIRS) and not re.search(r"[<>{}*?]", path):
            path = path.split("::")[0].split(":")[0]
            assert (ROOT / path).exists(), f"{page_id(page)}: `{span}` names no file of the repository"


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move reference into docs/<topic>.md"
    linked = set(re.findall(r"\]\(docs/([^)#]+)\)", "\n".join(lines)))
    assert {p.name for p in (ROOT / "docs").glob("*.md")} <= linked, "every docs/ page is linked from the README"
