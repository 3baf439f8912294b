"""RLOO stage: online RL of the SFT policy with TRL's RLOOTrainer, rewarded by the trained reward model
(and, with preference.verifier_reward, a rule-based verifier of the demo answers), under DeepSpeed ZeRO.

    accelerate launch --use_deepspeed --zero_stage 2 --num_processes 2 -m stages.rloo --config CONFIG

The shared wiring (Trainer arguments, resume, export, held-out report) is model.hf_trainer.run_online.
"""

from __future__ import annotations

import sys
from pathlib import Path

from model.hf_trainer import run_online
from pipeline.config import PipelineConfig
from pipeline.entry import stage_main

OUTPUTS = {"model": "model"}


def run(cfg: PipelineConfig, inputs: dict[str, Path], out_dir: Path) -> dict:
    from trl import RLOOConfig, RLOOTrainer

    return run_online(cfg, inputs, out_dir, "rloo", RLOOTrainer, RLOOConfig)


if __name__ == "__main__":
    sys.exit(stage_main("rloo", run, OUTPUTS))
