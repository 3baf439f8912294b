"""The run report: `runs/<run>/report.json`, `report.md` and `plots/*.png`, built from run.json and each stage's
logs/metrics.jsonl.

Plots: `plots/<stage>.png` for each stage that logged, one panel per quantity (the training and held-out loss
share a panel, being one quantity; an accuracy never shares an axis with a margin), each axis labelled with its
unit; and `plots/kl.png`, a panel per stage that logs its KL to the reference. The markdown holds a small table
per stage (action, time, its few headline metrics, a link to its output) and the plots: `report.md` names them
by relative path (next to it on disk); the Prefect run report (`artifact_markdown`) carries them inline as data
URIs, since the Prefect UI cannot reach the run's files.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

from gptforge.core.declarations import STAGES
from gptforge.core.files import write_json_atomic
from gptforge.model.train.metrics import HARNESS

REWARDS = "rewards/"  # rewards/<label>: each reward of preference.rewards (gptforge.model.rewards)

# (panel title, logged keys drawn on it, y-axis label with its unit); a stage's figure has the panels it logged.
PANELS = [
    ("loss", ("loss", "val_loss"), "loss (nats/token)"),
    ("preference accuracy", ("reward_accuracy", "train_reward_accuracy"), "chosen ranked first (fraction)"),
    ("preference margin", ("reward_margin", "train_reward_margin"), "chosen - rejected (reward)"),
    ("reward", ("reward_mean",), "mean reward (weighed total)"),
    ("KL to the reference", ("kl",), "KL (nats/response)"),
    ("KL to the teacher", ("distill_kl",), "KL(student || teacher) (nats/token)"),
    ("log-probability of the samples", ("student_logp", "teacher_logp"), "mean log p of a sampled token (nats)"),
    ("aux loss", ("aux_loss",), "load-balancing loss"),
    ("throughput", ("tokens_per_sec",), "tokens/s"),
]
# The metrics a stage's table shows, in this order, those it has (at most five).
HEADLINE = ["documents_kept", "bytes_kept", "val_loss", "exact_match", "base_exact_match", "sft_exact_match",
            "rouge_l", "base_rouge_l",
            "win_rate_vs_sft", "win_rate_vs_teacher", "reward_accuracy",
            "reward_margin", "reward_mean", "kl", "val_ppl", "tokens_per_sec", "mfu", "peak_host_memory_gib"]


def read_log(stage_dir: Path) -> list[dict]:
    path = stage_dir / "logs" / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def series(rows: list[dict], key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]


def funnel_of(stage: str, info: dict) -> Path | None:
    """The funnel a run's stage wrote (its declaration's `funnel` output), if it wrote one."""
    name = STAGES[stage].outputs.get("funnel")
    path = Path(info["output"]) / name if name and info.get("output") else None
    return path if path is not None and path.is_file() else None


def stage_panels(rows: list[dict], stage: str = "") -> list[tuple[str, dict[str, list], str]]:
    """The panels a stage's log fills: [(title, {key: points}, y label)], then one for each reward (rewards/<label>);
    `stage` names the loss's unit."""
    out = []
    for title, keys, unit in PANELS:
        lines = {k: points for k in keys if (points := series(rows, k))}
        if lines:
            what = STAGES[stage].loss_units if stage in STAGES else None  # where not the next-token loss
            out.append((title, lines, (what or unit) if title == "loss" else unit))
    each = sorted({k for r in rows for k in r if k.startswith(REWARDS)})  # a panel per reward of preference.rewards
    return out + [(k, {k: points}, "mean reward (before weighing)") for k in each if (points := series(rows, k))]


