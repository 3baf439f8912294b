"""The run report as a user sees it in the Prefect UI, checked in a real headless browser.

    apt-get install -y chromium chromium-driver          # once (the OS packages; nothing is downloaded)
    .venv/bin/pip install -c constraints.txt -e ".[browser]"   # selenium
    .venv/bin/python bench/report_browser.py [--out DIR]

Starts a Prefect server on 127.0.0.1 (its own PREFECT_HOME), runs a short pipeline (tokenize and 40 steps of
pretraining) against it, opens the run report artifact's page in headless Chromium, and checks that every plot
the report names is an image the browser loaded (natural width > 0), and that each stage's table links to its
output. Writes a screenshot, report.png, to --out. Exits non-zero, naming what is wrong, otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = ["--set", "sft.enabled=false", "--set", "reward.enabled=false", "--set", "preference.enabled=false",
       "--set", "pretrain.max_steps=40", "--set", "pretrain.eval_every=20", "--set", "pretrain.seq_len=64",
       "--set", "pretrain.micro_batch_size=8", "--set", "pretrain.global_batch_size=16",
       "--set", "data.demo.pretrain_docs=4000", "--set", "tokenizer.vocab_size=320"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api(url: str, path: str, body: dict | None = None, tries: int = 6):
    """One call of the Prefect server's REST API; a busy server's 503 (its database locked) is retried, as
    Prefect's own client does."""
    request = urllib.request.Request(url + path, data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    for attempt in range(tries):
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as e:
            if e.code != 503 or attempt == tries - 1:
                raise
            time.sleep(2 ** attempt)


def wait_healthy(url: str, server: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if server.poll() is not None:
            sys.exit(f"the Prefect server exited with {server.returncode}")
        try:
            api(url, "/health")
            return
        except OSError:
            time.sleep(1)
    sys.exit(f"the Prefect server did not answer at {url} within {timeout:.0f} s")


def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    # No GPU process (its software rasteriser kept a core busy while the pipelines trained: --disable-gpu alone
    # still started one, which drew the Prefect UI through SwiftShader; with --disable-software-rasterizer too,
    # bench/team_ui.py took 107 s of CPU against 156) and none of Chromium's own network traffic (updates, sync,
    # field trials), which a closed machine refuses at every start.
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,2400", "--disable-gpu",
                "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run",
                "--disable-quic", "--disable-software-rasterizer"):
        options.add_argument(arg)
    options.binary_location = next((p for p in ("/usr/bin/chromium", "/usr/bin/chromium-browser") if Path(p).exists()),
                                   "chromium")
    driver_path = next((p for p in ("/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver") if Path(p).exists()),
                       None)
    if driver_path is None:
        sys.exit("no chromedriver: apt-get install -y chromium chromium-driver")
    return webdriver.Chrome(options=options, service=Service(driver_path))


def workspace(doc: str, out: str, prefix: str) -> tuple[Path, Path, int, dict]:
    """(--out, created; a fresh work folder; a free port for the server; the environment of a server on it with its
    own PREFECT_HOME in the work folder, and of its clients)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(out))
    out_dir = parser.parse_args().out
    out_dir.mkdir(parents=True, exist_ok=True)
    work, port = Path(tempfile.mkdtemp(prefix=prefix)), free_port()
    env = {**os.environ, "PREFECT_HOME": str(work / "prefect"), "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1"}
    return out_dir, work, port, env


def main() -> int:
    out, work, port, env = workspace(__doc__, "runs/report-browser", "gptforge-report-")
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
                               str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    try:
        wait_healthy(f"{url}/api", server)
        print(f"Prefect server at {url}; running a short pipeline against it ...", flush=True)
        run = subprocess.run([sys.executable, "-m", "gptforge.pipeline.cli", "run", "-c",
                              str(ROOT / "configs" / "tiny.yaml"), "--set", f"run.root={work / 'runs'}", *RUN],
                             env=env, capture_output=True, text=True)
        if run.returncode != 0:
            sys.exit(f"the pipeline failed:\n{run.stderr[-3000:]}")
        artifacts = api(f"{url}/api", "/artifacts/filter", {"artifacts": {"key": {"any_": ["run-report"]}}})
        if not artifacts:
            sys.exit("no run-report artifact on the server")
        report = artifacts[0]
        expected = json.loads(next((work / "runs").glob("*/report.json")).read_text())["plots"]
        page = f"{url}/artifacts/artifact/{report['id']}"
        driver = browser()
        try:
            driver.get(page)
            deadline, images = time.time() + 60, []
            while time.time() < deadline:  # the UI renders the markdown after it loads
                images = driver.execute_script(
                    "return [...document.querySelectorAll('img')].filter(i => i.src.startsWith('data:image/png'))"
                    ".map(i => [i.alt, i.complete, i.naturalWidth, i.naturalHeight])")
                if len(images) >= len(expected) and all(i[1] for i in images):
                    break
                time.sleep(1)
            links = driver.execute_script(
                "return [...document.querySelectorAll('a')].map(a => [a.textContent, a.href])"
                ".filter(a => a[1].startsWith('file://'))")
            driver.save_screenshot(str(out / "report.png"))
        finally:
            driver.quit()
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=60)
    loaded = [alt for alt, complete, width, height in images if complete and width > 0 and height > 0]
    names = [Path(p).stem for p in expected]
    print(f"page: {page}")
    print(f"plots in the report: {names}; images the browser loaded: {loaded}")
    print(f"links to outputs: {[text for text, _ in links]}")
    print(f"screenshot: {out / 'report.png'}")
    if sorted(loaded) != sorted(names):
        print(f"FAIL: the plots that did not load: {sorted(set(names) - set(loaded))}", file=sys.stderr)
        return 1
    if {"tokenize", "pretrain"} - {text for text, _ in links}:
        print("FAIL: a stage's table does not link to its output", file=sys.stderr)
        return 1
    print("OK: every plot loaded and every stage links to its output")
    return 0


if __name__ == "__main__":
    sys.exit(main())
