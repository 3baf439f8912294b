"""RLOO stage: online RL of the SFT policy with TRL's RLOOTrainer: num_generations completions a prompt, each one's
advantage its reward less the mean reward of the others (REINFORCE leave-one-out). Rewarded by preference.rewards
on the online prompts (data.prompts), with an optional ptx term, under DeepSpeed ZeRO (accelerate launch); the
body it shares with grpo is gptforge.model.trainers.trl_online.

    gptforge stage rloo -c CONFIG      (finds its inputs and output in the stage store)
    accelerate launch --use_deepspeed --zero_stage 2 --num_processes 2 -m gptforge.stages.rloo \\
        --config CONFIG --out DIR --input sft=DIR [--input reward=DIR]

The held-out report is the evaluation step's (gptforge.stages.evaluate).
"""

from __future__ import annotations

from pathlib import Path

from gptforge.core.config import PipelineConfig
from gptforge.core.declarations import STAGES
from gptforge.model.trainers import trl_online
from gptforge.stages.entry import exit_process, main

# imported by its ranks once they have joined their group; by the warm agent before (gptforge.stages.entry.preload)
RANK_IMPORTS = ("trl.trainer.rloo_trainer",)


def run(cfg: PipelineConfig, inputs: dict[str, Path], out_dir: Path) -> dict:
    return trl_online.train(cfg, inputs, out_dir, STAGES["rloo"])


if __name__ == "__main__":
    exit_process(main("rloo", run))
