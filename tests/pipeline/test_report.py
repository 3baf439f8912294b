import json
import re

from gptforge.pipeline.report import artifact_markdown, stage_panels, write_report

LOGS = {
    "pretrain": [{"step": 1, "loss": 3.0, "tokens_per_sec": 900.0}, {"step": 2, "loss": 2.5, "val_loss": 2.6}],
    "reward": [{"step": 1, "reward_accuracy": 0.6, "reward_margin": 0.4}, {"step": 2, "reward_accuracy": 0.8}],
    "ppo": [{"step": 1, "kl": 0.1, "reward_mean": 0.2}, {"step": 2, "kl": 0.3, "reward_mean": 0.4}],
    "dpo": [{"step": 1, "loss": 0.69, "kl": 0.0}, {"step": 2, "loss": 0.6, "kl": 0.2}],
}


def run_dir_with_logs(tmp_path):
    stages = {}
    for stage, rows in LOGS.items():
        out = tmp_path / "store" / stage
        (out / "logs").mkdir(parents=True)
        (out / "logs" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        metrics = {"val_loss": 2.6, "val_ppl": 13.5, "tokens_per_sec": 12345.6, "mfu": None, "parameters": 10,
                   "global_step": 2, "unigram_entropy": 5.0, "flops_per_token": 60.0, "peak_host_memory_gib": 0.5}
        stages[stage] = {"output": str(out), "action": "computed", "status": "complete", "seconds": 1.5,
                         "metrics": metrics if stage == "pretrain" else {"kl": 0.3}}
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run.json").write_text(json.dumps({"name": "r", "stages": stages}))
    return run_dir


def test_report_of_a_run(tmp_path):
    run_dir = run_dir_with_logs(tmp_path)
    report, markdown = write_report(run_dir)
    assert report["stages"]["ppo"]["metrics"] == {"kl": 0.3}
    # a figure a stage, and KL whenever a stage logs it (DPO's and PPO's, each on its own panel)
    assert report["plots"] == ["plots/pretrain.png", "plots/reward.png", "plots/ppo.png", "plots/dpo.png",
                               "plots/kl.png"]
    assert all((run_dir / p).stat().st_size > 1000 for p in report["plots"])
    # each stage a small table: stage (a link to its output), action, time and at most five headline metrics
    out = (tmp_path / "store" / "pretrain").as_uri()
    assert "| stage | action | time | val_loss | val_ppl | tokens_per_sec | peak_host_memory_gib |" in markdown
    assert f"| [pretrain]({out}) | computed | 1.5 s | 2.6 | 13.5 | 12,346 | 0.5 |" in markdown
    assert max(line.count("|") for line in markdown.splitlines()) <= 9
    assert (run_dir / "report.md").read_text() == markdown and "](plots/kl.png)" in markdown


def test_each_panel_holds_one_quantity_with_its_unit():
    panels = {title: (sorted(lines), unit) for title, lines, unit in stage_panels(LOGS["reward"] + LOGS["pretrain"])}
    assert panels == {"loss": (["loss", "val_loss"], "loss (nats/token)"),
                      "preference accuracy": (["reward_accuracy"], "chosen ranked first (fraction)"),
                      "preference margin": (["reward_margin"], "chosen - rejected (reward)"),
                      "throughput": (["tokens_per_sec"], "tokens/s")}
    # a pairwise loss is per pair, not per token
    assert stage_panels(LOGS["dpo"], "dpo")[0][::2] == ("loss", "pairwise loss (nats/pair)")
    assert stage_panels(LOGS["pretrain"], "pretrain")[0][::2] == ("loss", "loss (nats/token)")


def test_each_reward_gets_its_own_panel():
    rows = [{"step": 1, "reward_mean": 0.5, "rewards/math_equal": 0.25, "rewards/reward_model": 1.5},
            {"step": 2, "reward_mean": 0.7, "rewards/math_equal": 0.5, "rewards/reward_model": 1.25}]
    panels = {title: (lines, unit) for title, lines, unit in stage_panels(rows, "grpo")}
    assert panels["reward"] == ({"reward_mean": [(1, 0.5), (2, 0.7)]}, "mean reward (weighed total)")
    assert panels["rewards/math_equal"] == ({"rewards/math_equal": [(1, 0.25), (2, 0.5)]},
                                            "mean reward (before weighing)")
    assert list(panels)[-2:] == ["rewards/math_equal", "rewards/reward_model"]


def test_the_prefect_report_carries_its_plots_inline(tmp_path):
    run_dir = run_dir_with_logs(tmp_path)
    report, _ = write_report(run_dir)
    shown = artifact_markdown(run_dir)
    images = re.findall(r"!\[(\w+)\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", shown)
    assert [name for name, _ in images] == ["pretrain", "reward", "ppo", "dpo", "kl"]
    import base64

    assert base64.b64decode(images[0][1]) == (run_dir / "plots" / "pretrain.png").read_bytes()
    assert "(plots/" not in shown


def test_an_estimate_is_shown_with_its_standard_error():
    from gptforge.pipeline.report import stage_table

    table = stage_table("evaluate-dpo", {"metrics": {"kl": -0.004, "kl_stderr": 0.011}, "action": "computed"})
    assert "| -0.004 ± 0.011 |" in table  # a small negative KL reads as noise


class Counter:
    def reset(self, **row) -> str:
        self.total = 0
        return ""

    def add(self, amount: int) -> int:
        """Add.

        Args:
            amount: what to add
        """
        self.total += amount
        return self.total


def test_the_report_shows_an_online_stages_busiest_trajectory(tmp_path):
    from gptforge.model.agents.episode import Episode, write_trajectories
    from gptforge.model.agents.tools import Setup

    run_dir = run_dir_with_logs(tmp_path)
    quiet = Episode([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}], [1], [2], [1],
                    toolbox=Setup(Counter, [], 5).toolbox({}), turns=1, ended="answer")
    box = Setup(Counter, [], 5).toolbox({})
    box.call("add", {"amount": 3})
    busy = Episode([{"role": "user", "content": "Add 3 | say it"},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"type": "function", "function": {"name": "add", "arguments": {"amount": 3}}}]},
                    {"role": "tool", "name": "add", "content": "3"},
                    {"role": "assistant", "content": "It is 3."}], [1], [2, 3, 4, 5], [1, 0, 0, 1],
                   toolbox=box, turns=2, ended="answer")
    out = tmp_path / "store" / "ppo"
    write_trajectories(out / "rollouts", 1, [busy, quiet], [0.0, 0.0], {"exact_match": [0.0, 0.0]})
    write_trajectories(out / "rollouts", 2, [quiet, busy], [0.0, 1.5], {"exact_match": [0.0, 1.0]})
    _, markdown = write_report(run_dir)
    section = markdown[markdown.index("## A ppo trajectory (step 2)"):]
    assert "2 turns, 1 tool calls (0 failed), ended by answer; 2 policy tokens, 2 tool tokens; reward 1.5 " \
           "(exact_match 1)." in section
    assert "| user | Add 3 \\| say it |" in section  # a pipe in the text does not break the table
    assert '| assistant |  **calls** `add({"amount": 3})` |' in section
    assert "| tool | 3 |" in section and "| assistant | It is 3. |" in section
    assert "## A dpo trajectory" not in markdown  # stages without rollouts show none
