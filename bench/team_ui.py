"""gptforge on a team's Prefect server as a person sees it in the UI, driven in a real headless browser.

    apt-get install -y chromium chromium-driver          # once (the OS packages; nothing is downloaded)
    .venv/bin/pip install -c constraints.txt -e ".[browser]"   # selenium
    .venv/bin/python bench/team_ui.py [--out DIR]

Starts a Prefect server on 127.0.0.1 (its own PREFECT_HOME), `gptforge deploy --slots 2` of a config that runs
tokenize on a `cpu` pool and pretrain on a `gpu` pool, and a process worker for each. Then:
1. pipeline A, gated by `run.approve_before: [pretrain]`, pauses after tokenize, while pipeline B's pretrain takes
   both slots: the browser opens A's run page, finds the Resume button, opens the approval form (the metrics of
   tokenize in its description), ticks approve, writes a note and submits it;
2. A's pretrain then waits for B's slots: the browser finds its stage run in the state `Waiting for slots`;
   B's pretraining, which would run on for as long as it is left, is then cancelled, which gives the slots back
   (its processes are stopped with SIGSTOP while they hold the slots, so that they leave the CPU to the UI);
3. once A is done, its run page lists its child stage runs (tokenize and pretrain, on their pools).
Saves approval-form.png, waiting-for-slots.png and child-runs.png to --out, and exits non-zero naming what was not
seen.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report_browser import api, browser, wait_healthy, workspace  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["sft.enabled=false", "reward.enabled=false", "preference.enabled=false", "pretrain.eval_every=100",
         "pretrain.seq_len=64", "pretrain.micro_batch_size=8", "pretrain.global_batch_size=16",
         "data.demo.pretrain_docs=1500", "tokenizer.vocab_size=320", "model.n_layer=2",
         "run.work_pools={tokenize: cpu, pretrain: gpu}", "run.default_work_pool=cpu"]


def sets(*overrides: str) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def wait(what: str, predicate, timeout: float = 300, poll: float = 1.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    sys.exit(f"FAIL: timed out waiting for {what}")


def flow_runs(api_url: str, flow: str) -> list[dict]:
    return api(api_url, "/flow_runs/filter", {"flows": {"name": {"any_": [flow]}}, "limit": 200})


def pipeline_run(api_url: str, name: str) -> dict | None:
    runs = [r for r in flow_runs(api_url, "gptforge-pipeline")
            if r["parameters"].get("config", {}).get("run", {}).get("name") == name]
    return runs[0] if runs else None


def page_text(driver) -> str:
    return driver.execute_script("return document.body.innerText")


def wait_text(driver, needle: str, timeout: float = 60) -> bool:
    return poll(lambda: needle in page_text(driver), timeout, every=1.0)


def poll(predicate, timeout: float, every: float = 0.5):
    """The predicate's first true value within `timeout` seconds, else False."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if value := predicate():
            return value
        time.sleep(every)
    return False


def stage_processes(stage: str, root: Path) -> list[int]:
    """The processes of a stage of the run rooted at `root` (its agent and ranks share the command line)."""
    pids = []
    for d in Path("/proc").iterdir():
        try:
            cmd = (d / "cmdline").read_bytes().decode(errors="replace") if d.name.isdigit() else ""
        except OSError:
            continue
        if f"gptforge.stages.{stage}" in cmd and str(root) in cmd:
            pids.append(int(d.name))
    return pids


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def click_text(driver, text: str, tags: str = "button") -> bool:
    """Click the first visible element of `tags` whose text is `text`."""
    return driver.execute_script(
        "const els = [...document.querySelectorAll(arguments[1])].filter(e => e.offsetParent !== null"
        " && e.innerText.trim().startsWith(arguments[0])); if (els.length) { els[0].click(); return true }"
        " return false", text, tags)


