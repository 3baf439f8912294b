"""The rollout room inside TRL's online trainers: each prompt row of a generation batch (TRL's sampler has already
repeated it num_generations times) is one episode of gptforge.model.rollout.episode, sampled by the trainer's own
policy, so that PPO, GRPO and RLOO share one call parser, one timeout and one mask.

What the episodes hold reaches the trainer token-exact: the prompt's ids, the ids after it (the turns as sampled and
the template's tokens between them) and the policy's mask (1 on its own tokens). The completions the rewards read
are the episode's turns as messages (the policy's turns and the tool results), so that a reward model scores the
trajectory as the template renders it and a reward function reads the last turn; `messages` (the whole trajectory)
and `environment_reward` (its environment's `get_reward()`) are extra columns, as in PPO.

- GRPOTrainer, through its `rollout_func` hook: the mask is its `env_mask`, which TRL multiplies into the mask of
  its per-token loss and of its KL term.
- RLOOTrainer (TRL 1.16) has no such hook, and one completion mask serves its attention, its sequence log-ratio and
  its KL penalty. The episodes replace its prompt tokenization and its single turn; the policy's mask travels with
  the batch (`env_mask`) and multiplies the per-token log-probabilities its loss and its KL sum, so that both are
  over the policy's tokens alone while attention still sees the tool results. (Its logged KL, a mean per token,
  counts the tokens between turns in its denominator.)

Why not TRL's own tool loop (GRPO's `tools=`, `environment_factory=`): it too concatenates ids rather than
tokenizing decoded text again, but it runs the user's tools with no timeout, so that one stalled tool stalls every
rank, and it parses calls through a response schema it sets only for the chat templates it knows, which gptforge's
own is not.
"""

from __future__ import annotations

import inspect
from pathlib import Path

from gptforge.model.eval.generation import id_sampler, stop_ids
from gptforge.model.rollout.episode import Episode, rollouts, write_trajectories
from gptforge.model.rollout.tools import Setup