def draw(panels: list[tuple[str, dict[str, list], str]], title: str, path: Path) -> None:
    """One figure, a panel (its own axes) per entry, side by side in rows of three."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, (name, lines, unit) in zip(axes.flat, panels):
        for key, points in lines.items():
            ax.plot([p[0] for p in points], [p[1] for p in points], label=key, marker="." if len(points) < 20 else None)
        ax.set_title(name, fontsize="medium")
        ax.set_xlabel("step")
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
        if len(lines) > 1:
            ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


FUNNEL = "curate-funnel"  # the curate stage's plot


def funnel_sources(metrics: dict) -> list[tuple[str, str]]:
    """(source, metric prefix) of each source the curate stage curated: data.pretrain's funnel is unprefixed, the
    training rows of data.sft and data.preference under `sft/` and `preference/`."""
    return [(f"data.{which or 'pretrain'}", f"{which}/" if which else "") for which in ("", "sft", "preference")
            if f"{which}/documents_in".lstrip("/") in metrics]


def funnel_steps(metrics: dict, prefix: str = "") -> list[tuple[str, int, int]]:
    """A curated source's funnel from the stage's metrics: (step, documents it removed, documents left after it),
    from the documents read to those kept, in the order the stage removed them."""
    left = metrics[f"{prefix}documents_in"]
    out = [("read", 0, left)]
    for key, n in metrics.items():
        if key.startswith(f"{prefix}removed/"):
            left -= n
            out.append((key.removeprefix(f"{prefix}removed/"), n, left))
    return out


def draw_funnel(metrics: dict, path: Path) -> None:
    """Documents left after each step of the curate stage, one bar a step (its first source's: data.pretrain's
    where it curated it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    source, prefix = funnel_sources(metrics)[0]
    steps = funnel_steps(metrics, prefix)
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(steps) + 1.2))
    ax.barh([s for s, _, _ in steps][::-1], [left for _, _, left in steps][::-1], color="#4c72b0")
    for y, (_, removed, left) in enumerate(steps[::-1]):
        ax.text(left, y, f" {left:,}" + (f" (-{removed:,})" if removed else ""), va="center", fontsize="small")
    ax.set_xlabel("documents left")
    kept, read = metrics[f"{prefix}documents_kept"], metrics[f"{prefix}documents_in"]
    ax.set_title(f"curate {source}: {kept:,} of {read:,} kept "
                 f"({metrics[f'{prefix}bytes_kept'] / max(metrics[f'{prefix}bytes_in'], 1):.0%} of the bytes)")
    ax.set_xlim(0, read * 1.25)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def funnel_markdown(out_dir: Path, image) -> str:
    """The curate stage's funnel of each source as a table, the plot (`image(name)`: the plot's address) and a few
    removed documents for each reason."""
    funnel = json.loads((out_dir / "funnel.json").read_text())
    m, md = funnel["metrics"], ["## Curation funnel", ""]
    for n, (source, prefix) in enumerate(funnel_sources(m)):
        total = max(m[f"{prefix}documents_in"], 1)
        what = "documents" if not prefix else "training rows (the held-out rows are left as they are)"
        md += [f"### {source}: {what}", "", "| step | removed | left | share of the input |",
               "| --- | --- | --- | --- |"]
        md += [f"| {step} | {removed:,} | {left:,} | {left / total:.1%} |"
               for step, removed, left in funnel_steps(m, prefix)]
        md += ["", f"Bytes: {m[f'{prefix}bytes_kept']:,} of {m[f'{prefix}bytes_in']:,} kept.", ""]
        if n == 0:
            md += [f"![{FUNNEL}]({image(FUNNEL)})", ""]
        for reason, examples in funnel["examples"].get(source.removeprefix("data."), {}).items():
            if examples:
                md.append(f"Removed as **{reason}**, for example:")
                md += [f"- `{e['id']}`: {e['text'][:160].replace(chr(10), ' ')}..." for e in examples]
                md.append("")
    return "\n".join(md)


def trajectory_markdown(stage: str, out_dir: Path) -> str:
    """One episode of an online stage that rolled out with tools (its last `rollouts/step-N.jsonl`): the one with
    the most tool calls, turn by turn, with its rewards; "" where the stage wrote none."""
    files = sorted((out_dir / "rollouts").glob("step-*.jsonl"))
    if not files:
        return ""
    episodes = [json.loads(line) for line in files[-1].read_text().splitlines() if line.strip()]
    if not episodes:
        return ""
    e = max(episodes, key=lambda e: len(e["tool_calls"]))  # the first of the busiest
    step = int(files[-1].stem.removeprefix("step-"))
    rewards = ", ".join(f"{k} {number(v)}" for k, v in e["rewards"].items())
    md = [f"## A {stage} trajectory (step {step})", "",
          f"{e['turns']} turns, {len(e['tool_calls'])} tool calls ({e['tool_errors']} failed), ended by "
          f"{e['ended']}; {e['policy_tokens']} policy tokens, {e['tool_tokens']} tool tokens; reward "
          f"{number(e['reward'])} ({rewards}).", ""]

    def clip(text: str) -> str:
        text = (text or "").replace("\n", " ").replace("|", "\\|")
        return text if len(text) <= 300 else text[:300] + "..."

    md += ["| role | content |", "| --- | --- |"]
    for m in e["messages"]:
        content = clip(m.get("content"))
        calls = [c.get("function", c) for c in m.get("tool_calls") or []]
        content += "".join(f" **calls** `{c['name']}({json.dumps(c.get('arguments', {}))})`" for c in calls)
        md.append(f"| {m['role']} | {content} |")
    return "\n".join(md)


