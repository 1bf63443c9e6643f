"""The run reports as a person sees them: the Prefect UI in a real browser.

A ``prefect server start`` on 127.0.0.1 (its own PREFECT_HOME, a free port), two
nights of a real ``lowerflow fleet`` against it (the benchmark stage on; the second
night's model changed), then headless Debian Chromium, driven over the DevTools
protocol (``websockets``, which Prefect already depends on), opens the fleet artifact
in both UIs Prefect 3.8.8 serves (V1 at ``/``, V2 at ``/v2/``), follows the link of a
model's row, and checks that every image of the model artifact loaded
(``naturalWidth`` > 0: the memory-plan and the trend pictures), the fleet table shows
the change, delegation and verify cells of ``outputs/fleet.json`` and fits the page,
and names with underscores read as they are (no markdown escapes showing).  Then the
run view: the fleet run's page lists a child run per model, named after it, and
a model run's page lists its stage task runs as ``stage[model/target]``.
Screenshots of each page are written to ``$LOWERFLOW_UI_SCREENSHOTS`` (default:
the test's tmp dir).

Skipped when ``chromium`` is not installed (``.ci/run`` installs it).
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="chromium is not installed (Debian: apt-get install -y chromium); CI installs it in .ci/run",
)

#: Window of the headless browser: tall enough for a model artifact with two targets.
WINDOW = (1400, 2400)
#: The fleet's models: names with underscores (``_`` inside a word needs no markdown
#: escape; the ones around ``odd`` do, which V1 shows literally in a link's text).
MLP, BROKEN = "tiny_mlp", "broken._odd_"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without Prefect/lowerflow settings, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "LOWERFLOW_"))}
    env.update(PREFECT_SERVER_ANALYTICS_ENABLED="false", PYTHONPATH=str(REPO), **extra)
    return env


def stop(proc: subprocess.Popen) -> None:
    """Stop a process started with ``start_new_session`` (and its children, if any)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(15)


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            pytest.fail(f"prefect server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/api/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"prefect server not up after {timeout:.0f} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.25)


#: ``lowerflow fleet ARGS`` once the server at argv[1] answers; the heavy imports
#: (torch, prefect) run while the server starts, which saves ~10 s of the test.
FLEET_WHEN_UP = """
import sys, time, urllib.request
import flows.cli, flows.lower_fleet
deadline = time.monotonic() + 120
while True:
    try:
        urllib.request.urlopen(sys.argv[1] + "/api/health", timeout=2).close()
        break
    except OSError:
        if time.monotonic() > deadline:
            sys.exit("lowerflow fleet: no Prefect server at " + sys.argv[1])
        time.sleep(0.25)
sys.exit(flows.cli.main(sys.argv[2:]))
"""


#: The model the fleet lowers as :data:`MLP`: a width, changed between the two nights.
TINY_MLP = """
import torch

WIDTH = {width}


def mlp():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, 8)).eval()
    return net, (torch.randn(4, 64),)
"""


