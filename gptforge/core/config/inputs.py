"""The run, its data sources and the tokenizer: the sections that say what goes in."""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from gptforge.core.config.base import Section, Setting


class RunSection(Section):
    name: str = Setting("tiny", description="Run name: the run directory is <root>/<name>.")
    root: str = Setting("runs", description="Directory holding runs and the stage store.")
    seed: int = Setting(0, description="Global seed for data order, init and sampling.")
    retries: int = Setting(0, ge=0, description="Prefect retries of a failed stage (a retry resumes from its "
                           "checkpoint).")
    retry_delay: int = Setting(10, ge=0, description="Seconds between retries.")
    schedule: str | None = Setting(None, description="Cron schedule of the served deployment, e.g. '0 2 * * *'.")
    work_pools: dict[str, str] = Setting({}, same_result=True, description="Stage (or evaluation step) -> Prefect "
                                         "work pool it runs on, e.g. {tokenize: cpu, pretrain: gpu}; empty: every "
                                         "stage runs in the flow's own process.")
    default_work_pool: str | None = Setting(None, same_result=True, description="Work pool of the stages not in "
                                            "run.work_pools (and of the pipeline and watch deployments).")
    slots: str = Setting("gptforge-gpus", same_result=True, description="Prefect global concurrency limit a stage "
                         "takes its world size of slots from while it runs (created by `gptforge deploy --slots N`).")
    approve_before: list[str] = Setting([], same_result=True, description="Stages the flow pauses before, for a "
                                        "person's approval in the Prefect UI.")
    approve_timeout: int = Setting(86400, ge=60, same_result=True, description="Seconds an approval may wait "
                                   "before the run fails.")
    watch_every: int = Setting(600, ge=10, same_result=True, description="Seconds between the deployed watch "
                               "flow's checks of the data sources and named models.")
    tracker: Literal["none", "mlflow"] = Setting("none", same_result=True, description="Experiment tracker: mlflow "
                                                 "logs each stage's parameters and metrics, nested under the run's.")
    tracking_uri: str | None = Setting(None, same_result=True, description="MLflow tracking server or store; None: "
                                       "sqlite:///<run.root>/mlflow.db.")


class DemoSection(Section):
    seed: int = Setting(0, description="Seed of the built-in demo data generator.")
    pretrain_docs: int = Setting(20000, ge=1, description="Number of pretraining documents (one Q/A or sentence each).")
    sft_items: int = Setting(3000, ge=1, description="Number of instruction conversations.")
    sft_flaws: float = Setting(0.0, ge=0, lt=1, description="Share of the conversations whose answer is a plausible "
                               "wrong one, as human demonstrations have (the preference pairs always rank the right "
                               "answer first).")
    preference_pairs: int = Setting(2000, ge=1, description="Number of preference pairs.")
    eval_items: int = Setting(200, ge=1, description="Number of held-out verifiable items.")


class SourceSection(Section):
    """Where one kind of rows comes from. A plain string in the YAML (`sft: chat.jsonl`) is its `path`."""

    path: str = Setting("demo", description="'demo', a local file, folder or glob (.txt .jsonl .json .parquet .arrow, "
                        ".gz/.zst), a save_to_disk folder, or a hub dataset name.")
    split: str = Setting("train", description="Split of a hub dataset or of a saved DatasetDict.")
    subset: str | None = Setting(None, description="Subset (configuration) of a hub dataset.")
    revision: str | None = Setting(None, description="Hub dataset revision (branch, tag or commit); None: the newest "
                                   "commit of main, resolved at every run.")
    streaming: bool = Setting(False, same_result=True, description="Stream a hub dataset instead of downloading it "
                              "first.")
    held_out: str | None = Setting(None, description="A local file of the rows held out for validation (every row of "
                                   "path is then trained on); None: every 20th row of path is held out.")

    @model_validator(mode="before")
    @classmethod
    def _from_path(cls, data):
        return {"path": data} if isinstance(data, str) else data


