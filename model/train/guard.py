"""Bad steps, for every training loop: a step whose loss or global gradient norm is not finite on any rank, or,
with `<stage>.spike_factor`, whose loss is over that factor times the running median of the last `spike_window`
good steps, is skipped on every rank: no optimizer update, no scheduler step. It is counted in `bad_steps` and
logged with its step. After `max_bad_steps` bad steps in a row the stage goes back to its newest valid checkpoint
and goes on drawing the batches that follow the bad ones (Megatron skips non-finite steps; PaLM and OLMo restart
from a checkpoint before a spike and skip the data that caused it); the loader's position and this guard's counts
are in every later checkpoint, so a resume repeats that order. A stage that would roll back more than
`max_rollbacks` times fails with one error line, its last good checkpoint kept.

The skip is DeepSpeed's own: its ZeRO, bf16 and fp16 optimizers drop a step whose gradient norm is not finite
(zeroing the gradients, leaving the moments and the schedule as they were, `engine.was_step_applied()` false).
A rank's non-finite loss makes its gradients, and so the reduced ones of every rank, non-finite: the step is
dropped everywhere with no collective of its own, and `settle` asks the ranks why only once it was. A spike is
judged before backward, on the mean loss over the ranks, and a spiking step has the last micro-batch's loss
multiplied by NaN so that DeepSpeed drops it the same way on every rank (a Trainer's steps are all judged so). A
plain torch optimizer (ZeRO-0 in fp32) has no such path; `step` gives it one.

Drills: `GPTFORGE_FAULTS` (tests and fire drills only) injects faults into this process's micro-batches, counted
from 1 as they are drawn: `nan@3` makes the 3rd one's loss NaN, `spike@6` multiplies it by 10, `nan@5+` does so
from the 5th on, `drop@3` draws the next batch instead (a run that never saw the 3rd), `hang@4` sleeps for an hour
inside the 4th. A `:R` suffix (`nan@3:1`) limits one to rank R.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path

import torch

from gptforge.core.errors import UserError
from gptforge.model.train.checkpoints import newest_valid_checkpoint, resume
from gptforge.model.train.distributed import heartbeat

SPIKE = 10.0  # what a spike drill multiplies the loss by
HEARTBEAT_EVERY = 1.0  # seconds between a rank's heartbeats: where it was, for a timed-out collective's message


class Faults:
    """The drills of GPTFORGE_FAULTS that reach this rank (see the module's doc)."""

    def __init__(self, spec: str, rank: int):
        self.rules = []
        for item in filter(None, (s.strip() for s in spec.split(","))):
            kind, _, at = item.partition("@")
            at, _, only = at.partition(":")
            if kind not in ("nan", "spike", "drop", "hang") or not at.rstrip("+").isdigit():
                raise UserError(f"GPTFORGE_FAULTS: cannot read {item!r} (kind@draw[+][:rank], kind nan, spike, "
                                "drop or hang)")
            if not only or int(only) == rank:
                self.rules.append((kind, int(at.rstrip("+")), at.endswith("+")))
        self.draws = 0

    def at(self, draw: int) -> set[str]:
        return {kind for kind, n, onwards in self.rules if draw == n or (onwards and draw > n)}


class StepGuard:
    """One stage's bad-step guard (see the module's doc). Per micro-batch: `next` draws (with drills), `observe`
    takes its loss, `gate` the tensor given to backward, `step` steps the engine; once a step, `settle` says
    "ok", "skip" or "rollback", and `rollback` loads the newest valid checkpoint (`advance`: both, for a loop
    that counts good steps)."""

    def __init__(self, section, stage: str, engine, device: torch.device, rank: int, world: int,
                 key: str | None = None, judge_every_step: bool = False):
        self.key = key or stage  # the config section its keys are named by
        # Our loops step through `step`, which drops a step whose reduced gradients are not finite on every rank: a
        # rank's NaN loss makes them so, and needs no collective of its own before backward. Only a spike is judged
        # there (on the mean loss over the ranks). A Trainer steps by itself: it judges every step.
        self.judge_every_step = judge_every_step
        self.stage, self.engine, self.device, self.rank, self.world = stage, engine, device, rank, world
        self.factor, self.max_bad, self.max_rollbacks = section.spike_factor, section.max_bad_steps, \
            section.max_rollbacks
        self.history: deque[float] = deque(maxlen=section.spike_window)
        self.bad_steps = self.rollbacks = self.in_a_row = 0
        self.faults = Faults(os.environ.get("GPTFORGE_FAULTS", ""), rank)
        self.heard = -math.inf  # when this rank last wrote its heartbeat (time.monotonic)
        self._reset()

    def _reset(self) -> None:
        self.losses: list[float] = []
        self.verdict: str | None = None
        self.applied = True
        self.scale = 1.0
        self.mean = math.nan  # the step's mean loss over the ranks, once judged

    # -- per micro-batch

    def next(self, draw):
        """`draw()`'s next batch, through the drills: a dropped batch is drawn past, a hang sleeps."""
        while True:
            self.faults.draws += 1
            kinds = self.faults.at(self.faults.draws)
            if "hang" in kinds or time.monotonic() - self.heard >= HEARTBEAT_EVERY:  # a store round trip each
                heartbeat(self.rank, f"{self.stage} micro-batch {self.faults.draws} of its process")
                self.heard = time.monotonic()
            if "hang" in kinds:
                print(f"[drill] rank {self.rank} hangs in micro-batch {self.faults.draws}", file=sys.stderr,
                      flush=True)
                time.sleep(3600)
            batch = draw()
            if "drop" not in kinds:
                self.scale = math.nan if "nan" in kinds else SPIKE if "spike" in kinds else 1.0
                return batch

    def observe(self, loss: torch.Tensor, boundary: bool | None = None) -> float:
        """This micro-batch's loss, drills applied, as the stage reports it. At the step's last micro-batch
        (`boundary`, by default the engine's accumulation boundary) every rank learns whether the step is bad (a
        collective) where a spike can make it so or the guard judges every step; else `settle` asks why a step was
        dropped."""
        value = loss.item() * self.scale
        self.losses.append(value)
        if (self.factor or self.judge_every_step) and (
                boundary if boundary is not None else self.engine.is_gradient_accumulation_boundary()):
            self.verdict = self.judge(self.local_mean())
        return value

    def local_mean(self) -> float:
        return sum(self.losses) / len(self.losses)

    def gate(self, loss: torch.Tensor) -> torch.Tensor:
        """What backward takes: the loss with this micro-batch's drill, NaN where the step was judged bad."""
        return loss * (self.scale * (math.nan if self.verdict else 1.0))

    def step(self, engine=None) -> bool:
        """engine.step(); a step whose gradients are not finite leaves weights, optimizer and schedule as they
        were. False where the optimizer step was dropped."""
        engine = engine or self.engine
        boundary = engine.is_gradient_accumulation_boundary()
        optimizer = engine.optimizer
        if not boundary or hasattr(optimizer, "overflow"):  # DeepSpeed's optimizers drop it themselves
            engine.step()
            applied = not boundary or engine.was_step_applied()
        else:
            # ZeRO-0 in fp32: the gradients are whole and reduced by now, the same on every rank (one sync)
            grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
            applied = not grads or bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())
            with _skipped(optimizer, not applied):
                engine.step()
        self.applied = self.applied and applied
        return applied

    # -- once a step

    def judge(self, loss: float) -> str | None:
        """Why the step of mean local loss `loss` is bad on any rank (None: it is not); every rank calls it."""
        finite = math.isfinite(loss)
        t = torch.tensor([0.0 if finite else 1.0, loss if finite else 0.0], dtype=torch.float64, device=self.device)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(t)
        if t[0] > 0:
            return f"loss NaN/Inf on {int(t[0])} of {self.world} rank(s)"
        mean = t[1].item() / self.world
        self.mean = mean
        if self.factor and len(self.history) == self.history.maxlen:
            median = statistics.median(self.history)
            if mean > self.factor * median:
                return (f"loss {mean:.4g} over spike_factor {self.factor:g} x the median {median:.4g} of the last "
                        f"{len(self.history)} steps")
        return None

    def settle(self, step: int) -> str:
        """The step's outcome once its optimizer step is taken: "ok", "skip" (logged and counted) or "rollback"
        (`max_bad_steps` bad steps in a row). Raises after `max_rollbacks` rollbacks."""
        verdict = self.verdict
        if verdict is None and not self.applied:  # dropped on every rank: every rank asks why
            verdict = (self.judge(self.local_mean()) if self.losses else None) or "gradient norm NaN/Inf"
        mean = self.mean
        self._reset()
        if verdict is None:
            if math.isfinite(mean):
                self.history.append(mean)
            self.in_a_row = 0
            return "ok"
        self.bad_steps += 1
        self.in_a_row += 1
        if self.rank == 0:
            print(f"warning: [{self.stage}] step {step}: {verdict}; step skipped ({self.bad_steps} bad, "
                  f"{self.in_a_row} in a row)", file=sys.stderr, flush=True)
        if self.in_a_row < self.max_bad:
            return "skip"
        if self.rollbacks >= self.max_rollbacks:
            raise UserError(
                f"{self.stage}: step {step}: {verdict}, {self.in_a_row} bad steps in a row "
                f"({self.key}.max_bad_steps={self.max_bad}) after {self.rollbacks} rollback(s) "
                f"({self.key}.max_rollbacks={self.max_rollbacks}); stopped, the last good checkpoint is kept: lower "
                f"{self.key}.lr, set {self.key}.grad_clip, or raise max_bad_steps / max_rollbacks")
        self.rollbacks += 1
        self.in_a_row = 0
        return "rollback"

    def advance(self, step: int, engines: dict, ckpt_root: Path) -> tuple[int, bool]:
        """After the optimizer step that would make `step` + 1: (the step count, whether that step counts). A bad
        step leaves the count; a rollback sets it to the checkpoint's (the loader stays where it is)."""
        outcome = self.settle(step + 1)
        if outcome == "rollback":
            return self.rollback(engines, ckpt_root, step + 1)["step"], False
        return (step, False) if outcome == "skip" else (step + 1, True)

    def rollback_point(self, ckpt_root: Path, step: int, pattern: str = "step-*") -> Path:
        """The newest valid checkpoint to roll back to at `step` (said on rank 0); one error line where none is."""
        ckpt = newest_valid_checkpoint(ckpt_root, self.rank, self.world, pattern)
        if ckpt is None:
            raise UserError(f"{self.stage}: step {step}: {self.max_bad} bad steps in a row and no checkpoint to go "
                            f"back to; stopped: lower {self.key}.save_every, {self.key}.lr, or set "
                            f"{self.key}.grad_clip")
        if self.rank == 0:
            print(f"warning: [{self.stage}] step {step}: {self.max_bad} bad steps in a row; rolling back to {ckpt} "
                  f"(rollback {self.rollbacks} of at most {self.max_rollbacks}), the data order moves past them",
                  file=sys.stderr, flush=True)
        return ckpt

    def rollback(self, engines: dict, ckpt_root: Path, step: int) -> dict:
        """Load the newest valid checkpoint into `engines`; its client state. The caller keeps its loader where it
        is, past the bad batches."""
        state = resume(engines, self.rollback_point(ckpt_root, step), False, self.rank, self.world, self.stage)
        self.history = deque(state.get("guard", {}).get("history", []), maxlen=self.history.maxlen)
        return state

    def state_dict(self) -> dict:
        return {"bad_steps": self.bad_steps, "rollbacks": self.rollbacks, "history": list(self.history)}

    def load_state_dict(self, state: dict | None) -> None:
        if state:
            self.bad_steps, self.rollbacks = state["bad_steps"], state["rollbacks"]
            self.history.extend(state["history"])


@contextmanager
def _skipped(optimizer, skip: bool):
    """A plain torch optimizer's step made DeepSpeed's dropped one: no update, and the engine, reading
    `overflow`, steps no scheduler."""
    if not skip:
        yield
        return
    step = optimizer.step
    optimizer.step, optimizer.overflow = (lambda *a, **k: None), True
    try:
        yield
    finally:
        optimizer.step = step
        del optimizer.overflow