@pytest.fixture(scope="module")
def fleet_run(tmp_path_factory):
    """``prefect server start`` on 127.0.0.1 (own PREFECT_HOME, free port) and two nights of
    a real ``lowerflow fleet`` against it, benchmark on: the first lowers :data:`MLP`
    (portable, reference), the second a wider :data:`MLP` (a change against the first
    night's published programs, a second point of each trend) and a model whose factory
    raises (:data:`BROKEN`).  Yields ``(server URL, the second night's fleet summary from
    the store, its fleet artifact id)``; stops the server afterwards."""
    home = tmp_path_factory.mktemp("prefect-server-home")
    work = tmp_path_factory.mktemp("fleet")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # The UI asks the API at PREFECT_UI_API_URL (default 127.0.0.1:4200).
    env = clean_env(PREFECT_HOME=str(home), PREFECT_API_URL=f"{url}/api", PREFECT_UI_API_URL=f"{url}/api")
    log_path = home / "server.log"
    log = open(log_path, "wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        (work / "broken.py").write_text("def broken():\n    raise RuntimeError('no model today')\n")
        manifest = work / "fleet.yaml"
        client_env = clean_env(PREFECT_HOME=str(work / "client-home"), PREFECT_API_URL=f"{url}/api")
        for night, width, broken in ((1, 32, ""), (2, 48, f'\n  - name: "{BROKEN}"\n    model: broken.py:broken\n    targets: [portable]')):
            (work / "tiny.py").write_text(TINY_MLP.format(width=width))
            manifest.write_text(textwrap.dedent(
                f"""
                store: {work / 'store'}
                defaults: {{targets: [portable, reference], benchmark: true}}
                models:
                  - name: {MLP}
                    model: tiny.py:mlp"""
            ) + broken + "\n")
            run = subprocess.run([sys.executable, "-c", FLEET_WHEN_UP, url, "fleet", str(manifest)],
                                 cwd=REPO, env=client_env, capture_output=True, text=True, timeout=300)
            wait_healthy(url, server, log_path, timeout=5)
            if night == 1:
                assert run.returncode == 0, run.stderr[-3000:]
        assert run.returncode == 1, run.stderr[-3000:]  # `broken` failed, on purpose
        assert f"1 of 2 models failed: {BROKEN}" in run.stderr
        summary = json.loads((work / "store" / "outputs" / "fleet.json").read_text())
        body = {"artifacts": {"key": {"any_": ["lowerflow-fleet"]}}, "sort": "CREATED_DESC", "limit": 1}
        request = urllib.request.Request(f"{url}/api/artifacts/filter", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as r:
            (fleet_artifact,) = json.load(r)
        yield url, summary, fleet_artifact["id"]
    finally:
        stop(server)
        log.close()


# --------------------------------------------------------------------------- browser


class Browser:
    """Headless Chromium with one page, driven over the DevTools protocol."""

    FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--hide-scrollbars", "--remote-debugging-port=0", "--remote-allow-origins=*")

    def __enter__(self) -> "Browser":
        from websockets.sync.client import connect

        self.profile = tempfile.mkdtemp(prefix="lowerflow-chromium-")
        self.proc = subprocess.Popen(
            [CHROMIUM, *self.FLAGS, f"--user-data-dir={self.profile}", f"--window-size={WINDOW[0]},{WINDOW[1]}",
             "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        try:
            port = self._devtools_port()
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
                page = next(t for t in json.load(r) if t["type"] == "page")
            self.ws = connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=10)
        except BaseException:
            self._close_process()
            raise
        self.ids = itertools.count(1)
        self.call("Emulation.setDeviceMetricsOverride", width=WINDOW[0], height=WINDOW[1],
                  deviceScaleFactor=1, mobile=False)
        return self

    def _devtools_port(self) -> int:
        """Chromium writes the port it chose to ``DevToolsActivePort`` in its profile."""
        path = Path(self.profile) / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.proc.returncode}")
            lines = path.read_text().split() if path.exists() else []
            if lines:
                return int(lines[0])
            time.sleep(0.05)
        raise RuntimeError("chromium wrote no DevToolsActivePort in 30 s")

    def _close_process(self) -> None:
        stop(self.proc)
        shutil.rmtree(self.profile, ignore_errors=True)

    def __exit__(self, *exc) -> None:
        try:
            self.ws.close()
        finally:
            self._close_process()

    def call(self, method: str, **params):
        mid = next(self.ids)
        self.ws.send(json.dumps({"id": mid, "method": method, "params": params}))
        while True:  # events (none enabled) and stale replies are skipped
            message = json.loads(self.ws.recv(timeout=30))
            if message.get("id") == mid:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    def eval(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:80]}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def open(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def wait_for(self, expression: str, what: str, timeout: float = 30.0, diagnose=None):
        """Poll ``expression`` until truthy (the UI renders after its API calls); on a timeout,
        the page text (or what ``diagnose(text)`` says of the whole text)."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.eval(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                text = self.eval("document.body ? document.body.innerText : ''")
                shown = diagnose(text) if diagnose else text[:2000]
                raise AssertionError(f"{what}: not seen in {timeout:.0f} s at {self.eval('location.href')}; page text:\n{shown}")
            time.sleep(0.25)

    def screenshot(self, path: Path) -> Path:
        data = base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"])
        path.write_bytes(data)
        return path


def escapes_shown(text: str) -> str:
    """Each backslash of ``text`` with 60 characters around it (a markdown escape shown)."""
    spots = [text[max(0, i - 60):i + 60] for i, c in enumerate(text) if c == "\\"]
    return "backslashes at:\n" + "\n---\n".join(spots) if spots else text[:2000]


#: Every <img> of the page: its state (``complete`` is also true once a load failed).
#: Left out: the V2 UI's raw-data view (CodeMirror) holds src-less ``cm-widgetBuffer``
#: images, cursor helpers that are not pictures.
IMAGES_JS = """[...document.querySelectorAll('img:not(.cm-widgetBuffer)')].map(i => ({
    src: (i.getAttribute('src') || '').slice(0, 40), alt: i.alt, complete: i.complete,
    width: i.naturalWidth, height: i.naturalHeight}))"""

TABLE_JS = """[...document.querySelectorAll('table tr')].map(tr => [...tr.cells].map(c => c.innerText.trim()))"""


def link_js(href: str) -> str:
    """The resolved URL of the page's link whose href attribute is ``href`` (null if none yet)."""
    return f"(() => {{ const a = [...document.querySelectorAll('a')].find(a => a.getAttribute('href') === {json.dumps(href)}); return a ? a.href : null; }})()"


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory) -> Path:
    path = Path(os.environ.get("LOWERFLOW_UI_SCREENSHOTS") or tmp_path_factory.mktemp("ui-screenshots"))
    path.mkdir(parents=True, exist_ok=True)
    return path


#: The fleet table's width and its container's, in CSS pixels.
TABLE_FITS_JS = """(() => { const t = document.querySelector('table'); if (!t) return null;
    return [t.getBoundingClientRect().right, t.parentElement.getBoundingClientRect().right]; })()"""


def shown_name(name: str) -> str:
    """How the fleet table's model cell reads: the name, with `` ↗`` (the link) after it
    when the link is not on the name (a name needing markdown escapes, see reports._md_link)."""
    return name if name == MLP else f"{name} ↗"


@pytest.mark.parametrize("ui", ["v1", "v2"])
def test_fleet_and_model_artifacts_render_whole_in_the_prefect_ui(ui, fleet_run, screenshots):
    from flows.report_pictures import png_size
    from flows.reports import FLEET_ARTIFACT_COLUMNS, fleet_rows

    prefect_server, summary, fleet_id = fleet_run
    mlp = summary["models"][MLP]
    model_id = mlp["report"]["artifact_id"]
    base = prefect_server + ("/v2" if ui == "v2" else "")

    with Browser() as browser:
        # The fleet artifact: a row per model x target, the model linked to its artifact.
        browser.open(f"{base}/artifacts/artifact/{fleet_id}")
        href = f"../artifact/{model_id}"
        link = browser.wait_for(link_js(href), f"link {href} in the fleet artifact")
        assert link == f"{base}/artifacts/artifact/{model_id}"
        columns = list(FLEET_ARTIFACT_COLUMNS)
        expected = sorted([shown_name(r["model"])] + [r[c] for c in columns[1:]] for r in fleet_rows(summary, compact=True))
        # The rows are read in the same evaluation that finds them all: the UI may re-render
        # the table between two evaluations (seen under load in V2).
        names = json.dumps([shown_name(MLP), shown_name(BROKEN)])
        rows = browser.wait_for(
            f"(() => {{ const rows = {TABLE_JS}.filter(r => r && {names}.includes(r[0]));"
            f" return rows.length >= {len(expected)} ? rows : null; }})()", "the fleet table")
        assert sorted(rows) == expected
        # The reference target delegated something; both of mlp's targets were verified.
        cells = {(r[0], r[1]): dict(zip(columns[2:], r[2:])) for r in expected}
        assert cells[(MLP, "portable")]["delegated"] == "—"
        assert cells[(MLP, "reference")]["delegated"].split("/")[0] not in ("0", "—")
        assert all(cells[(MLP, t)]["verify"].startswith("ok (lf") for t in ("portable", "reference"))
        # The change column: the wider mlp against the first night's programs, both run on
        # ExecuTorch's runtime (portable), the size of each; nothing to compare for broken.
        assert cells[(MLP, "portable")]["change"].startswith("lat ×") and " · size ×" in cells[(MLP, "portable")]["change"]
        assert cells[(MLP, "reference")]["change"].startswith(("lat ×", "size ×"))
        assert cells[(shown_name(BROKEN), "portable")]["change"] == "—"
        # broken's error, listed whole under the table (its last words are past the CLI's 100 characters).
        # (Polled: V2 may re-render the artifact between two evaluations under load.)
        browser.wait_for("document.body.innerText.includes('RuntimeError: no model today')", "broken's whole error")
        # Names read as they are: no markdown escape shows (V1 showed `buffer\_mutation` in a link).
        # (Polled as well: one run under load read a backslash in V2; one that stays is shown
        # with its surroundings.)
        wanted = json.dumps([f"{BROKEN} / portable:", f"FAILED: {BROKEN}"])
        browser.wait_for(
            f"(() => {{ const t = document.body.innerText; return !t.includes('\\\\')"
            f" && {wanted}.every(w => t.includes(w)) ? t : null; }})()",
            "the fleet artifact's text without markdown escapes", diagnose=escapes_shown)
        # The table fits its container (V1's cells do not wrap: a wider table is cut at the right).
        right, container = browser.eval(TABLE_FITS_JS)
        assert right <= container + 1, f"the fleet table ends at {right:.0f} px, its container at {container:.0f} px"
        assert browser.eval(f"{IMAGES_JS}.filter(i => !(i.complete && i.width > 0))") == []
        browser.screenshot(screenshots / f"{ui}-fleet.png")

        # Follow the link (V1 opens it in a new tab: the same URL) to the model artifact.
        browser.open(link)
        pictures = browser.wait_for(
            f"(() => {{ const i = {IMAGES_JS}; const p = i.filter(x => x.alt.startsWith('memory plan of') || x.alt.startsWith('trend of'));"
            f" return p.length === 4 && i.every(x => x.complete) ? i : null; }})()",
            "both memory-plan pictures and both trend pictures, loaded",
        )
        # The heading names the model as it is (polled: V2 may re-render the artifact meanwhile).
        browser.wait_for(f"document.body.innerText.includes({json.dumps('lowerflow: ' + MLP)})", "the model's heading")
        shot = browser.screenshot(screenshots / f"{ui}-model-mlp.png")
    assert [i for i in pictures if i["width"] == 0] == [], "broken <img> on the model artifact page"
    plans = [i for i in pictures if i["alt"].startswith("memory plan of")]
    assert sorted(i["alt"] for i in plans) == ["memory plan of portable", "memory plan of reference"]
    assert all(i["src"].startswith("data:image/png;base64,") for i in plans)
    assert all((i["width"], i["height"]) == (800, 450) for i in plans)
    # The trend pictures of the two nights (.pte size, latency, ...), one per target.
    trends = [i for i in pictures if i["alt"].startswith("trend of")]
    assert sorted(i["alt"] for i in trends) == ["trend of portable", "trend of reference"]
    assert all(i["src"].startswith("data:image/png;base64,") and (i["width"], i["height"]) == (800, 220) for i in trends)
    assert png_size(shot.read_bytes()) == WINDOW
    print(f"screenshots of the {ui} UI: {screenshots}")


# --------------------------------------------------------------------------- the run view


def api(server: str, path: str, body: dict | None = None):
    """GET (or POST ``body`` to) the Prefect API at ``server``; the decoded JSON."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{server}/api{path}", data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as r:
        return json.load(r)


@pytest.mark.parametrize("ui", ["v1", "v2"])
def test_fleet_run_shows_a_child_run_per_model_and_named_stage_tasks(ui, fleet_run, screenshots):
    prefect_server, summary, _ = fleet_run
    model_run = api(prefect_server, f"/flow_runs/{summary['models'][MLP]['flow_run']}")
    fleet_run_id = api(prefect_server, f"/task_runs/{model_run['parent_task_run_id']}")["flow_run_id"]
    children = api(prefect_server, "/flow_runs/filter",
                   {"flow_runs": {"parent_flow_run_id": {"any_": [fleet_run_id]}}})
    assert sorted(c["name"] for c in children) == sorted([MLP, BROKEN])
    stage_names = sorted(t["name"] for t in api(prefect_server, "/task_runs/filter",
                                                 {"flow_runs": {"id": {"any_": [model_run["id"]]}}}))
    assert "emit[tiny_mlp/portable]" in stage_names and "preprocess[tiny_mlp/reference#0]" in stage_names
    assert all(n.endswith(("]")) and f"[{MLP}" in n for n in stage_names), stage_names
    base = prefect_server + ("/v2" if ui == "v2" else "")

    with Browser() as browser:
        # The fleet run's page, tab "Subflow Runs": a link to each model's run, named after it.
        browser.open(f"{base}/runs/flow-run/{fleet_run_id}")
        browser.wait_for(click_tab_js("Subflow Runs"), "the fleet run's Subflow Runs tab")
        links = browser.wait_for(
            f"(() => {{ const l = {RUN_LINKS_JS}.filter(a => a.href.includes('/runs/flow-run/') && !a.href.includes({json.dumps(fleet_run_id)}));"
            f" return l.length >= 2 ? l : null; }})()", "links to the fleet run's child runs")
        by_id = {c["id"]: c["name"] for c in children}
        shown = {by_id[a["href"].rstrip("/").split("/")[-1]]: a["text"] for a in links
                 if a["href"].rstrip("/").split("/")[-1] in by_id}
        assert sorted(shown) == sorted([MLP, BROKEN]) and all(name in text for name, text in shown.items()), links
        browser.screenshot(screenshots / f"{ui}-fleet-run.png")
        # A model run's page, tab "Task Runs": its stage task runs, named stage[model/target].
        browser.open(f"{base}/runs/flow-run/{model_run['id']}")
        browser.wait_for(click_tab_js("Task Runs"), "the model run's Task Runs tab")
        tasks = browser.wait_for(
            f"(() => {{ const l = {RUN_LINKS_JS}.filter(a => a.href.includes('/runs/task-run/'));"
            f" return l.length >= {len(stage_names)} ? l : null; }})()", "links to the model run's task runs")
        assert sorted({a["text"] for a in tasks if a["text"] in stage_names}) == stage_names
        browser.screenshot(screenshots / f"{ui}-model-run.png")


#: The page's links: their resolved URL and text.
RUN_LINKS_JS = "[...document.querySelectorAll('a')].map(a => ({href: a.href, text: a.innerText.trim()}))"


def click_tab_js(label: str) -> str:
    """Click the innermost element reading exactly ``label`` (a tab); true once clicked.
    (Pointer and mouse events too: V2's tabs switch on pointerdown.)"""
    events = "['pointerdown', 'mousedown', 'pointerup', 'mouseup']"
    return (f"(() => {{ const e = [...document.querySelectorAll('body *')].filter(e => e.innerText && "
            f"e.innerText.trim() === {json.dumps(label)}).pop(); if (!e) return false; "
            f"for (const t of {events}) e.dispatchEvent(new PointerEvent(t, {{bubbles: true, button: 0, isPrimary: true}}));"
            f" e.click(); return true; }})()")
