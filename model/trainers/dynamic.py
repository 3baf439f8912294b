"""Dynamic sampling (DAPO's) in TRL's group trainers, GRPO and RLOO: a group whose rewards are all equal has no
advantage (each completion's reward less its group's mean, or its siblings', is zero) and teaches nothing but the KL
term, so with `preference.<algorithm>.dynamic_sampling` it is replaced by a group of a new draw whose rewards differ,
drawing up to `max_draws` generation batches a step (the first included). What is left unreplaced at the bound is
trained as drawn. Every step logs, with or without it:

- `rollout/zero_advantage_groups`: the share of the first draw's groups whose rewards were all equal (the groups
  dynamic sampling replaces);
- `rollout/zero_advantage_trained`: the share of the groups trained that are still so;
- `rollout/draws`: the generation batches drawn.

A draw is the trainer's own `_generate_and_score_completions` on new prompts (in sync mode a seeded choice of the
training prompts, the same on every rank of a sequence-parallel group; in async mode the rollout source's next
batch), so its rollouts carry what every draw carries: the token-exact masks of the rollout room, the off-policy
correction, the overlong mask. Each process's rows hold whole groups (the config checks it), and a process fills
its own groups' places; the draws go on while any process has a place left, since each one gathers rewards over
all of them. The rows spliced in are padded to the batch's width (prompts on the left, completions on the right),
and GRPO's token count for its loss is taken again.

PPO samples one response a prompt: it has no groups to replace.
"""

from __future__ import annotations

import random

import torch

from gptforge.model.trainers.online import pad_to

PROMPT_KEYS = ("prompt_ids", "prompt_mask")  # left-padded, as TRL pads prompts


def trainer(trainer_cls, oc, dp_rank: int, seed: int):
    """`trainer_cls` (TRL's GRPOTrainer or RLOOTrainer, or a subclass) logging its zero-advantage groups and, where
    `oc.dynamic_sampling` (the online section), replacing them; `dp_rank` this process's data-parallel index (a
    sequence-parallel group's ranks draw alike)."""
    bound = oc.max_draws if oc.dynamic_sampling else 1

    class DynamicSampling(trainer_cls):
        _drawn = None  # the last draw's rewards, every process's rows: (world * rows, reward functions)

        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
            self._drawn = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            return self._drawn

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            if not self.model.training:
                return out
            G, rows = self.num_generations, len(inputs)
            flat = self._equal_groups()
            first = flat.float().mean().item()
            places = [g for g, equal in enumerate(self._mine(flat, rows)) if equal]
            draws = 1
            while draws < bound and self._anyone(len(places)):
                draws += 1
                new = super()._generate_and_score_completions(self._redraw(inputs, draws))
                fresh = [g for g, equal in enumerate(self._mine(self._equal_groups(), rows)) if not equal]
                pairs = list(zip(places, fresh))
                out = splice(out, new, pairs, G, self.processing_class.pad_token_id)
                places = places[len(pairs):]
            if draws > 1 and "num_items_in_batch" in out:  # GRPO's loss normalizer: the batch's tokens, all processes
                mask = out["completion_mask"] * out.get("tool_mask", 1)
                out["num_items_in_batch"] = self.accelerator.gather(mask.sum()).sum()
            left = self.accelerator.gather(torch.tensor([len(places), rows // G], device=self.accelerator.device))
            left = left.view(-1, 2).sum(0)
            metrics = self._metrics["train"]
            metrics["rollout/zero_advantage_groups"].append(first)
            metrics["rollout/zero_advantage_trained"].append((left[0] / left[1]).item())
            metrics["rollout/draws"].append(float(draws))
            return out

        def _equal_groups(self) -> torch.Tensor:
            """(groups of every process,) True where a group's total rewards have no spread: TRL's zero std
            (`frac_reward_zero_std`), or fewer than two scored."""
            from trl.trainer.utils import nanstd

            total = torch.nansum(self._drawn * self.reward_weights.to(self._drawn.device), dim=1)
            total[torch.isnan(self._drawn).all(1)] = torch.nan
            std = nanstd(total.view(-1, self.num_generations), dim=1)
            return ~(std > 1e-8)  # NaN (one scored, or none) is no spread too

        def _mine(self, flat: torch.Tensor, rows: int) -> list[bool]:
            n = rows // self.num_generations
            at = self.accelerator.process_index * n
            return flat[at:at + n].tolist()

        def _anyone(self, places: int) -> bool:
            return self.accelerator.gather(torch.tensor([places], device=self.accelerator.device)).sum().item() > 0

        def _redraw(self, inputs: list, draw: int) -> list:
            """Rows for another draw, as many as `inputs` in groups of num_generations: training prompts drawn by a
            generator of (run.seed, step, draw, data-parallel rank), so that a resumed run draws the same. (An
            async rollout source samples its own next batch and reads only their number.)"""
            G = self.num_generations
            rng = random.Random(((seed * 1_000_003 + self.state.global_step) * 1009 + draw) * 10007 + dp_rank)
            ids = [rng.randrange(len(self.train_dataset)) for _ in range(len(inputs) // G)]
            return [dict(self.train_dataset[i]) for i in ids for _ in range(G)]

    DynamicSampling.__name__ = DynamicSampling.__qualname__ = f"DynamicSampling{trainer_cls.__name__}"
    return DynamicSampling


def splice(out: dict, new: dict, pairs: list[tuple[int, int]], group: int, pad_id: int) -> dict:
    """`out` (a generation batch as TRL's trainers return it) with each pair's group g (rows g*group ...) replaced by
    `new`'s group h; tensors of different widths padded to the wider (prompts on the left, the rest on the right)."""
    if not pairs:
        return out
    to = torch.tensor([g * group + j for g, _ in pairs for j in range(group)])
    take = torch.tensor([h * group + j for _, h in pairs for j in range(group)])
    width, new_width = out["completion_ids"].size(1), new["completion_ids"].size(1)
    spliced = dict(out)
    for key, value in out.items():
        if not torch.is_tensor(value) or value.dim() == 0:
            continue
        other = new[key]
        if value.dim() > 1 and value.size(1) != other.size(1):
            left = key in PROMPT_KEYS
            if not left and (value.size(1), other.size(1)) != (width, new_width):
                raise ValueError(f"cannot splice the generation batch's {key!r}: widths {value.size(1)} and "
                                 f"{other.size(1)}")
            fill = pad_id if key.endswith("_ids") else 0
            value, other = (pad_to(t, max(value.size(1), other.size(1)), fill, left) for t in (value, other))
        value = value.clone()
        value[to.to(value.device)] = other[take.to(other.device)].to(value.dtype)
        spliced[key] = value
    return spliced