class TaskSourceSection(SourceSection):
    """A source of prompts, which may be a procedural task library's dataset (`reasoning_gym:<dataset>`, generated
    from `seed`: `size` items to train on and `held_out_size` held out, drawn from another seed)."""

    size: int = Setting(1000, ge=1, description="reasoning_gym: the number of items generated to train on.")
    held_out_size: int = Setting(200, ge=1, description="reasoning_gym: the number of held-out items, generated from "
                                 "a seed of their own (those whose question is also a training item's are dropped).")
    seed: int = Setting(0, description="reasoning_gym: the seed of the items (the held-out items' is derived from it).")
    options: dict = Setting({}, description="reasoning_gym: the dataset's configuration (its config class's fields, "
                            "e.g. {min_terms: 2, max_terms: 2}).")


class EvalSourceSection(TaskSourceSection):
    """Where the evaluation steps' prompts come from; a plain string in the YAML is its `path`."""

    path: str | None = Setting(None, description="None: the rows held out of data.sft / data.preference; else a "
                               "source of prompts with optional answers ({prompt, answer}) or conversations.")


class PromptSourceSection(TaskSourceSection):
    """Where the online stages' prompts come from; a plain string in the YAML is its `path`."""

    path: str | None = Setting(None, description="None: the preference pairs' prompts; else {prompt, answer} rows "
                               "(or GSM8K's), reasoning_gym:<dataset> or verifiers:<id> (docs/environments.md).")


class DataSection(Section):
    pretrain: SourceSection = Setting(default_factory=SourceSection, description="Pretraining corpus.")
    sft: SourceSection = Setting(default_factory=SourceSection, description="Chat data (Alpaca, ShareGPT, OpenAI "
                                 "messages).")
    preference: SourceSection = Setting(default_factory=SourceSection, description="Preference pairs (prompt/chosen/"
                                        "rejected, UltraFeedback, HH).")
    text_field: str = Setting("text", description="Field holding the text in JSON/Parquet/Arrow pretraining rows.")
    on_bad_row: Literal["skip", "fail"] = Setting("skip", description="Skip bad rows (counted) or fail the stage.")
    eval: EvalSourceSection = Setting(default_factory=EvalSourceSection, description="Held-out prompts for the "
                                      "evaluation steps (default: rows held out of the stages' own data).")
    prompts: PromptSourceSection = Setting(default_factory=PromptSourceSection, description="Prompts with optional "
                                           "reference answers for the online stages (ppo, grpo, rloo) and their "
                                           "evaluation (default: the preference pairs' prompts).")
    demo: DemoSection = Setting(default_factory=DemoSection, description="Demo data sizes.")


class TokenizerSection(Section):
    pretrained: str | None = Setting(None, description="Load this tokenizer (hub name or local dir) instead of "
                                     "training one.")
    vocab_size: int = Setting(512, ge=1, description="Vocabulary size of the trained byte-level BPE, special tokens "
                              "included.")
    min_frequency: int = Setting(2, ge=1, description="Minimum pair frequency for a BPE merge.")
    special_tokens: list[str] = Setting(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"],
                                        description="Special tokens: end-of-text, start and end of a chat turn, "
                                        "padding (the last; end-of-text when there are three).")
    val_fraction: float = Setting(0.05, gt=0, lt=1, description="Fraction of documents held out as the val shard.")
    train_sample_bytes: int = Setting(100_000_000, ge=1, description="BPE trains on a seeded sample of at most this "
                                      "many bytes of documents, drawn across the whole corpus.")
    shard_tokens: int = Setting(50_000_000, ge=1000, description="Maximum tokens per shard file.")
    word_cache: bool = Setting(True, same_result=True, description="Encode each distinct word once, the same ids "
                               "as the tokenizer alone (gptforge.data.encoder); false: encode every document whole.")
    num_workers: int = Setting(0, ge=0, same_result=True, description="Worker processes of the local Ray instance; 0 "
                               "means one per CPU core.")
    cluster: str | None = Setting(None, same_result=True, description="Ray cluster doing the tokenize stage's "
                                  "parallel work ('auto' or host:port); None: a local instance the stage starts.")

    @model_validator(mode="after")
    def _vocab_holds_bytes(self):
        need = 256 + len(self.special_tokens)
        if self.pretrained is None and self.vocab_size < need:
            raise ValueError(f"tokenizer.vocab_size={self.vocab_size} is smaller than the byte alphabet (256) "
                             f"plus {len(self.special_tokens)} special tokens = {need}")
        if self.pretrained is None and len(self.special_tokens) < 3:
            raise ValueError("tokenizer.special_tokens needs at least end-of-text, turn start and turn end")
        return self