def approve_in_the_form(driver, ui: str, api_url: str, run: dict, out: Path, seen: dict) -> None:
    driver.get(f"{ui}/runs/flow-run/{run['id']}")
    seen["paused shown"] = wait_text(driver, "Paused")
    if not click_text(driver, "Resume"):
        return
    seen["form describes the gate"] = wait_text(driver, "Start pretrain", timeout=30)
    seen["form shows tokenize's metrics"] = "tokens" in page_text(driver)
    driver.save_screenshot(str(out / "approval-form.png"))
    # the form's fields render after its description: each step is retried until its element is there
    steps = {
        "the approve switch": "const box = [...document.querySelectorAll('input[type=checkbox], [role=switch], "
        "[role=checkbox]')].find(e => e.offsetParent !== null); if (box) { box.click(); return true } return false",
        "the note": "const area = [...document.querySelectorAll('textarea, input[type=text]')].find(e => "
        "e.offsetParent !== null); if (!area) return false; const set = Object.getOwnPropertyDescriptor("
        "Object.getPrototypeOf(area), 'value').set; set.call(area, 'tokens look right'); "
        "area.dispatchEvent(new Event('input', {bubbles: true})); return true",
    }
    for what, script in steps.items():
        if not poll(lambda: driver.execute_script(script), 30):  # noqa: B023 (called at once)
            print(f"the approval form has no {what}", flush=True)
            return
    resumed = False
    for _ in range(3):  # the UI does not retry a request the busy server refused ("Oops. Something went wrong.")
        if not poll(lambda: click_text(driver, "Submit"), 30):
            print("the approval form has no Submit button", flush=True)
            break
        if resumed := poll(lambda: api(api_url, f"/flow_runs/{run['id']}")["state_type"] != "PAUSED", 30, every=1):
            break
        print("the UI's resume did not reach the server; submitting again", flush=True)
    seen["approved in the browser"] = bool(resumed)


