"""The book as a learner meets it: JupyterLab from this environment, opened in headless Chromium (Playwright).
For every chapter: Run > Run All Cells from the menu, wait for the kernel to go idle, then no cell shows an
error, every widget renders, and each slider moved with the keyboard (focus its handle, ArrowRight) changes
what its widget shows, read from the DOM. Screenshots and a per-chapter summary (run time, sliders) go to
test-artifacts/browser/.

Needs the `playwright` package (the dev extra) and Chromium at /usr/bin/chromium (Debian: `apt-get install
chromium`; .ci/run installs it; CHROMIUM=/path/to/chromium picks another). Playwright's own browser download
is not used. One JupyterLab server and one browser serve all chapters; each chapter gets a fresh page and
its kernel is shut down afterwards. The notebooks are never saved (autosave is off, and the test checks the
server's log), and their checkpoints go to the server's temporary folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from book_run import CHROMIUM, NOTEBOOK_LIMIT_S, browser_problem

from nanoengine import book

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
NOTEBOOKS = book.notebooks(BOOK)  # chapters and parts of chapters (03a_..., 03b_...), each run on its own
ARTIFACTS = ROOT / "test-artifacts" / "browser"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
TOKEN = "nanoengine-browser-test"
SERVER_START_S = 120
RUN_ALL_LIMIT_S = 600  # how long to wait for Run All (a chapter must finish within NOTEBOOK_LIMIT_S)
WIDGET_UPDATE_S = 60  # a slider's redraw goes through the kernel (a matplotlib figure in chapter 02)
# JupyterLab settings for the test's fresh settings folder: every cell in the DOM (no windowing), no autosave
# (the book is stored without outputs), no news or update checks (no network here)
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
    "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
}

pytestmark = [pytest.mark.browser, pytest.mark.slow]
# the chapters in two xdist groups (alternate chapters), so that the two workers share the book: each worker
# starts its own JupyterLab and Chromium (module fixtures) for the chapters it gets
CHAPTERS = [pytest.param(p, id=p.stem, marks=pytest.mark.xdist_group(f"browser{i % 2}"))
            for i, p in enumerate(NOTEBOOKS)]


def _missing(what: str) -> None:
    message = f"the browser test needs {what}"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


@dataclass
class Lab:
    url: str
    log: Path

    def api(self, method: str, path: str) -> object:
        req = urllib.request.Request(f"{self.url}{path}", method=method,
                                     headers={"Authorization": f"token {TOKEN}"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            body = resp.read()
        return json.loads(body) if body else None

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def shutdown_kernels(self, name: str) -> None:
        for session in self.api("GET", "/api/sessions"):
            if session["path"] == name:
                self.api("DELETE", f"/api/sessions/{session['id']}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab on the book folder, on a free loopback port with a token, with fresh config, data, runtime,
    settings and workspace folders; its kernels run with one thread and the reference solutions."""
    pytest.importorskip("jupyterlab", reason="the browser test needs JupyterLab: make setup")
    home = tmp_path_factory.mktemp("lab")
    for name, values in LAB_SETTINGS.items():
        f = home / "settings" / f"{name}.jupyterlab-settings"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps(values))
    env = {k: v for k, v in os.environ.items()
           if k != "MPLBACKEND" and not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))}
    env.update(JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTER_DATA_DIR=str(home / "data"),
               JUPYTER_RUNTIME_DIR=str(home / "runtime"), JUPYTERLAB_SETTINGS_DIR=str(home / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(home / "workspaces"), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env.setdefault("NANOENGINE_IMPL", "solutions")  # the chapters' check cells run against the solutions
    port = _free_port()
    log = home / "server.log"
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ServerApp.ip=127.0.0.1",
           f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={TOKEN}",
           f"--ServerApp.root_dir={BOOK}", "--LabApp.expose_app_in_browser=True",
           "--LabApp.extension_manager=readonly",
           f"--FileCheckpoints.checkpoint_dir={home / 'checkpoints'}"]  # (JupyterLab makes one on opening)
    with open(log, "w") as out:
        server = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    lab = Lab(f"http://127.0.0.1:{port}", log)
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            try:
                lab.api("GET", "/api/status")
                break
            except OSError:
                if server.poll() is not None:
                    pytest.fail(f"JupyterLab exited with {server.returncode}:\n{lab.log_tail()}")
                if time.monotonic() > deadline:
                    pytest.fail(f"JupyterLab did not answer within {SERVER_START_S} s:\n{lab.log_tail()}")
                time.sleep(0.5)
        yield lab
    finally:
        server.terminate()  # the server shuts its kernels down on SIGTERM
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)  # the server's own process group: it and its kernels
            server.wait(10)


