"""Where a step's rollouts come from: the training processes themselves (sync), or rollout workers that sample the
next batches while the trainer trains (async).

`preference.rollout.mode: sync` (the default) is the loop every online stage always had: each process samples its
batch with its own module, between updates. `async` moves sampling onto `workers` processes, each a Ray actor
holding an engine (gptforge.model.sampling.engine) and, with tools, the environments.

Why Ray actors, and not more ranks of the launcher: a rollout worker is not part of the training's process group
(no collective of the trainer waits on it, ZeRO never partitions its weights), it holds its own devices (an
inference engine's tensor-parallel group, on a node of its own), and it must outlive nothing and start nothing
the launcher knows of. Ray places such processes on any node of a cluster by the resources they ask (`num_gpus`),
is already gptforge's engine for parallel work (gptforge.data.parallel), and is what OpenRLHF and veRL place their
vLLM engines with. More ranks would put generation inside torch.distributed's world, where every collective of
the trainer would count them.

The protocol, rank 0 of the trainer its only client (so Ray keeps its calls in order, and every version is exact):

- Each step draws its prompts as the stage always did; the ranks gather them to rank 0, which sends rank r's to
  worker r % workers. The results come back to their ranks when the step needs them.
- `max_staleness: k`: k batches are in flight ahead of the one trained, each sampled with the weights of the
  update it was sent after: a batch is at most k updates older than the trainer when it is trained on. The
  staleness each step trained on is logged (`rollout/staleness`).
- After each update the weights go to every worker, versioned: gathered one parameter at a time (under ZeRO-3
  every rank takes part, and no rank ever holds the whole model), sent by rank 0 in buckets of
  BUCKET_BYTES through Ray's object store. A worker applies a version between two batches, never during one.
- Sampling randomness: at `max_staleness: 0` the trainer waits for every batch, so each rank hands its random
  state to the worker with its prompts and takes it back with the samples: async samples what sync would, draw
  for draw. Above it, each batch is sampled from a seed of run.seed, the batch's number and the rank, so a resumed
  run samples what an uninterrupted one did.
- A checkpoint waits for the batches in flight and keeps them; a resumed run (and a rollback) trains on them first
  and sends the next ones with the checkpoint's weights: it ends where the uninterrupted run does. The batches in
  flight after the newest checkpoint are dropped with the processes that held them.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch

from gptforge.core.errors import UserError
from gptforge.model.sampling.engine import HFEngine, engine_class
from gptforge.model.agents.episode import Agent, spec_agent
from gptforge.model.sampling.sampling import Rollouts, sample

BUCKET_BYTES = 64 << 20  # weights sent to the workers per object


class Timeline:
    """Who waited and who worked when, rank 0's view: `logs/timeline.jsonl`, a span a line (bench/async_rl.py plots
    it)."""

    def __init__(self, folder: Path, rank: int):
        self.path = folder / "timeline.jsonl" if rank == 0 else None
        if self.path is not None:
            folder.mkdir(parents=True, exist_ok=True)

    def span(self, who: str, what: str, start: float, end: float, step: int) -> None:
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps({"who": who, "what": what, "start": start, "end": end, "step": step}) + "\n")


class InProcess:
    """Sync rollouts: each training process samples its batch with its own module (under ZeRO-3 the ranks generate
    in step: `everyone`)."""

    def __init__(self, module, tokenizer, oc, agent: Agent | None, stops: set[int], lookup, synced: bool,
                 everyone, timeline: Timeline):
        self.engine = HFEngine(module, tokenizer.pad_token_id, synced)
        self.tokenizer, self.oc, self.agent, self.stops, self.lookup = tokenizer, oc, agent, stops, lookup
        self.everyone, self.timeline = everyone, timeline
        self.version = 0

    def next(self, draw, step: int) -> tuple[list[int], Rollouts]:
        ids = draw()
        prompts, rows = self.lookup(ids)
        r = sample(self.engine, self.tokenizer, prompts, rows, self.oc, self.agent, self.stops, self.everyone,
                   self.version)
        self.timeline.span("trainer", "generate", *r.span, step)
        return ids, r

    def updated(self, module, version: int | None = None) -> None:
        self.version = self.version + 1 if version is None else version

    def state(self) -> dict:
        return {"version": self.version}

    def load_state(self, state: dict | None, module) -> None:
        self.version = (state or {}).get("version", 0)

    def close(self) -> None:
        pass


class RolloutWorker:
    """One rollout worker (a Ray actor): an engine over the policy, its tokenizer, the environments and tools."""

    def __init__(self, index: int, model_dir: str, engine: str, oc, agent_spec: dict | None, threads: int,
                 cores: list[int] | None, cwd: str):
        import sys

        from transformers import AutoTokenizer

        from gptforge.model.sampling.generate import stop_ids

        os.chdir(cwd)  # the user's engine, environment and tools import from the stage's working folder
        if cwd not in sys.path:
            sys.path.insert(0, cwd)
        if cores:
            os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores) if cores else threads)
        self.index, self.oc, self.version = index, oc, -1
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        pad = self.tokenizer.pad_token_id
        cls = engine_class(engine)
        self.engine = HFEngine.load(model_dir, pad) if cls is HFEngine else cls(model_dir)
        model = getattr(self.engine, "model", None)
        if model is not None:
            self.stops = stop_ids(model)
        else:
            from transformers import GenerationConfig

            eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
            self.stops = set(eos if isinstance(eos, list) else [eos])
        self.agent = None
        if agent_spec is not None:
            self.agent = spec_agent(agent_spec)

    def load(self, version: int, named: list[tuple[str, torch.Tensor]], final: bool) -> int:
        self.engine.load_weights(named)
        if final:
            self.version = version
        return self.version

    def sample(self, request: dict):
        if request["version"] != self.version:  # the client's calls arrive in order: this would be a bug
            raise RuntimeError(f"rollout worker {self.index} holds weights of version {self.version}, asked for "
                               f"{request['version']}")
        if request.get("rng") is not None:
            torch.set_rng_state(request["rng"])
        else:
            torch.manual_seed(request["seed"])
        r = sample(self.engine, self.tokenizer, request["prompts"], request["rows"], self.oc, self.agent, self.stops,
                   version=self.version)
        r.worker = self.index
        return r, (torch.get_rng_state() if request.get("rng") is not None else None)


class Workers:
    """Async rollouts: `workers` Ray actors sampling up to `max_staleness` batches ahead (the module's doc)."""

    def __init__(self, cfg, oc, model_dir: Path, agent_spec: dict | None, lookup, rank: int, world: int,
                 timeline: Timeline, staleness: int):
        rc = cfg.preference.rollout
        self.k, self.rank, self.world, self.lookup, self.timeline = staleness, rank, world, lookup, timeline
        self.seed, self.version, self.drawn = cfg.run.seed, 0, 0
        self.unsent = None  # the module whose weights (of self.version) the workers have yet to get
        self.queue: deque = deque()  # (prompt ids, rank 0: the ObjectRefs of every rank / everywhere: Rollouts)
        self.stack = ExitStack()
        self.actors = []
        if rank != 0:
            return
        import ray

        from gptforge.data.parallel import ray_instance

        self.ray = ray
        cuda = torch.cuda.is_available()
        spare = self.spare_cores(rc.workers, world)
        free = []
        if cuda:  # the workers take the GPUs of this node the training processes left, one each
            local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            free = list(range(local, torch.cuda.device_count()))
            if rc.workers > len(free):
                raise UserError(f"preference.rollout.workers={rc.workers} is more than the layout allows: this node "
                                f"has {torch.cuda.device_count()} GPUs and {local} training processes; give the "
                                "workers GPUs of their own (fewer processes a node, or fewer workers)")
        with visible_devices(free) if cuda else ExitStack():  # what Ray's raylet, and so its actors, see
            self.stack.enter_context(ray_instance(None, rc.workers))
        remote = ray.remote(num_gpus=1 if cuda else 0, num_cpus=0 if cuda else 1, max_restarts=0)(RolloutWorker)
        self.actors = [remote.remote(i, str(model_dir), rc.engine, oc, agent_spec, torch.get_num_threads(),
                                     spare[i] if spare else None, os.getcwd()) for i in range(rc.workers)]

    @staticmethod
    def spare_cores(workers: int, world: int) -> list[list[int]] | None:
        """On a CPU node whose training processes left cores unpinned (gptforge.model.train.distributed), a share of
        them for each worker; else None (the workers share the node's cores)."""
        if torch.cuda.is_available():
            return None
        taken = set(os.sched_getaffinity(0))  # this rank's; the other local ranks' follow it
        every = sorted(os.sched_getaffinity(os.getppid()) if os.getppid() > 1 else range(os.cpu_count() or 1))
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        free = [c for c in every if c > max(taken) + (local - 1) * len(taken)] if taken else []
        if len(free) < workers:
            return None
        share = len(free) // workers
        return [free[i * share:(i + 1) * share] for i in range(workers)]

    # -- the step's batch

    def next(self, draw, step: int) -> tuple[list[int], Rollouts]:
        while len(self.queue) < self.k + 1:
            self.submit(draw())
        ids, pending = self.queue.popleft()
        t0 = time.time()
        r = pending if isinstance(pending, Rollouts) else self.take(pending)
        self.timeline.span("trainer", "wait", t0, time.time(), step)
        if r.span[1] > 0:
            self.timeline.span(f"worker-{r.worker}", "generate", *r.span, step)
        return ids, r

    def submit(self, ids: list[int]) -> None:
        if self.unsent is not None:  # the trainer's newest weights first: this batch is sampled with them
            self.push(self.unsent)
            self.unsent = None
        self.drawn += 1
        prompts, rows = self.lookup(ids)
        mine = {"prompts": prompts, "rows": rows, "version": self.version,
                "rng": torch.get_rng_state() if self.k == 0 else None,
                "seed": (self.seed * 1_000_003 + self.drawn) * 1009 + self.rank}
        every = [None] * self.world if self.rank == 0 else None
        torch.distributed.gather_object(mine, every, dst=0)
        refs = None
        if self.rank == 0:
            refs = [self.actors[r % len(self.actors)].sample.remote(every[r]) for r in range(self.world)]
        self.queue.append((ids, refs))

    def take(self, refs) -> Rollouts:
        """Each rank's rollouts of a batch in flight (rank 0 waits for them and hands them out)."""
        out = [None]
        if self.rank == 0:
            try:
                results = self.ray.get(refs)
            except self.ray.exceptions.RayTaskError as e:
                failure = e.cause if isinstance(e.cause, UserError) else RuntimeError(f"a rollout worker failed: {e}")
                results = [failure] * self.world
            except self.ray.exceptions.RayActorError as e:
                results = [RuntimeError(f"a rollout worker died: {e}")] * self.world
            torch.distributed.scatter_object_list(out, results, src=0)
        else:
            torch.distributed.scatter_object_list(out, None, src=0)
        if isinstance(out[0], BaseException):
            raise out[0]
        r, rng = out[0]
        if rng is not None:
            torch.set_rng_state(rng)
        return r

    # -- weights

    def updated(self, module, version: int | None = None) -> None:
        """After an update (`version`: the trainer's count of them, else one more): the new version goes to every
        worker before the next batch is sent."""
        self.version = self.version + 1 if version is None else version
        self.unsent = module

    def push(self, module) -> None:
        import deepspeed

        bucket, size = [], 0
        for name, p in module.named_parameters():
            with deepspeed.zero.GatheredParameters([p], enabled=hasattr(p, "ds_id")):
                if self.rank == 0:
                    bucket.append((name, p.detach().to("cpu", copy=True)))
                    size += p.numel() * p.element_size()
            if size >= BUCKET_BYTES:
                self.send(bucket, final=False)
                bucket, size = [], 0
        self.send(bucket, final=True)

    def send(self, bucket, final: bool) -> None:
        if self.rank != 0:
            return
        ref = self.ray.put(bucket)
        loads = [a.load.remote(self.version, ref, final) for a in self.actors]
        if final:  # the workers hold the version before anything else is sent (a failed load surfaces here)
            self.ray.get(loads)

    # -- checkpoints

    def state(self) -> dict:
        """Every rank's batches in flight, waited for and kept (a collective)."""
        kept = []
        for i, (ids, pending) in enumerate(self.queue):
            r = pending if isinstance(pending, Rollouts) else self.take(pending)
            self.queue[i] = (ids, r)
            kept.append({"ids": [int(i) for i in ids], "rollouts": r.state()})
        return {"version": self.version, "drawn": self.drawn, "inflight": kept}

    def load_state(self, state: dict | None, module) -> None:
        """From a checkpoint (or the start): its batches in flight queued, its weights sent as its version."""
        state = state or {}
        self.version, self.drawn = state.get("version", 0), state.get("drawn", 0)
        self.queue = deque((s["ids"], Rollouts.from_state(s["rollouts"])) for s in state.get("inflight", []))
        self.unsent = module

    def close(self) -> None:
        self.stack.close()


class GenerationOrder:
    """The prompts of a TRL trainer's generation batches when a rollout source samples them ahead: `rows` rows a
    process, each of `unique` prompts (the whole world's, drawn by DistributedOrder with run.seed, the same on every
    process) repeated `group` times in a row, the world's rows split among the processes in order, as TRL's
    RepeatSampler lays them out (a prompt's group may span processes; TRL gathers the rewards to take its
    advantages)."""

    def __init__(self, n_prompts: int, rows: int, group: int, rank: int, world: int, seed: int):
        from gptforge.data.batches import DistributedOrder

        if rows * world % group:
            raise UserError(f"a generation batch of {rows * world} rows does not hold whole groups of {group}")
        self.rows, self.group, self.rank = rows, group, rank
        self.order = DistributedOrder(n_prompts, rows * world // group, 0, 1, seed)

    def next_ids(self) -> list[int]:
        every = [int(i) for i in self.order.next_ids() for _ in range(self.group)]
        return every[self.rank * self.rows:(self.rank + 1) * self.rows]

    def state_dict(self) -> dict:
        return self.order.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.order.load_state_dict(state)


def step_spans(timeline: Timeline):
    """A TRL Trainer's callback class writing each step (its generation, in sync mode, inside) as a `train` span."""
    from transformers import TrainerCallback

    class StepSpans(TrainerCallback):
        began = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self.began = time.time()
            return control

        def on_step_end(self, args, state, control, **kwargs):
            timeline.span("trainer", "train", self.began, time.time(), state.global_step)
            return control

    return StepSpans


def trainer_callback(trainer, source, order, policy, out_dir: Path):
    """A TRL Trainer's side of async rollouts: after each optimizer step the policy's weights (`policy`, the module
    the Trainer trains, partitioned or not) are the source's next version; each checkpoint keeps the batches in
    flight and the prompt order (`rollouts-rank<r>.pt`), which `resume` loads back; a rollback of the guard drops
    the batches in flight and sends the checkpoint's weights."""

    from gptforge.model.train.hf_trainer import Checkpoints

    rank = trainer.accelerator.process_index

    class RolloutSync(step_spans(source.timeline)):
        def on_step_end(self, args, state, control, **kwargs):
            source.updated(policy, state.global_step)
            return super().on_step_end(args, state, control, **kwargs)

        def on_save(self, args, state, control, **kwargs):
            d = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            kept = {"source": source.state(), "order": order.state_dict()}
            torch.save(kept, d / f"rollouts-rank{rank}.pt")
            return control

    def resume(ckpt: str | None) -> None:
        kept = Path(ckpt) / f"rollouts-rank{rank}.pt" if ckpt else None
        state = torch.load(kept, weights_only=True) if kept is not None and kept.is_file() else {}
        if state:
            order.load_state_dict(state["order"])
        source.load_state(state.get("source"), policy)

    def rolled_back(ckpt: Path) -> None:
        source.load_state({"version": source.version, "drawn": source.drawn}, policy)

    handler = trainer.callback_handler  # before Checkpoints, which records the checkpoint's files
    at = next((i for i, c in enumerate(handler.callbacks) if isinstance(c, Checkpoints)), len(handler.callbacks))
    handler.callbacks.insert(at, RolloutSync())
    trainer.rolled_back = rolled_back
    return resume


@contextmanager
def visible_devices(indices: list[int]):
    """CUDA_VISIBLE_DEVICES set to `indices` of this process's devices while Ray starts (its raylet and actors
    inherit it), then restored."""
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = before.split(",") if before else [str(i) for i in range(torch.cuda.device_count())]
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(names[i] for i in indices)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def rollout_source(cfg, oc, module, model_dir: Path, tokenizer, agent: Agent | None, agent_spec: dict | None, lookup,
                   rank: int, world: int, synced: bool, everyone, stops: set[int], logs: Path):
    """The step's rollouts for `cfg.preference.rollout` with the online section `oc`'s sampling settings: in process
    (sync with hf) or from workers (async, or an engine other than hf, which then runs in a worker at staleness 0).
    `lookup(ids)`: the prompts (chat messages) and prompt rows of a batch's ids; `agent_spec`: what a worker loads
    its environments and tools from."""
    rc, timeline = cfg.preference.rollout, Timeline(logs, rank)
    if rc.mode == "sync" and rc.engine == "hf":
        return InProcess(module, tokenizer, oc, agent, stops, lookup, synced, everyone, timeline)
    return Workers(cfg, oc, model_dir, agent_spec, lookup, rank, world, timeline,
                   rc.max_staleness if rc.mode == "async" else 0)