def main() -> int:
    out, work, port, env = workspace(__doc__, "runs/team-ui", "gptforge-team-ui-")
    ui, api_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port}/api"
    env.update(PREFECT_WORKER_QUERY_SECONDS="1", PREFECT_UI_API_URL=api_url)
    procs = []

    def start(name: str, cmd: list[str]) -> subprocess.Popen:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=open(work / f"{name}.log", "w"),
                                stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(proc)
        return proc

    gptforge = [sys.executable, "-m", "gptforge.pipeline.cli"]
    config = ["-c", str(ROOT / "configs" / "tiny.yaml")]
    seen: dict[str, bool] = {}
    held: list[int] = []
    try:
        wait_healthy(api_url, start("server", [sys.executable, "-m", "prefect", "server", "start", "--host",
                                               "127.0.0.1", "--port", str(port)]))
        subprocess.run(gptforge + ["deploy", *config, *sets(*SMALL, f"run.root={work / 'deploy'}"), "--slots", "2"],
                       env=env, check=True, cwd=ROOT)
        for pool in ("cpu", "gpu"):
            start(f"worker-{pool}", [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--type",
                                     "process"])
        print(f"Prefect UI at {ui}; pipelines A (gated before pretrain) and B start", flush=True)
        a = start("pipeline-a", gptforge + ["run", *config, *sets(*SMALL, f"run.root={work / 'a'}", "run.name=a",
                                                                    "run.approve_before=[pretrain]",
                                                                    "pretrain.max_steps=10")])
        b = start("pipeline-b", gptforge + ["run", *config, *sets(*SMALL, f"run.root={work / 'b'}", "run.name=b",
                                                                    "pretrain.max_steps=100000",
                                                                    "pretrain.log_every=100")])  # few log writes
        paused = wait("A to pause at its gate", lambda: (r := pipeline_run(api_url, "a")) and
                      r["state_type"] == "PAUSED" and r, timeout=400)
        wait("B's pretrain to hold both slots", lambda: api(api_url, "/v2/concurrency_limits/gptforge-gpus")
             ["active_slots"] == 2, timeout=400)
        # B's pretraining only has to hold the slots while the browser looks: its agent and 2 ranks are stopped
        # (SIGSTOP) until the cancel, rather than training on both cores beside the browser and the server
        held = wait("B's pretraining agent and ranks", lambda: len(p := stage_processes("pretrain", work / "b")) >= 3
                    and p, timeout=120, poll=0.5)
        signal_all(held, signal.SIGSTOP)
        driver = browser()
        try:
            approve_in_the_form(driver, ui, api_url, paused, out, seen)
            if not seen.get("approved in the browser"):
                print("the form could not be filled in; approving through the API", flush=True)
                (out / "approval-form.html").write_text(driver.page_source)
                api(api_url, f"/flow_runs/{paused['id']}/resume",
                    {"run_input": {"approve": True, "note": "tokens look right"}})
            # B's pretrain holds both slots: A's, approved, waits for them
            waiting = wait("a stage run waiting for slots", lambda: next(
                (r for r in flow_runs(api_url, "gptforge-stage") if r["state_name"] == "Waiting for slots"), None),
                timeout=400, poll=0.5)
            driver.get(f"{ui}/runs/flow-run/{waiting['id']}")
            seen["a stage shown waiting for slots"] = wait_text(driver, "Waiting for slots", timeout=30)
            driver.save_screenshot(str(out / "waiting-for-slots.png"))
            (b_stage,) = [r for r in flow_runs(api_url, "gptforge-stage") if "gptforge-run:b" in r["tags"]
                          and r["name"].startswith("pretrain")]
            signal_all(held, signal.SIGCONT)  # a stopped process would hold the cancel's SIGTERM pending
            api(api_url, f"/flow_runs/{b_stage['id']}/set_state", {"state": {"type": "CANCELLING"}, "force": True})
            a.wait(600)
            seen["A finished"] = a.returncode == 0
            driver.get(f"{ui}/runs/flow-run/{paused['id']}")
            driver.set_window_size(1400, 1600)
            children = {r["id"]: r["name"] for r in flow_runs(api_url, "gptforge-stage")
                        if "gptforge-run:a" in r["tags"]}
            seen["A's child stage runs: tokenize and pretrain"] = sorted(children.values()) == ["pretrain · a",
                                                                                              "tokenize · a"]
            seen["its Subflow Runs tab opens"] = poll(  # the tabs render after the run's graph, on a busy machine late
                lambda: click_text(driver, "Subflow Runs", "li.p-tab, [role=tab], button"), 60)
            deadline, linked = time.time() + 60, False
            while not linked and time.time() < deadline:
                time.sleep(1)
                linked = all(driver.execute_script("return !!document.querySelector(`a[href*='${arguments[0]}']`)", i)
                             for i in children)
            seen["the tab links to each child run"] = linked
            driver.save_screenshot(str(out / "child-runs.png"))
            if not linked:
                (out / "child-runs.html").write_text(driver.page_source)
        finally:
            driver.quit()
        b.wait(120)
        seen["B's pretraining cancelled"] = api(api_url, f"/flow_runs/{b_stage['id']}")["state_type"] == "CANCELLED"
        seen["every slot given back"] = api(api_url, "/v2/concurrency_limits/gptforge-gpus")["active_slots"] == 0
        record = json.loads((work / "a" / "a" / "run.json").read_text())
        seen["the note reached run.json"] = record["stages"]["pretrain"].get("approval", {}).get("note") == \
            "tokens look right"
    finally:
        signal_all(held, signal.SIGCONT)
        for proc in reversed(procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.time() + 20  # one grace period for all, not 20 s for each in turn
        for proc in procs:
            try:
                proc.wait(max(deadline - time.time(), 0.1))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    for what, ok in seen.items():
        print(f"{'ok  ' if ok else 'FAIL'} {what}")
    print(f"screenshots: {sorted(p.name for p in out.glob('*.png'))} in {out}; logs in {work}")
    return 0 if seen and all(seen.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