@pytest.fixture(scope="module")
def browser():
    problem = browser_problem()
    if problem:
        _missing(problem)
    from playwright.sync_api import sync_playwright

    pw = sync_playwright().start()
    try:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()
    finally:
        pw.stop()


# JavaScript run in the page. The notebook panel is window.jupyterapp.shell.currentWidget (the server is
# started with expose_app_in_browser); what a learner sees is read from the DOM.
KERNEL_IDLE = """() => {
  const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
  return !!k && k.status === 'idle';
}"""
# done: the kernel is idle, no cell is queued or running ([*]), and every code cell ran or one failed (a
# failing cell stops Run All, and the cells after it keep an empty prompt)
RUN_ALL_DONE = """() => {
  const w = window.jupyterapp.shell.currentWidget;
  const k = w.sessionContext.session && w.sessionContext.session.kernel;
  if (!k || k.status !== 'idle') return false;
  const prompts = Array.from(document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputPrompt'));
  if (prompts.some(p => p.textContent.includes('*'))) return false;
  const cells = Array.from(w.content.model.cells).filter(c => c.type === 'code');
  const failed = cells.some(c => Array.from({length: c.outputs.length}, (_, i) => c.outputs.get(i))
                                   .some(o => o.type === 'error'));
  return failed || cells.every(c => c.executionCount !== null);
}"""
# per code cell: its index in the notebook, execution count, error outputs and widget views
CELL_REPORT = """() => {
  const cells = Array.from(window.jupyterapp.shell.currentWidget.content.model.cells);
  return cells.map((c, index) => ({index, c})).filter(({c}) => c.type === 'code').map(({index, c}) => {
    const outs = Array.from({length: c.outputs.length}, (_, i) => c.outputs.get(i).toJSON());
    return {index, count: c.executionCount,
            errors: outs.filter(o => o.output_type === 'error').map(o => o.ename + ': ' + o.evalue),
            widgets: outs.filter(o => o.data && o.data['application/vnd.jupyter.widget-view+json']).length};
  });
}"""
# the rendered widget views: the outermost widget element of each top-level output
TOP_WIDGET = ".jp-Cell-outputArea > .jp-OutputArea-child > .jp-OutputArea-output > .jupyter-widgets"
WIDGET_VIEWS = f"""() => {{ const TOP_WIDGET = '{TOP_WIDGET}';
  return Array.from(document.querySelectorAll('.jp-Notebook .jp-Cell')).flatMap((cell, index) =>
  Array.from(cell.querySelectorAll(TOP_WIDGET))
    .map(el => ({{index, text: el.innerText.slice(0, 80), height: el.getBoundingClientRect().height}})));}}"""
# what the widget around a slider handle shows, without its sliders (their readouts move with the value)
SHOWN = """handle => {
  let top = null;
  for (let el = handle; el && !el.classList.contains('jp-Cell'); el = el.parentElement)
    if (el.classList.contains('jp-OutputArea-output')) top = el;
  const copy = top.cloneNode(true);
  copy.querySelectorAll('.widget-slider').forEach(s => s.remove());
  return copy.innerHTML;
}"""
SLIDER_INFO = """handle => {
  const slider = handle.closest('.widget-slider');
  const label = slider.querySelector('.widget-label');
  const readout = slider.querySelector('.widget-readout');
  const cell = handle.closest('.jp-Cell');
  return {label: label ? label.textContent : '', value: readout ? readout.textContent : '',
          now: handle.getAttribute('aria-valuenow'), max: handle.getAttribute('aria-valuemax'),
          cell: Array.from(cell.parentElement.children)
                .filter(e => e.classList.contains('jp-Cell')).indexOf(cell)};
}"""


def _wait(page, fn: str, limit_s: float, what: str, arg=None) -> None:
    try:
        page.wait_for_function(fn, arg=arg, timeout=limit_s * 1000, polling=500)
    except Exception as e:  # playwright's TimeoutError
        raise AssertionError(f"{what} within {limit_s:.0f} s") from e


def _run_all(page, path: Path) -> float:
    """Run > Run All Cells from the menu bar, then wait until it is done; the seconds it ran."""
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
    t0 = time.perf_counter()
    _wait(page, RUN_ALL_DONE, RUN_ALL_LIMIT_S, f"{path.name}: Run All did not finish")
    return time.perf_counter() - t0


