"""The ptx term in TRL's online trainers: the loss of the preference pairs' chosen responses added to the policy
loss (InstructGPT's PPO-ptx)."""

from __future__ import annotations

from gptforge.data.chat import ChosenRows
from gptforge.model.train.losses import causal_lm_loss


def with_ptx(trainer_cls, rows: ChosenRows, coef: float):
    """`trainer_cls` with coef * the loss of `rows` added to each micro-batch's policy loss: PPO-ptx
    (InstructGPT), for TRL's GRPO and RLOO. The update that picks the rows is counted from the optimizer step
    and the micro-step within it, so a resumed run draws the same."""

    class PtxTrainer(trainer_cls):
        _ptx_at = (-1, 0)  # (optimizer step, micro-steps taken in it)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            step, k = self._ptx_at if self._ptx_at[0] == self.state.global_step else (self.state.global_step, 0)
            self._ptx_at = (step, k + 1)
            x, a, y = rows.batch(step * self.args.gradient_accumulation_steps + k)
            ptx = causal_lm_loss(model(input_ids=x.to(loss.device), attention_mask=a.to(loss.device)).logits,
                                 y.to(loss.device))
            self._metrics["train"]["ptx_loss"].append(self.accelerator.gather(ptx.detach()).mean().item())
            return loss + coef * ptx

    PtxTrainer.__name__ = PtxTrainer.__qualname__ = f"Ptx{trainer_cls.__name__}"
    return PtxTrainer
