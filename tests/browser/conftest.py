"""Browser tests: one JupyterLab on 127.0.0.1 per test session, driven by headless Chromium.

The session fixture ``lab`` starts JupyterLab from this Python (so its ``python3`` kernel is
the project's environment) with an isolated config, settings and workspace folder: no news
or update pop-ups, no extension manager, no autosave (a test run must never rewrite the
committed notebooks), and every cell kept in the page (no virtual scrolling) so that text
checks see the whole notebook. Playwright drives Debian's ``/usr/bin/chromium``.

    def test_something(lab):
        page = lab.open_and_run("notebooks/01_tokenization.ipynb")
        assert "6004" in lab.output_text(page)
        lab.screenshot(page, "notebook01")
        lab.close(page)          # shut its kernel down (optional: all stop at session end)

Outside CI a machine without Chromium skips these tests; in CI (``CI=true``) it fails,
because ``scripts/test.sh`` installs Chromium first.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "tests" / "artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-dev-shm-usage",
]
SERVER_START_TIMEOUT_S = 120

# JupyterLab settings for a quiet, deterministic page (written into a private settings folder).
LAB_SETTINGS = {
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false", "checkForUpdates": False},
}
DISABLED_PLUGINS = [
    "@jupyterlab/apputils-extension:announcements",  # "would you like to receive Jupyter news?"
    "@jupyterlab/extensionmanager-extension",  # the extension manager and its warning
]

# True once every code cell has finished: nothing queued or running, kernel idle.
JS_RUN_FINISHED = """() => {
  const app = window.jupyterapp;
  const panel = app && app.shell.currentWidget;
  if (!panel || !panel.sessionContext || !panel.content) return false;
  if (!window.__lop_run_done) return false;
  const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
  if (!kernel || kernel.status !== 'idle') return false;
  const prompts = Array.from(document.querySelectorAll('.jp-InputArea-prompt'));
  return !prompts.some(p => p.textContent.includes('[*]'));
}"""

JS_NOTEBOOK_READY = """() => {
  const app = window.jupyterapp;
  const panel = app && app.shell.currentWidget;
  if (!panel || !panel.sessionContext || !panel.content || !panel.context.isReady) return false;
  const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
  return !!kernel && kernel.status === 'idle';
}"""

JS_RUN_ALL = """() => {
  window.__lop_run_done = false;
  window.__lop_run_error = null;
  window.jupyterapp.commands.execute('notebook:run-all-cells')
    .then(() => { window.__lop_run_done = true; })
    .catch(e => { window.__lop_run_error = String(e); window.__lop_run_done = true; });
}"""

JS_CELL_ERRORS = """() => {
  const panel = window.jupyterapp.shell.currentWidget;
  const errors = [];
  const cells = panel.content.model.cells;
  for (let i = 0; i < cells.length; i++) {
    const cell = cells.get(i);
    if (cell.type !== 'code') continue;
    const outputs = cell.outputs;
    for (let j = 0; j < outputs.length; j++) {
      const out = outputs.get(j).toJSON();
      if (out.output_type === 'error') errors.push(`cell ${i}: ${out.ename}: ${out.evalue}`);
    }
  }
  return errors;
}"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_private_config(root: Path) -> dict:
    """Config, settings and workspace folders of our own, so no user setting leaks into a test."""
    config_dir, settings_dir, workspaces_dir = root / "config", root / "settings", root / "workspaces"
    (config_dir / "labconfig").mkdir(parents=True)
    (config_dir / "labconfig" / "page_config.json").write_text(
        json.dumps({"disabledExtensions": {name: True for name in DISABLED_PLUGINS}})
    )
    for relpath, values in LAB_SETTINGS.items():
        path = settings_dir / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    workspaces_dir.mkdir()
    return {
        "JUPYTER_CONFIG_DIR": str(config_dir),
        "JUPYTERLAB_SETTINGS_DIR": str(settings_dir),
        "JUPYTERLAB_WORKSPACES_DIR": str(workspaces_dir),
        "JUPYTER_RUNTIME_DIR": str(root / "runtime"),
        "IPYTHONDIR": str(root / "ipython"),
    }