def _move_sliders(page, path: Path) -> list[dict]:
    """Each slider: focus its handle, press ArrowRight (ArrowLeft at the end), and wait for its widget to show
    something else. Returns what moved."""
    handles = page.locator(".jp-Notebook .widget-slider .noUi-handle")
    moved = []
    for i in range(handles.count()):
        handle = handles.nth(i)
        handle.scroll_into_view_if_needed()
        info = handle.evaluate(SLIDER_INFO)
        shown = handle.evaluate(SHOWN)
        key = "ArrowLeft" if info["now"] == info["max"] else "ArrowRight"
        handle.focus()
        handle.press(key)
        where = f"{path.name} cell {info['cell']}, slider {info['label'] or i!r} at {info['value']}"
        try:
            page.wait_for_function("([h, before, shown]) => h.getAttribute('aria-valuenow') !== before && "
                                   f"({SHOWN})(h) !== shown",
                                   arg=[handle.element_handle(), info["now"], shown],
                                   timeout=WIDGET_UPDATE_S * 1000, polling=250)
        except Exception as e:
            now = handle.get_attribute("aria-valuenow")
            why = ("the slider did not move" if now == info["now"] else
                   f"the slider moved to {now} but the widget still shows the same")
            raise AssertionError(f"{where}: {key}: {why} after {WIDGET_UPDATE_S} s") from e
        moved.append({"cell": info["cell"], "slider": info["label"], "key": key, "from": info["value"],
                      "to": handle.evaluate(SLIDER_INFO)["value"]})
    return moved


@pytest.mark.parametrize("path", CHAPTERS)
def test_chapter_runs_in_browser(path, browser, lab):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for old in ARTIFACTS.glob(f"{path.stem}*"):
        old.unlink()
    summary: dict = {"chapter": path.stem}
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    t0 = time.perf_counter()
    try:
        page.goto(f"{lab.url}/lab/tree/{path.name}?reset&token={TOKEN}")
        page.wait_for_selector(".jp-Notebook .jp-CodeCell", timeout=SERVER_START_S * 1000)
        _wait(page, KERNEL_IDLE, SERVER_START_S, f"{path.name}: the kernel did not start")
        summary["open_s"] = round(time.perf_counter() - t0, 1)
        summary["run_all_s"] = round(_run_all(page, path), 1)
        assert summary["run_all_s"] < NOTEBOOK_LIMIT_S, (
            f"{path.name}: Run All took {summary['run_all_s']:.0f} s; a chapter must run within "
            f"{NOTEBOOK_LIMIT_S} s")

        cells = page.evaluate(CELL_REPORT)
        errors = [f"cell {c['index']}: {e}" for c in cells for e in c["errors"]]
        assert not errors, f"{path.name}: Run All shows errors:\n" + "\n".join(errors)
        not_run = [c["index"] for c in cells if c["count"] is None]
        assert not not_run, f"{path.name}: cells {not_run} did not run"

        expected = sum(c["widgets"] for c in cells)
        _wait(page, f"n => document.querySelector('.jp-Notebook').innerText.includes("
                    "'Error displaying widget') || "
                    f"document.querySelectorAll('.jp-Notebook {TOP_WIDGET}').length >= n && "
                    "!document.querySelector('.jp-Notebook').innerText.includes('Loading widget')",
              WIDGET_UPDATE_S, f"{path.name}: its widgets did not render", arg=expected)
        text = page.locator(".jp-Notebook").inner_text()
        assert "Error displaying widget" not in text, f"{path.name}: a widget failed: Error displaying widget"
        views = page.evaluate(WIDGET_VIEWS)
        assert len(views) == expected, (f"{path.name}: {expected} widget outputs but {len(views)} rendered: "
                                        f"{views}")
        empty = [v for v in views if v["height"] <= 0]
        assert not empty, f"{path.name}: widgets rendered with no height: {empty}"
        summary["widgets"] = len(views)

        summary["sliders"] = _move_sliders(page, path)
        for k, widget in enumerate(page.locator(f".jp-Notebook {TOP_WIDGET}").all()):
            widget.screenshot(path=ARTIFACTS / f"{path.stem}-widget{k + 1}.png")
    finally:
        summary["total_s"] = round(time.perf_counter() - t0, 1)
        try:
            page.locator(".jp-Notebook .jp-Cell").last.scroll_into_view_if_needed(timeout=5000)
            page.screenshot(path=ARTIFACTS / f"{path.stem}.png")
        except Exception as e:  # the screenshot is a help, not the test
            summary["screenshot_error"] = str(e)[:200]
        try:
            with contextlib.suppress(OSError):  # the server stops its kernels anyway when the module ends
                lab.shutdown_kernels(path.name)
        finally:
            page.close()
            (ARTIFACTS / f"{path.stem}.json").write_text(json.dumps(summary, indent=1) + "\n")
    assert f"Saving file at /{path.name}" not in lab.log.read_text(), f"JupyterLab saved {path.name}"