def agent_trainer(trainer_cls, agent: Setup, fmt: str, pc, oc, folder: Path):
    """`trainer_cls` (TRL's GRPOTrainer or RLOOTrainer, or a subclass) rolling out with `agent`'s tools: `fmt` the
    policy's call format, `pc` the preference section (max_turns, max_length, log_every), `oc` the online section
    (sampling), each logged step's episodes of rank 0 written to `folder`."""

    class Rollouts(trainer_cls):
        """What both trainers share: the episodes, their metrics and the trajectories written."""

        def _generate_and_score_completions(self, inputs):
            self._rows = inputs  # the rows (their columns reset the environments), in the prompts' order
            return super()._generate_and_score_completions(inputs)

        def _roll_out(self, prompts: list) -> list[Episode]:
            from trl.models import unwrap_model_for_generation

            tokenizer = self.processing_class
            with unwrap_model_for_generation(self.model_wrapped, self.accelerator,
                                             gather_deepspeed3_params=self.args.ds3_gather_for_generation) as model:
                training = model.training
                model.eval()
                sample = id_sampler(model, tokenizer.pad_token_id, oc.max_new_tokens, do_sample=True,
                                    temperature=oc.temperature, top_k=oc.top_k, top_p=oc.top_p)
                rows = [{**row, "prompt": prompt} for row, prompt in zip(self._rows, prompts, strict=True)]
                episodes = rollouts(agent, sample, tokenizer, rows, fmt, pc.max_turns, pc.max_length,
                                    stop_ids(model))
                model.train(training)
            self._episodes = episodes
            self._log_episodes(episodes)
            return episodes

        def _turns(self, prompts: list) -> list[list[dict]]:
            """The completions the rewards read: each episode's messages after its prompt."""
            return [e.messages[len(p):] for e, p in zip(self._episodes, prompts, strict=True)]

        def _log_episodes(self, episodes: list[Episode]) -> None:
            import torch

            mode = "train" if self.model.training else "eval"
            counts = torch.tensor([[e.turns, len(e.calls), e.tool_errors] for e in episodes], dtype=torch.float,
                                  device=self.accelerator.device)
            counts = self.accelerator.gather(counts)
            self._metrics[mode]["turns_per_episode"].append(counts[:, 0].mean().item())
            self._metrics[mode]["tool_calls_per_episode"].append(counts[:, 1].mean().item())
            self._metrics[mode]["tool_errors"].append(counts[:, 2].sum().item())

        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
            per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            step = self.state.global_step + 1  # the step these rollouts train
            if self.model.training and self.accelerator.is_main_process and (
                    step % pc.log_every == 0 or step == self.state.max_steps):
                import torch

                mine = per_func[:len(prompts)].cpu()  # the main process's rows come first in the gathered batch
                weights = self.reward_weights.cpu()
                total = torch.nansum(mine * weights, dim=1).tolist()
                each = {name: mine[:, k].tolist() for k, name in enumerate(self.reward_func_names)}
                write_trajectories(folder, step, self._episodes, total, each)
            return per_func

    class GRPOAgentTrainer(Rollouts):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, rollout_func=self._rollout, **kwargs)

        def _rollout(self, prompts: list, trainer) -> dict:
            episodes = self._roll_out(prompts)
            return {"prompt_ids": [e.prompt_ids for e in episodes], "completion_ids": [e.ids for e in episodes],
                    "logprobs": None, "env_mask": [e.mask for e in episodes],
                    "messages": [e.messages for e in episodes],
                    "environment_reward": [e.toolbox.reward() for e in episodes]}

        def _generate(self, prompts: list):
            out = list(super()._generate(prompts))
            out[3] = self._turns(prompts)  # the completions
            return tuple(out)

    class RLOOAgentTrainer(Rollouts):
        _loss_mask = None  # the batch's env_mask while its loss is taken

        def _tokenize_prompts(self, prompts: list):
            import torch
            from torch.nn.utils.rnn import pad_sequence

            episodes = self._roll_out(prompts)
            for row, e in zip(self._rows, episodes, strict=True):  # extra columns for the rewards, as GRPO's
                row["messages"], row["environment_reward"] = e.messages, e.toolbox.reward()
            # the policy's mask (B, longest episode), kept for scoring; a sequence-parallel group takes its first rank's
            masks = [torch.tensor(e.mask, dtype=torch.long) for e in episodes]
            self._generation_extras = {"env_mask": pad_sequence(masks, batch_first=True, padding_value=0)}
            return [e.prompt_ids for e in episodes], None, {}

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields):
            return [e.ids for e in self._episodes]

        def _generate(self, prompts: list):
            prompt_ids, completion_ids, _ = super()._generate(prompts)
            return prompt_ids, completion_ids, self._turns(prompts)

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            out["env_mask"] = pad_to(self._generation_extras["env_mask"], out["completion_ids"].size(1))
            return out

        def _compute_loss(self, model, inputs):
            self._loss_mask = inputs["env_mask"]
            try:
                return super()._compute_loss(model, inputs)
            finally:
                self._loss_mask = None

        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args,
                                               **kwargs):
            logps, entropies, aux = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
            # RLOO takes log-probabilities twice: of the episodes generated last (old and reference), and in the loss
            mask = self._generation_extras["env_mask"] if self._loss_mask is None else self._loss_mask
            return logps * pad_to(mask, logps.size(1)).to(logps.device, logps.dtype), entropies, aux

    if "rollout_func" in inspect.signature(trainer_cls.__init__).parameters:
        return GRPOAgentTrainer
    return RLOOAgentTrainer


def pad_to(mask, width: int):
    """`mask` (B, C) right-padded with zeros to (B, width), width >= C (the batch's completions, padded)."""
    import torch.nn.functional as F

    return F.pad(mask, (0, width - mask.size(1)))
