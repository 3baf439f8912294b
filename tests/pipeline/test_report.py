import json

from gptforge.pipeline.report import write_report


def test_report_of_a_run(tmp_path):
    stages = {}
    for stage, rows in {"pretrain": [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.5, "val_loss": 2.6}],
                        "ppo": [{"step": 1, "kl": 0.1, "reward_mean": 0.2}, {"step": 2, "kl": 0.3}]}.items():
        out = tmp_path / "store" / stage
        (out / "logs").mkdir(parents=True)
        (out / "logs" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        stages[stage] = {"output": str(out), "action": "computed", "status": "complete", "seconds": 1.5,
                         "metrics": {"val_loss": 2.6} if stage == "pretrain" else {"kl": 0.3}}
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run.json").write_text(json.dumps({"name": "r", "stages": stages}))
    report, markdown = write_report(run_dir)
    assert report["stages"]["ppo"]["metrics"] == {"kl": 0.3}
    assert sorted(report["plots"]) == ["plots/kl.png", "plots/loss.png", "plots/reward.png"]
    assert all((run_dir / p).stat().st_size > 1000 for p in report["plots"])
    assert "| pretrain | computed | 1.5 |" in markdown and (run_dir / "report.md").read_text() == markdown
