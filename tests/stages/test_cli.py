"""The command line every stage module shares (stages/entry.py)."""

import json

import torch

from gptforge.model.train.distributed import all_sum, setup_distributed
from gptforge.stages.entry import RESULT, main
from tests.helpers import config, free_port


def test_a_finished_stage_leaves_its_process_group(tmp_path, monkeypatch):
    """A process that exits still in its gloo group can abort at exit (-6) and fail a stage that had finished
    (pytorch/pytorch#190489): a stage leaves the group once it has succeeded."""
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "DS_ACCELERATOR": "cpu"}.items():
        monkeypatch.setenv(key, value)  # restored afterwards: this process is pytest's
    _, path = config(tmp_path)
    joined = []

    def run(cfg, inputs, out_dir):
        _, _, device = setup_distributed()
        joined.append(torch.distributed.is_initialized())
        return {"val_loss": all_sum([1.5], device)[0]}

    assert main("sft", run, ["--config", str(path), "--out", str(tmp_path / "out")]) == 0
    assert joined == [True] and not torch.distributed.is_initialized()
    assert json.loads((tmp_path / "out" / RESULT).read_text())["metrics"]["val_loss"] == 1.5
