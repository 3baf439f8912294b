"""The training runtime every training stage shares: joining the process group (distributed), DeepSpeed engines
(engine), exact-resume checkpoints (checkpoints), the bad-step and hung-rank guard (guard), sequence parallelism,
tiled logits and MLPs (tiling), the losses, the metrics log and trackers, and the TRL Trainer's glue (hf_trainer)."""
