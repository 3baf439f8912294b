"""The rollout room inside TRL's online trainers: each prompt row of a generation batch (TRL's sampler has already
repeated it num_generations times) is one episode of gptforge.model.agents.episode, sampled by the trainer's own
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

from pathlib import Path

from gptforge.model.sampling.generate import id_sampler, stop_ids
from gptforge.data.chat import prompt_ids
from gptforge.model.agents.episode import Episode, environment_rewards, rollouts, write_trajectories
from gptforge.model.agents.tools import Setup


def rollout_trainer(trainer_cls, trainer: str, pc, oc, folder: Path, agent: Setup | None = None,
                    fmt: str | None = None):
    """`trainer_cls` (TRL's GRPOTrainer or RLOOTrainer, or a subclass; `trainer` the stage's declared "GRPO" or
    "RLOO") taking its rollouts from this room: episodes
    with `agent`'s tools (`fmt` the policy's call format), sampled by the trainer's own policy; or, once `attach`ed
    to a rollout source (gptforge.model.sampling.workers.Workers: async), the source's batches, one or many turns,
    with their prompts drawn by gptforge's own seeded order in place of TRL's. `pc` the preference section
    (max_turns, max_length, log_every, rollout), `oc` the online section (sampling); each logged step's episodes of
    rank 0 written to `folder` where there are tools. Every rollout from here keeps its sampled log-probabilities:
    the mismatch is logged, the loss corrected (`pc.rollout.correction`: GRPO's per token, RLOO's per sequence, its
    loss being one), and a mismatch past `pc.rollout.max_mismatch` marks the step bad for the guard."""
    rc = pc.rollout

    class Rollouts(trainer_cls):
        """What both trainers share: the episodes, their metrics and the trajectories written."""

        _source = _order = None
        rollout_verdict: str | None = None  # why this generation's steps are bad (TrainerGuard reads it)

        def attach(self, source, order) -> None:
            """Take the rollouts from `source`, the prompts of each generation batch from `order`."""
            self._source, self._order = source, order

        def _generate_and_score_completions(self, inputs):
            self._sampled = None
            if self._source is not None and self.model.training:
                step = self.state.global_step + 1
                ids, self._sampled = self._source.next(self._order.next_ids, step)
                if len(ids) != len(inputs):
                    raise RuntimeError(f"a generation batch of {len(ids)} rows drawn, TRL's holds {len(inputs)}")
                inputs = [self.train_dataset[int(i)] for i in ids]
            self._rows = inputs  # the rows (their columns reset the environments), in the prompts' order
            out = super()._generate_and_score_completions(inputs)
            if self.model.training:
                self._off_policy(out)
            return out

        def _roll_out(self, prompts: list) -> list[Episode]:
            self._waited = None
            if self._sampled is not None:
                episodes = self._sampled.episodes or single_turns(self._sampled, prompts, self.processing_class)
                self._waited = self._sampled.extra.get("tool_wait_s")
            else:
                waited = agent.calls.waited if agent is not None else 0.0
                episodes = self._sample_here(prompts)
                self._waited = agent.calls.waited - waited if agent is not None else None
            self._episodes = episodes
            if agent is not None:
                self._log_episodes(episodes)
            return episodes

        def _sample_here(self, prompts: list) -> list[Episode]:
            from trl.models import unwrap_model_for_generation

            tokenizer = self.processing_class
            with unwrap_model_for_generation(self.model_wrapped, self.accelerator,
                                             gather_deepspeed3_params=self.args.ds3_gather_for_generation) as model:
                training = model.training
                model.eval()
                sample = id_sampler(model, tokenizer.pad_token_id, oc.max_new_tokens, logprobs=True, do_sample=True,
                                    temperature=oc.temperature, top_k=oc.top_k, top_p=oc.top_p)
                if agent is None:  # one turn a prompt
                    ids = [prompt_ids(tokenizer, p) for p in prompts]
                    turns = sample(ids, [oc.max_new_tokens] * len(ids))
                    episodes = [Episode(list(p) + [{"role": "assistant", "content": tokenizer.decode(
                        t, skip_special_tokens=True)}], i, list(t), [1] * len(t), list(t.logprobs), turns=1,
                        ended="answer") for p, i, t in zip(prompts, ids, turns, strict=True)]
                else:
                    rows = [{**row, "prompt": prompt} for row, prompt in zip(self._rows, prompts, strict=True)]
                    episodes = rollouts(agent, sample, tokenizer, rows, fmt, pc.max_turns, pc.max_length,
                                        stop_ids(model))
                model.train(training)
            return episodes

        def _turns(self, prompts: list) -> list[list[dict]]:
            """The completions the rewards read: each episode's messages after its prompt."""
            return [e.messages[len(p):] for e, p in zip(self._episodes, prompts, strict=True)]

        def _columns(self) -> dict:
            """The extra columns the rewards read: the trajectories and the environments' rewards, with tools."""
            if agent is None:
                return {}
            return {"messages": [e.messages for e in self._episodes],
                    "environment_reward": environment_rewards(self._episodes, agent.calls)}

        def _log_episodes(self, episodes: list[Episode]) -> None:
            import torch

            mode = "train" if self.model.training else "eval"
            counts = torch.tensor([[e.turns, len(e.calls), e.tool_errors] for e in episodes], dtype=torch.float,
                                  device=self.accelerator.device)
            counts = self.accelerator.gather(counts)
            self._metrics[mode]["turns_per_episode"].append(counts[:, 0].mean().item())
            self._metrics[mode]["tool_calls_per_episode"].append(counts[:, 1].mean().item())
            self._metrics[mode]["tool_errors"].append(counts[:, 2].sum().item())
            if self._waited is not None:  # sampled here: the seconds the batch waited on its tools (all processes')
                waited = self.accelerator.gather(torch.tensor([self._waited], device=self.accelerator.device))
                self._metrics[mode]["tool_wait_s"].append(waited.mean().item())

        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
            per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            step = self.state.global_step + 1  # the step these rollouts train
            if agent is not None and self.model.training and self.accelerator.is_main_process and (
                    step % pc.log_every == 0 or step == self.state.max_steps):
                import torch

                mine = per_func[:len(prompts)].cpu()  # the main process's rows come first in the gathered batch
                weights = self.reward_weights.cpu()
                total = torch.nansum(mine * weights, dim=1).tolist()
                each = {name: mine[:, k].tolist() for k, name in enumerate(self.reward_func_names)}
                write_trajectories(folder, step, self._episodes, total, each)
            return per_func

        # -- off-policy: the trainer's log-probabilities against the sampled ones

        def _off_policy(self, out: dict) -> None:
            import torch

            from gptforge.model.sampling.offpolicy import mismatch, token_weights

            mask = out["completion_mask"] * out.get("tool_mask", out.get("env_mask", 1))
            width = out["completion_ids"].size(1)
            sampled = torch.zeros(mask.shape, device=mask.device)
            for b, e in enumerate(self._episodes):
                sampled[b, :len(e.logprobs)] = torch.tensor(e.logprobs[:width], device=mask.device)
            trained = out.get("old_per_token_logps")
            if trained is None:
                with torch.no_grad():
                    trained, _, _ = self._get_per_token_logps_and_entropies(
                        self.model, torch.cat([out["prompt_ids"], out["completion_ids"]], 1),
                        torch.cat([out["prompt_mask"], out["completion_mask"]], 1), width)
            trained = trained * mask
            measured = {k: self.accelerator.gather(torch.tensor([v], device=mask.device)).mean().item()
                        for k, v in mismatch(trained, sampled, mask, rc).items()}
            if self._sampled is not None:
                measured["rollout/staleness"] = self._source.version - self._sampled.version
                measured["rollout/version"] = self._sampled.version
            for k, v in measured.items():
                self._metrics["train"][k].append(v)
            self.rollout_verdict = None
            if rc.max_mismatch is not None and measured["mismatch/kl"] > rc.max_mismatch:
                self.rollout_verdict = (f"the rollouts' mismatch, KL {measured['mismatch/kl']:.4g} a token, is over "
                                        f"preference.rollout.max_mismatch ({rc.max_mismatch:g})")
            self._correct(out, trained, sampled, mask, token_weights)

    class GRPORollouts(Rollouts):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, rollout_func=self._rollout, **kwargs)

        def _rollout(self, prompts: list, trainer) -> dict:
            episodes = self._roll_out(prompts)
            return {"prompt_ids": [e.prompt_ids for e in episodes], "completion_ids": [e.ids for e in episodes],
                    "logprobs": [e.logprobs for e in episodes], "env_mask": [e.mask for e in episodes],
                    **self._columns()}

        def _generate(self, prompts: list):
            out = list(super()._generate(prompts))
            out[3] = self._turns(prompts)  # the completions
            return tuple(out)

        def _correct(self, out, trained, sampled, mask, token_weights) -> None:
            weights = token_weights(trained, sampled, rc)
            if weights is not None:  # TRL multiplies it into each token's loss (_compute_loss, below)
                out["importance_sampling_ratio"] = weights

        def _compute_loss(self, model, inputs):
            if "importance_sampling_ratio" not in inputs:
                return super()._compute_loss(model, inputs)
            # TRL applies the ratio where its vLLM correction is on, this flag's only reader in the loss
            self.use_vllm, self.vllm_importance_sampling_correction = True, True
            try:
                return super()._compute_loss(model, inputs)
            finally:
                self.use_vllm, self.vllm_importance_sampling_correction = False, False

    class RLOORollouts(Rollouts):
        _loss_mask = None  # the batch's env_mask while its loss is taken

        def _tokenize_prompts(self, prompts: list):
            import torch
            from torch.nn.utils.rnn import pad_sequence

            episodes = self._roll_out(prompts)
            for k, values in self._columns().items():  # extra columns for the rewards, as GRPO's
                for row, v in zip(self._rows, values, strict=True):
                    row[k] = v
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
            if "env_mask" not in out:
                out["env_mask"] = pad_to(self._generation_extras["env_mask"], out["completion_ids"].size(1))
            return out

        def _off_policy(self, out: dict) -> None:
            out["env_mask"] = pad_to(self._generation_extras["env_mask"], out["completion_ids"].size(1))
            super()._off_policy(out)

        def _correct(self, out, trained, sampled, mask, token_weights) -> None:
            """RLOO's loss is one a sequence: the sequence's ratio (its tokens' product), truncated or banded,
            scales its advantage (a non-negative factor of both terms of the clipped loss)."""
            from gptforge.model.sampling.offpolicy import sequence_weights

            weight = sequence_weights(trained, sampled, mask, rc)
            if weight is not None:
                out["advantages"] = out["advantages"] * weight.to(out["advantages"].dtype)

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

    return {"GRPO": GRPORollouts, "RLOO": RLOORollouts}[trainer]


def single_turns(sampled, prompts: list, tokenizer) -> list[Episode]:
    """One-turn episodes from a worker's rollouts in PPO's layout (gptforge.model.sampling.sampling.Rollouts)."""
    episodes = []
    P = sampled.P
    for b, prompt in enumerate(prompts):
        prompt_ids = sampled.seqs[b, :P][sampled.attention[b, :P].bool()].tolist()
        n = int(sampled.mask[b].sum())
        ids = sampled.seqs[b, P:P + n].tolist()
        text = tokenizer.decode(ids, skip_special_tokens=True)
        episodes.append(Episode(list(prompt) + [{"role": "assistant", "content": text}], prompt_ids, ids,
                                [1] * n, sampled.logprobs[b, :n].tolist(), turns=1, ended="answer"))
    return episodes


def pad_to(t, width: int, fill=0, left: bool = False):
    """(B, C, ...) padded with `fill` to (B, width, ...) along dim 1, width >= C: on the right (a batch's
    completions, padded) or the left (its prompts)."""
    import torch.nn.functional as F

    extra = width - t.size(1)
    return F.pad(t, [0, 0] * (t.dim() - 2) + ([extra, 0] if left else [0, extra]), value=fill)
