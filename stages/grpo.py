"""GRPO stage: online RL of the SFT policy with TRL's GRPOTrainer: num_generations completions a prompt, their
rewards less the group's mean (divided by the group's or batch's std, or not: preference.grpo.scale_rewards) as
the advantage, in TRL's loss of preference.grpo.loss_type (grpo, dr_grpo, dapo, bnpo, cispo, sapo) with the
ratio per token or per sequence (GSPO: importance_sampling_level). Rewarded by preference.rewards on the online
prompts (data.prompts), with an optional ptx term, under DeepSpeed ZeRO (accelerate launch); the body it shares
with rloo is gptforge.model.trainers.trl_online.

    gptforge stage grpo -c CONFIG      (finds its inputs and output in the stage store)
    accelerate launch --use_deepspeed --zero_stage 2 --num_processes 2 -m gptforge.stages.grpo \\
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
RANK_IMPORTS = ("trl.trainer.grpo_trainer",)


CISPO_EPSILON_MAX = 5.0  # CISPO's bound on its weight when none is set: ScaleRL's epsilon max, TRL's advice


def algorithm_args(cfg: PipelineConfig) -> dict:
    """GRPOConfig's fields of GRPO's own: the advantage's scale, the loss, the ratio's level, the upper clip. TRL
    bounds CISPO's weight by epsilon_high itself (not 1 + epsilon_high), so an unset bound there is CISPO's own
    (5.0), not the clip's lower bound (0.2, which would scale every weight down to 0.2)."""
    gc = cfg.preference.grpo
    high = gc.epsilon_high if gc.epsilon_high is not None or gc.loss_type != "cispo" else CISPO_EPSILON_MAX
    return dict(scale_rewards=gc.scale_rewards, loss_type=gc.loss_type,
                importance_sampling_level=gc.importance_sampling_level, epsilon_high=high)


def run(cfg: PipelineConfig, inputs: dict[str, Path], out_dir: Path) -> dict:
    return trl_online.train(cfg, inputs, out_dir, STAGES["grpo"], **algorithm_args(cfg))


if __name__ == "__main__":
    exit_process(main("grpo", run))