class Lab:
    """A running JupyterLab plus a Chromium browser; one per test session."""

    def __init__(self, browser, base_url: str, token: str, log_path: Path):
        self.browser = browser
        self.base_url = base_url
        self.token = token
        self.log_path = log_path
        self._contexts = []

    # ------------------------------------------------------------------------- pages

    def new_page(self):
        """A fresh browser tab (its own context, 1400x1000 viewport)."""
        context = self.browser.new_context(viewport={"width": 1400, "height": 1000})
        context.set_default_timeout(60_000)
        self._contexts.append(context)
        return context.new_page()

    def open(self, notebook_relpath: str, timeout_s: float = 180):
        """Open a notebook (path relative to the repository) and wait for its kernel to be idle."""
        if not (REPO / notebook_relpath).exists():
            raise FileNotFoundError(REPO / notebook_relpath)
        page = self.new_page()
        page.goto(
            f"{self.base_url}/lab/tree/{notebook_relpath}?token={self.token}&reset",
            wait_until="domcontentloaded",
            timeout=timeout_s * 1000,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.dismiss_dialogs(page)
            if page.evaluate(JS_NOTEBOOK_READY):
                page.evaluate("() => window.jupyterapp.shell.collapseLeft()")  # more room for screenshots
                return page
            page.wait_for_timeout(500)
        raise TimeoutError(
            f"{notebook_relpath}: notebook or kernel not ready after {timeout_s} s; "
            f"server log ends:\n{self.server_log_tail()}"
        )

    def open_and_run(self, notebook_relpath: str, timeout_s: float = 900, allow_errors: bool = False):
        """Open a notebook, run all cells, wait until the kernel is idle; fail on any error output."""
        page = self.open(notebook_relpath)
        self.run_all(page, timeout_s)
        if not allow_errors:
            errors = page.evaluate(JS_CELL_ERRORS)
            if errors:
                raise AssertionError(f"{notebook_relpath} raised in the browser:\n" + "\n".join(errors))
        return page

    def run_all(self, page, timeout_s: float = 900) -> None:
        """Run every cell (command ``notebook:run-all-cells``) and wait until nothing is queued or running."""
        self.dismiss_dialogs(page)
        page.evaluate(JS_RUN_ALL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.dismiss_dialogs(page)
            if page.evaluate(JS_RUN_FINISHED):
                error = page.evaluate("() => window.__lop_run_error")
                if error:
                    raise AssertionError(f"run-all failed: {error}")
                return
            page.wait_for_timeout(500)
        raise TimeoutError(f"cells still running after {timeout_s} s; server log ends:\n{self.server_log_tail()}")

    def wait_idle(self, page, timeout_s: float = 120) -> None:
        """Wait until the kernel is idle and no cell shows ``[*]`` (after moving a widget, say)."""
        page.wait_for_timeout(300)  # let a just-sent message reach the kernel
        page.wait_for_function(
            """() => {
            const panel = window.jupyterapp.shell.currentWidget;
            const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
            const busy = Array.from(document.querySelectorAll('.jp-InputArea-prompt'))
                              .some(p => p.textContent.includes('[*]'));
            return kernel && kernel.status === 'idle' && !busy;
        }""",
            timeout=timeout_s * 1000,
            polling=300,
        )

    @staticmethod
    def dismiss_dialogs(page) -> None:
        """Accept any modal dialog (kernel choice, 'file changed', ...) so it cannot block the run."""
        for button in page.locator(".jp-Dialog .jp-Dialog-button.jp-mod-accept").all():
            try:
                button.click(timeout=2000)
            except Exception:
                pass

    @staticmethod
    def output_text(page) -> str:
        """The text of every rendered cell output, in order."""
        return "\n".join(page.locator(".jp-OutputArea-output").all_inner_texts())

    @staticmethod
    def run_command(page, command: str, args: dict | None = None):
        """Execute a JupyterLab command by id (e.g. ``notebook:restart-kernel``) and wait for it."""
        return page.evaluate(
            "([c, a]) => window.jupyterapp.commands.execute(c, a).then(() => null)", [command, args or {}]
        )

    def screenshot(self, page, name: str, locator=None) -> Path:
        """Save a PNG to ``tests/artifacts/<name>.png``; scroll ``locator`` into view first when given."""
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        if locator is not None:
            locator.scroll_into_view_if_needed()
            page.wait_for_timeout(300)
        path = ARTIFACTS / f"{name}.png"
        page.screenshot(path=str(path))
        return path

    def close(self, page) -> None:
        """Shut down the page's kernel (frees its memory) and close the tab, without saving anything."""
        try:
            page.evaluate("""() => {
                const panel = window.jupyterapp.shell.currentWidget;
                return panel && panel.sessionContext ? panel.sessionContext.shutdown() : null;
            }""")
        finally:
            page.context.close()
            if page.context in self._contexts:
                self._contexts.remove(page.context)

    def server_log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text()[-chars:]
        except OSError:
            return "(no log)"

    def close_pages(self) -> None:
        for context in self._contexts:
            try:
                context.close()
            except Exception:
                pass
        self._contexts.clear()


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _require_browser() -> None:
    missing = []
    if not Path(CHROMIUM).exists():
        missing.append(f"{CHROMIUM} (Debian's chromium; 'bash scripts/setup.sh --browser' installs it)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing.append("the playwright package (pip install -e '.[dev]')")
    if missing:
        message = "browser tests need " + " and ".join(missing)
        if _in_ci():
            pytest.fail(message + "; CI must have them")
        pytest.skip(message)


def _wait_for_server(proc, url: str, log_path: Path) -> None:
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"JupyterLab exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"JupyterLab did not answer within {SERVER_START_TIMEOUT_S} s:\n{log_path.read_text()[-3000:]}")


def _stop(proc) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


@pytest.fixture(scope="session")
def lab():
    """One JupyterLab server and one headless Chromium for the whole session; both stopped at the end."""
    _require_browser()
    from playwright.sync_api import sync_playwright

    root = Path(tempfile.mkdtemp(prefix="lifeofprompt-lab-"))
    env = dict(os.environ, **_write_private_config(root), PYTHONHASHSEED="0", TOKENIZERS_PARALLELISM="false")
    port, token = _free_port(), secrets.token_hex(16)
    log_path = root / "jupyterlab.log"
    command = [
        sys.executable,
        "-m",
        "jupyter",
        "lab",
        "--no-browser",
        "--ip=127.0.0.1",
        f"--port={port}",
        "--port-retries=0",
        f"--ServerApp.root_dir={REPO}",
        f"--IdentityProvider.token={token}",
        "--ServerApp.disable_check_xsrf=True",
        "--LabApp.news_url=None",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        "--LabApp.expose_app_in_browser=True",
        "--LabApp.extension_manager=readonly",
        "--ServerApp.terminals_enabled=False",
        "--ServerApp.allow_root=True",
    ]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    playwright = browser = lab_ = None
    try:
        base_url = f"http://127.0.0.1:{port}"
        _wait_for_server(proc, f"{base_url}/api/status?token={token}", log_path)
        playwright = sync_playwright().start()
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        lab_ = Lab(browser, base_url, token, log_path)
        yield lab_
    finally:
        if lab_ is not None:
            lab_.close_pages()
        if browser is not None:
            browser.close()
        if playwright is not None:
            playwright.stop()
        _stop(proc)
        shutil.rmtree(root, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """Every test in tests/browser is a browser test (select or skip them with ``-m browser``)."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.browser)
