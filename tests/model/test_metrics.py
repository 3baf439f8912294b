import json

import pytest

from gptforge.model.train.metrics import NAMES, MetricsLog, Throughput, from_trainer


def test_log_refuses_names_outside_the_vocabulary(tmp_path):
    log = MetricsLog(tmp_path, rank=0)
    log.log(1, loss=2.0, lr=1e-3)
    with pytest.raises(ValueError, match="train/loss"):
        log.log(2, **{"train/loss": 1.0})
    log.close()
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        {"step": 1, "loss": 2.0, "lr": 1e-3}]


def test_a_resumed_log_drops_what_came_after_its_checkpoint(tmp_path):
    log = MetricsLog(tmp_path, rank=0)
    for step in range(1, 7):
        log.log(step, loss=float(step))
    log.close()
    resumed = MetricsLog(tmp_path, rank=0, resume_step=4)  # the run was killed after step 6, checkpoint at 4
    resumed.log(5, loss=50.0)
    resumed.close()
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]


def test_trl_logs_in_our_names():
    logs = {"loss": 0.7, "learning_rate": 1e-5, "rewards/margins": 0.3, "rewards/accuracies": 0.75, "kl": 0.02,
            "completions/mean_length": 5.0, "epoch": 0.1, "completions/max_length": 8, "num_tokens": 1000.0}
    out = from_trainer(logs)
    assert out == {"loss": 0.7, "lr": 1e-5, "train_reward_margin": 0.3, "train_reward_accuracy": 0.75,
                   "kl_per_token": 0.02, "response_length": 5.0, "kl": pytest.approx(0.1)}
    assert set(out) <= set(NAMES)


def test_throughput_leaves_out_warm_up_and_sums_processes():
    t = Throughput(reduce=lambda tokens: 2 * tokens, warmup=2)  # two processes with the same count
    for seconds, tokens in [(9.0, 100), (9.0, 100), (1.0, 100), (1.0, 300)]:
        t.step(seconds, tokens)
    assert t.window_rate() == pytest.approx(2 * 400 / 2.0)
    assert t.window_rate() is None  # nothing since
    t.step(2.0, 200)
    assert t.window_rate() == pytest.approx(400 / 2.0)
    assert t.rate() == pytest.approx(2 * 600 / 4.0)


def test_a_start_no_longer_than_the_warm_up_is_timed_whole():
    t = Throughput(warmup=5)
    for _ in range(3):
        t.step(2.0, 100)
    assert t.window_rate() is None and t.rate() == pytest.approx(50.0)  # a 3-step run still reports its rate
