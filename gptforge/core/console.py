"""What a user reads while gptforge runs: gptforge's own lines. A warning or log line a library writes about its own
calls, which the user can do nothing about, is filtered here by its text, one entry each with the reason; every
other warning still shows. The libraries' per-file progress bars (loading weights, mapping datasets) are off; the
stages' own bars and the Trainer's stay. Each process that runs a stage or the CLI calls `quiet()` first (a process
it starts inherits the environment, a forked one the filters)."""

from __future__ import annotations

import functools
import logging
import os
import warnings

LIBRARY_WARNINGS = [
    # DeepSpeed 0.19.8 (deepspeed/comm/torch.py: get_all_gather_function) gathers through
    # torch.distributed.all_gather_into_tensor, which torch 2.13 deprecates for all_gather_single: twice a stage
    (FutureWarning, r"`torch\.distributed\.all_gather_into_tensor` is deprecated"),
    # TRL 1.16 (trl/models/utils.py: unwrap_model_for_generation) reads transformers 5.24's deprecated property
    (FutureWarning, r"`is_gradient_checkpointing` is deprecated"),
]
LIBRARY_LOGS = [
    # transformers' Trainer gives accelerate's plugin 1 step of accumulation on purpose (it accumulates itself), and
    # accelerate then finds DeepSpeed's config holding the real count: it says so, and keeps DeepSpeed's, as it should
    ("accelerate.accelerator", "Gradient accumulation steps mismatch"),
]
QUIET_BARS = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}


class Drop(logging.Filter):
    """Drops the log records whose message holds `text`."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


@functools.cache
def quiet() -> None:
    """Filter LIBRARY_WARNINGS and LIBRARY_LOGS in this process, and turn the libraries' progress bars off here and
    in the processes it starts (unless the user set those variables). Once a process."""
    for category, message in LIBRARY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name, text in LIBRARY_LOGS:
        logging.getLogger(name).addFilter(Drop(text))
    for key, value in QUIET_BARS.items():
        os.environ.setdefault(key, value)
