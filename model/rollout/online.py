"""The rollout room inside TRL's GRPOTrainer, through its `rollout_func` hook: each prompt row of a generation batch
(TRL's sampler has already repeated it num_generations times) is one episode of gptforge.model.rollout.episode,
sampled by the trainer's own policy, so that PPO and GRPO share one call parser, one timeout and one mask.

TRL hands back to its trainer what the episodes hold, token-exact: the prompt's ids, the ids after it (the turns as
sampled and the template's tokens between them) and `env_mask`, which TRL multiplies into the mask of its loss and of
its KL term. The completions the rewards read are the episode's turns as messages (the policy's turns and the tool
results), so that a reward model scores the trajectory as the template renders it and a reward function reads the
last turn; `messages` (the whole trajectory) and `environment_reward` (its environment's `get_reward()`) are extra
columns, as in PPO.

Why not TRL's own tool loop (`tools=`, `environment_factory=`): it too concatenates ids rather than tokenizing
decoded text again, but it runs the user's tools with no timeout, so that one stalled tool stalls every rank, and it
parses calls through a response schema it sets only for the chat templates it knows, which gptforge's own is not.
"""

from __future__ import annotations

from pathlib import Path

from gptforge.model.eval.generation import id_sampler, stop_ids
from gptforge.model.rollout.episode import Episode, rollouts, write_trajectories
from gptforge.model.rollout.tools import Setup


def agent_trainer(trainer_cls, agent: Setup, fmt: str, pc, oc, folder: Path):
    """`trainer_cls` (TRL's GRPOTrainer or a subclass) rolling out with `agent`'s tools: `fmt` the policy's call
    format, `pc` the preference section (max_turns, max_length, log_every), `oc` the online section (sampling),
    each logged step's episodes of rank 0 written to `folder`."""

    class AgentTrainer(trainer_cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, rollout_func=self._rollout, **kwargs)

        def _generate_and_score_completions(self, inputs):
            self._rows = inputs  # the rows (their columns reset the environments), in the prompts' order
            return super()._generate_and_score_completions(inputs)

        def _rollout(self, prompts: list, trainer) -> dict:
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
            return {"prompt_ids": [e.prompt_ids for e in episodes], "completion_ids": [e.ids for e in episodes],
                    "logprobs": None, "env_mask": [e.mask for e in episodes],
                    "messages": [e.messages for e in episodes],
                    "environment_reward": [e.toolbox.reward() for e in episodes]}

        def _generate(self, prompts: list):
            out = list(super()._generate(prompts))
            out[3] = [e.messages[len(p):] for e, p in zip(self._episodes, prompts, strict=True)]  # completions
            return tuple(out)

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

    return AgentTrainer
