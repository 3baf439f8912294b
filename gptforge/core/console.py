"""What a user reads while gptforge runs: gptforge's own lines. A warning a library raises about its own calls, which
the user can do nothing about, is filtered here by its category and text, one entry each with the reason; every
other warning still shows. Each process that runs a stage or the CLI calls `quiet()` first (a forked one inherits
it)."""

from __future__ import annotations

import warnings

LIBRARY_WARNINGS = [
    # DeepSpeed 0.19.8 (deepspeed/comm/torch.py: get_all_gather_function) gathers through
    # torch.distributed.all_gather_into_tensor, which torch 2.13 deprecates for all_gather_single: twice a stage
    (FutureWarning, r"`torch\.distributed\.all_gather_into_tensor` is deprecated"),
]


def quiet() -> None:
    """Filter LIBRARY_WARNINGS in this process."""
    for category, message in LIBRARY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
