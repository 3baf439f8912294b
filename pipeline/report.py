"""The run report: `runs/<run>/report.json`, `report.md` and `plots/*.png` (loss, reward and KL curves),
built from run.json and each stage's logs/metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

from gptforge.core.files import write_json_atomic

# Which logged keys go on which plot.
CURVES = {
    "loss": ("loss", "val_loss"),
    "reward": ("reward_mean", "reward_accuracy", "train_reward_margin"),
    "kl": ("kl",),
}


def read_log(stage_dir: Path) -> list[dict]:
    path = stage_dir / "logs" / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def curves(stages: dict) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """{plot: {"stage/key": [(step, value), ...]}}"""
    out: dict[str, dict] = {name: {} for name in CURVES}
    for stage, info in stages.items():
        rows = read_log(Path(info["output"])) if info.get("output") else []
        for plot, keys in CURVES.items():
            for key in keys:
                points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
                if points:
                    out[plot][f"{stage}/{key}"] = points
    return out


def plot(series: dict[str, list[tuple[int, float]]], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, points in series.items():
        ax.plot([p[0] for p in points], [p[1] for p in points], label=label)
    ax.set_xlabel("step")
    ax.set_title(title)
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def markdown_table(stages: dict) -> str:
    keys = sorted({k for info in stages.values() for k in (info.get("metrics") or {}) if not k.endswith("sha256")})
    rows = ["| stage | action | seconds | " + " | ".join(keys) + " |", "|" + " --- |" * (len(keys) + 3)]
    for stage, info in stages.items():
        m = info.get("metrics") or {}
        cells = [_fmt(m.get(k, "")) for k in keys]
        rows.append(f"| {stage} | {info.get('action', '')} | {info.get('seconds', '')} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def write_report(run_dir: Path) -> tuple[dict, str]:
    """Write report.json, report.md and plots/ for a run directory; return the report and its markdown."""
    record = json.loads((run_dir / "run.json").read_text())
    stages = record["stages"]
    plots_dir = run_dir / "plots"
    plots_dir.mkdir(exist_ok=True)
    images = []
    for name, series in curves(stages).items():
        if series:
            plot(series, name, plots_dir / f"{name}.png")
            images.append(name)
    report = {"run": record["name"], "stages": {s: {k: info.get(k) for k in ("action", "status", "output", "seconds",
                                                                                "metrics")}
                                                for s, info in stages.items()},
              "plots": [f"plots/{n}.png" for n in images]}
    write_json_atomic(run_dir / "report.json", report)
    md = [f"# gptforge run `{record['name']}`", "", markdown_table(stages), ""]
    md += [f"![{n}](plots/{n}.png)" for n in images]
    text = "\n".join(md) + "\n"
    (run_dir / "report.md").write_text(text)
    return report, text
