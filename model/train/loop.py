"""What every one of our training loops does around its own step (pretrain, sft and reward): resume, the bad-step
guard, micro-batch accumulation, the clock, the progress bar, logging, checkpoints and export. The step itself, the
batch, the forward pass and the loss stay in the stage, where a reader sees them (nanoGPT's loop, held by one
scaffold rather than written three times):

    loop = TrainLoop("sft", cfg.sft, engine, scheduler, grad_accum, order, ckpt, elastic, out_dir, ...)
    while loop.running():
        for ids in loop.micro_batches(order.next_ids):
            loss = ...                                   # the stage's own forward pass
            loop.backward(loss, tokens=n)                # observed by the guard, then engine.backward and step
        if not loop.advance():                           # a bad step: skipped, or rolled back
            continue
        if loop.due(cfg.sft.log_every): loop.log_train()
        if loop.due(cfg.sft.eval_every): ...             # the stage's own evaluation
        loop.save()                                      # every save_every steps
    metrics = loop.finish(tokenizer, cfg.model.shard_bytes)

PPO keeps a loop of its own (rollouts, then several epochs over them) and uses the guard directly; distill takes a
step's rollouts first and gives each micro-batch of them to `backward`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from gptforge.model.export import export_model
from gptforge.model.train.checkpoints import resume, save_step
from gptforge.model.train.distributed import all_mean, all_sum, barrier
from gptforge.model.train.engine import grad_norm
from gptforge.model.train.guard import StepGuard
from gptforge.model.train.metrics import MetricsLog, Throughput, step_line


class TrainLoop:
    """One stage's loop around its steps (see the module's doc). `order` is the stage's resumable data order
    (its `state_dict` goes into every checkpoint); `tokens_per_step`: a fixed global count of a step's tokens
    (pretraining's windows), else each micro-batch's own count is given to `backward` and summed over ranks;
    `mfu`: tokens/s -> model FLOPs utilisation, logged and printed beside the loss where given."""

    def __init__(self, stage: str, section, engine, scheduler, grad_accum: int, order, ckpt: Path | None,
                 elastic: bool, out_dir: Path, rank: int, world: int, device: torch.device,
                 tokens_per_step: int | None = None, mfu: Callable[[float | None], float | None] | None = None):
        self.stage, self.section, self.engine, self.scheduler = stage, section, engine, scheduler
        self.grad_accum, self.order, self.rank, self.world, self.device = grad_accum, order, rank, world, device
        self.ckpt_root, self.tokens_per_step, self.mfu = out_dir / "checkpoints", tokens_per_step, mfu
        self.state = resume({"model": engine}, ckpt, elastic, rank, world, stage)  # the resumed client state
        self.step = self.state["step"] if self.state else 0
        self.guard = StepGuard(section, stage, engine, device, rank, world)
        if self.state:
            order.load_state_dict(self.state["loader"])
            self.guard.load_state_dict(self.state.get("guard"))
        self.first_step = self.step
        self.log = MetricsLog(out_dir / "logs", rank, resume_step=self.step)
        self.bar = tqdm(total=section.max_steps, initial=self.step, desc=stage, file=sys.stderr, disable=rank != 0,
                        mininterval=2.0)
        self.throughput = Throughput() if tokens_per_step else Throughput(reduce=lambda n: all_sum([n], device)[0])
        self.train_loss = float("nan")

    def running(self) -> bool:
        """Whether a step is left to take; starts its clock and its sums."""
        self.t0, self.step_loss, self.step_tokens, self.means = time.perf_counter(), 0.0, 0, {}
        return self.step < self.section.max_steps

    def micro_batches(self, draw: Callable) -> Iterator:
        """The step's grad_accum micro-batches, each `draw()`'s next through the guard's drills."""
        for _ in range(self.grad_accum):
            yield self.guard.next(draw)

    def backward(self, loss: torch.Tensor, backward: torch.Tensor | None = None, tokens: int = 0,
                 **means: float) -> None:
        """One micro-batch: its `loss` observed by the guard (the step's loss is their mean), `backward` (default:
        the loss) through the engine, gated to NaN where the step was judged bad, and the engine stepped at the
        accumulation boundary. `means`: numbers logged as the step's mean over micro-batches and ranks."""
        self.step_loss += self.guard.observe(loss) / self.grad_accum
        self.engine.backward(self.guard.gate(loss if backward is None else backward))
        self.guard.step()
        self.step_tokens += tokens
        for name, value in means.items():
            self.means[name] = self.means.get(name, 0.0) + value / self.grad_accum

    def advance(self) -> bool:
        """After the step's micro-batches: whether it counts. A bad step is skipped, or rolled back to the newest
        valid checkpoint (the data goes on past the bad batches)."""
        self.step, counts = self.guard.advance(self.step, {"model": self.engine}, self.ckpt_root)
        if not counts:
            self.bar.n = self.step
            return False
        self.throughput.step(time.perf_counter() - self.t0, self.tokens_per_step or self.step_tokens)
        self.bar.update(1)
        return True

    def due(self, every: int) -> bool:
        """Whether this step is one of every `every`, or the last."""
        return self.step % every == 0 or self.step == self.section.max_steps

    def log_train(self, **extra) -> None:
        """Log the step: its loss (mean over ranks), lr, gradient norm, tokens/s (and mfu), bad steps, the means
        given to `backward`, and `extra`; rank 0 prints it."""
        self.train_loss = all_mean(self.step_loss, self.device)
        tps = self.throughput.window_rate()
        lr = self.scheduler.get_last_lr()[0]
        mfu = {"mfu": self.mfu(tps)} if self.mfu else {}
        self.log.log(self.step, loss=self.train_loss, lr=lr, grad_norm=grad_norm(self.engine), tokens_per_sec=tps,
                     **mfu, bad_steps=self.guard.bad_steps,
                     **{k: all_mean(v, self.device) for k, v in self.means.items()}, **extra)
        if self.rank == 0:
            tqdm.write(step_line(self.step, self.train_loss, lr, tps, mfu.get("mfu", False)), file=sys.stderr)

    def save(self, rank_state: Callable[[], dict] | None = None, **state) -> None:
        """A step checkpoint every save_every steps (not at the last: the export follows): the engine, the data
        order, the guard's counts and the stage's own `state` (`rank_state()`: each rank's own, asked only then)."""
        if self.step % self.section.save_every == 0 and self.step < self.section.max_steps:
            save_step({"model": self.engine}, self.ckpt_root, self.step,
                      {"step": self.step, "loader": self.order.state_dict(), **state,
                       "guard": self.guard.state_dict()}, self.rank, self.world, self.section.keep_last,
                      rank_state() if rank_state else None)

    def finish(self, tokenizer, out_dir: Path, shard_bytes: int) -> dict:
        """Export the model to `out_dir/model` (every rank takes part: ZeRO-3 gathers) and return the metrics every
        loop reports."""
        self.bar.close()
        self.log.close()
        tokens_per_sec = self.throughput.rate()
        export_model(self.engine, tokenizer, out_dir / "model", self.rank, shard_bytes)
        barrier()
        return {"train_loss": round(self.train_loss, 6), "global_step": self.step, "tokens_per_sec": tokens_per_sec,
                "bad_steps": self.guard.bad_steps, "rollbacks": self.guard.rollbacks}
