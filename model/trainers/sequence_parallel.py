"""TRL's DPOTrainer, GRPOTrainer and RLOOTrainer run sequence-parallel (DeepSpeed-Ulysses): the trainer side of
gptforge.model.train.sequence_parallel, whose groups, shards and fused forward it uses."""

from __future__ import annotations

import sys

import torch

from gptforge.model.train.sequence_parallel import setup, shard_fused_forward


def trainer(trainer_cls, policy, dist, rows: int, stage: str):
    """`trainer_cls` (TRL's DPOTrainer, GRPOTrainer or RLOOTrainer) run sequence-parallel over
    `distributed.sequence_parallel` ranks (Ulysses registered for `policy`, whose micro-batches hold `rows` rows of
    varying length): each group of N ranks works as one data-parallel rank whose sequences it shares. Itself when
    N is 1.

    - The training batches are split over the data-parallel groups, not the ranks: accelerate's shard of the
      batch sampler takes the group's index and count, so the ranks of a group read the same micro-batches
      (in the order a data-parallel run over world/N ranks reads them).
    - The policy's and the reference's fused forwards are sharded (`shard_fused_forward`).
    - The Trainer gives DeepSpeed no sequence-parallel groups, so DeepSpeed averages gradients over the whole
      world; each slice's gradient is taken N times, which makes that the mean over the data-parallel groups
      under every ZeRO stage.
    - GRPO and RLOO: a group generates once. Every rank samples (ZeRO-3 gathers weights for all), on whole
      sequences, from its group's first rank's generator state, and takes that rank's completions and its order of
      the shuffled rollouts; rewards are computed on whole sequences too.
      A generation batch is the data-parallel run's (RepeatSampler's chunk over world/N), and the ranks of a
      group hold whole prompt groups, so the trainer's advantages (gathered over all ranks, each group's twice
      or N times) and its slice of them are the data-parallel run's (the config checks that a group's rollouts
      a step hold whole prompt groups).
    - TRL's DPO token count divides by the ranks that read the same batch."""
    sp = setup(policy, dist, rows, None, "preference.max_length")
    if sp is None:
        return trainer_cls
    if torch.distributed.get_rank() == 0:
        print(f"[{stage}] sequence parallel {sp.size} ({sp.dp_world} data-parallel)", file=sys.stderr, flush=True)

    class SequenceParallelTrainer(trainer_cls):
        _sharded = False

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._tp_size = getattr(self, "_tp_size", 1) * sp.size

        def train(self, *args, **kwargs):
            if not self._sharded:  # the reference as the stage left it (gptforge.model.train.hf_trainer.use_reference)
                policy = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
                for model in (policy, self.ref_model):
                    if model is not None:
                        shard_fused_forward(getattr(model, "module", model), sp, float(sp.size))
                self._sharded = True
            return super().train(*args, **kwargs)

        def get_train_dataloader(self):
            loader = super().get_train_dataloader()
            shard = loader.batch_sampler  # accelerate's BatchSamplerShard: micro-batch i to process i % count
            shard.num_processes, shard.process_index = sp.dp_world, sp.dp_rank
            return loader

        def _get_train_sampler(self, *args, **kwargs):
            sampler = super()._get_train_sampler(*args, **kwargs)
            if hasattr(sampler, "mini_repeat_count"):  # RepeatSampler: a generation's prompts over world/N ranks
                sampler.batch_size //= sp.size
            return sampler

        def _from_first_rank(self, value):
            """The group's first rank's `value`, its tensors on this rank's device."""
            device = self.accelerator.device
            return torch.utils._pytree.tree_map(lambda x: x.to(device) if torch.is_tensor(x) else x,
                                                sp.from_first_rank(value))

        def _generate(self, prompts):
            # the first rank's generator state on every rank of the group: they sample (and later shuffle) alike,
            # so what the trainer logs of the samples is of the ones kept
            cpu, cuda = sp.from_first_rank((torch.get_rng_state(),
                                            torch.cuda.get_rng_state() if torch.cuda.is_available() else None))
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state(cuda)
            with sp.whole_sequences():
                out = super()._generate(prompts)
            # with what a trainer keeps of the generation beside it (the rollout room's masks)
            out, extras = self._from_first_rank((out, getattr(self, "_generation_extras", None)))
            if extras is not None:
                self._generation_extras = extras
            return out

        def _prepare_inputs(self, generation_batch):
            before = getattr(self, "_buffered_inputs", None)
            inputs = super()._prepare_inputs(generation_batch)
            buffered = getattr(self, "_buffered_inputs", None)
            if buffered is not None and buffered is not before:  # a generation, shuffled by each rank's generator
                at = next(i for i, b in enumerate(buffered) if b is inputs)
                self._buffered_inputs = self._from_first_rank(buffered)
                inputs = self._buffered_inputs[at]
            return inputs

        def _calculate_rewards(self, *args, **kwargs):
            with sp.whole_sequences():
                return super()._calculate_rewards(*args, **kwargs)

    SequenceParallelTrainer.__name__ = SequenceParallelTrainer.__qualname__ = f"SequenceParallel{trainer_cls.__name__}"
    return SequenceParallelTrainer