def make_plots(stages: dict, plots_dir: Path) -> list[str]:
    """Draw each stage's figure, kl.png and the curate stage's funnel; return the plot names (file stems), in stage
    order."""
    plots_dir.mkdir(exist_ok=True)
    names, kl = [], []
    for stage, info in stages.items():
        if (funnel := funnel_of(stage, info)) is not None:
            draw_funnel(json.loads(funnel.read_text())["metrics"], plots_dir / f"{FUNNEL}.png")
            names.append(FUNNEL)
        rows = read_log(Path(info["output"])) if info.get("output") else []
        panels = stage_panels(rows, stage)
        if panels:
            draw(panels, stage, plots_dir / f"{stage}.png")
            names.append(stage)
        if points := series(rows, "kl"):
            kl.append((stage, {"kl": points}, "KL (nats/response)"))
    if kl:
        draw(kl, "KL to the reference, by stage", plots_dir / "kl.png")
        names.append("kl")
    return names


def number(v) -> str:
    """A metric's value as the reports show it: thousands separated, floats to 4 significant digits."""
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"
    return f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v)


def metrics_table(metrics: dict[str, dict]) -> str:
    """Markdown table: one row per stage, its final metrics as key=value."""
    rows = ["| stage | metrics |", "| --- | --- |"]
    for stage, m in metrics.items():
        shown = ", ".join(f"{k}={number(v)}" for k, v in m.items() if not k.endswith("sha256"))
        rows.append(f"| {stage} | {shown} |")
    return "\n".join(rows)


def duration(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 60 else f"{int(seconds // 60)} min {seconds % 60:.0f} s"


def stage_table(stage: str, info: dict) -> str:
    """A stage's table: one row of its action, time and headline metrics; the stage's name links to its output."""
    m = info.get("metrics") or {}
    keys = [k for k in HEADLINE if m.get(k) is not None][:5] + sorted(k for k in m if k.startswith(HARNESS))[:4]
    output = info.get("output")
    name = f"[{stage}]({Path(output).resolve().as_uri()})" if output else stage
    seconds = info.get("seconds")
    head = ["stage", "action", "time"] + keys
    cells = [name, info.get("action", ""), duration(seconds) if isinstance(seconds, (int, float)) else ""]
    cells += [number(m[k]) + (f" ± {number(m[k + '_stderr'])}" if m.get(k + "_stderr") is not None else "")
              for k in keys]  # an estimate with its standard error
    table = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head), "| " + " | ".join(cells) + " |"]
    notes = [f"\nNot computed: {m['unscored']}."] if m.get("unscored") else []
    if approval := info.get("approval"):  # run.approve_before
        said = "approved" if approval.get("approve") else "rejected"
        notes.append(f"\nApproval: {said} at {approval.get('at', '')}" +
                     (f": {approval['note']}" if approval.get("note") else ""))
    return "\n".join(table + notes)


def markdown(record: dict, plots: list[str], image) -> str:
    """The report's markdown; `image(name)` gives the address of a plot."""
    md = [f"# gptforge run `{record['name']}`", ""]
    md += [f"**{record['outcome']}**", ""] if record.get("outcome") else []
    for stage, info in record["stages"].items():
        md += [stage_table(stage, info), ""]
    for stage, info in record["stages"].items():
        if FUNNEL in plots and funnel_of(stage, info) is not None:
            md += [funnel_markdown(Path(info["output"]), image), ""]
    for stage, info in record["stages"].items():
        if STAGES[stage].reads == "prompts" and info.get("output") and (  # an online stage's episodes
                episode := trajectory_markdown(stage, Path(info["output"]))):
            md += [episode, ""]
    md += [f"![{n}]({image(n)})\n" for n in plots if n != FUNNEL]
    return "\n".join(md)


def write_report(run_dir: Path) -> tuple[dict, str]:
    """Write report.json, report.md and plots/ for a run directory; return the report and report.md's text."""
    record = json.loads((run_dir / "run.json").read_text())
    stages = record["stages"]
    plots = make_plots(stages, run_dir / "plots")
    report = {"run": record["name"], **({"outcome": record["outcome"]} if "outcome" in record else {}),
              "stages": {s: {k: info.get(k) for k in ("action", "status", "output", "seconds", "metrics")}
                         | ({"approval": info["approval"]} if "approval" in info else {})
                         for s, info in stages.items()},
              "plots": [f"plots/{n}.png" for n in plots]}
    write_json_atomic(run_dir / "report.json", report)
    text = markdown(record, plots, lambda n: f"plots/{n}.png")
    (run_dir / "report.md").write_text(text)
    return report, text


def artifact_markdown(run_dir: Path) -> str:
    """The report as the Prefect UI shows it: the plots inline (PNG data URIs), so that they load in a browser
    that cannot reach this machine's files. Call after write_report."""
    record = json.loads((run_dir / "run.json").read_text())
    report = json.loads((run_dir / "report.json").read_text())

    def inline(name: str) -> str:
        return "data:image/png;base64," + base64.b64encode((run_dir / "plots" / f"{name}.png").read_bytes()).decode()

    return markdown(record, [Path(p).stem for p in report["plots"]], inline)
