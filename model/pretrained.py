"""Models gptforge did not build: a Hugging Face hub name or a local directory as the start of a stage.

A hub name is resolved to a commit at every run (online: the hub's answer for the revision; offline, with
HF_HUB_OFFLINE: the local cache's `refs/`), and that commit is what fingerprints it, so a new upload retrains and
an unchanged one is reused. A local directory is fingerprinted by its files' bytes (digests cached like data
files'). Loading by name is `snapshot_download` into the hub cache, then the same `from_pretrained(dir)` as a local
directory. Before anything trains, `check_model` turns every way a model can be unusable into one error naming
the key and what was looked for.

A model's own tokenizer, chat template and stop tokens are used as they are; `prepare_tokenizer` gives a model
without a chat template the configured one (ChatML by default, its special tokens added) and one without a pad
token a pad of its own, and `fit_embeddings` grows the embeddings to the tokenizer (new rows drawn around the
mean of the old ones, gathered under ZeRO-3).
"""

from __future__ import annotations

import hashlib
import logging
import json
from pathlib import Path

from gptforge.core import console
from gptforge.core.errors import ConfigError, UserError
from gptforge.data.tokenizer import chat_template

WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")
CHATML = chat_template(*CHATML_TOKENS, markers=False)  # for a model without a chat template: ChatML, tools Hermes
PAD = "<|pad|>"


def is_local(name: str) -> bool:
    """A local directory (or a path that means one), as opposed to a hub name `org/name`."""
    return Path(name).expanduser().is_dir() or name.startswith((".", "/", "~")) or name.count("/") > 1


def hub_cache() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def resolve_commit(name: str, revision: str | None, key: str = "model.pretrained") -> str:
    """The commit a hub model name reads at `revision` (default main): the hub's answer, or offline the cache's."""
    if not offline():
        from huggingface_hub import HfApi

        try:
            return HfApi().model_info(name, revision=revision).sha
        except Exception as e:  # noqa: BLE001 - not found, gated, no network: all one message naming the model
            raise UserError(f"{key}={name!r} at revision {revision or 'main'}: {type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''}") from None
    repo = Path(hub_cache()) / f"models--{name.replace('/', '--')}"
    ref = repo / "refs" / (revision or "main")
    if ref.is_file():
        return ref.read_text().strip()
    if revision and (repo / "snapshots" / revision).is_dir():
        return revision
    cached = sorted(p.name for p in (repo / "refs").glob("*")) if repo.is_dir() else []
    raise UserError(f"{key}={name!r}: revision {revision or 'main'} is not in the hub cache {hub_cache()} and "
                    f"HF_HUB_OFFLINE is set" + (f"; cached refs: {', '.join(cached)}" if cached else
                                                 " (no copy of this model at all)"))


TOKENIZER_FILES = ["*.json", "*.txt", "*.model", "*.jinja", "*.tiktoken"]  # what a tokenizer needs of a repository


def model_dir(name: str, revision: str | None = None, key: str = "model.pretrained",
              allow_patterns: list[str] | None = None) -> Path:
    """The local directory of a model: the directory itself, or the hub snapshot of its resolved commit
    (downloaded into the hub cache if it is not there; only the files `allow_patterns` match, if given)."""
    if is_local(name):
        path = Path(name).expanduser()
        if not path.is_dir():
            raise UserError(f"{key}={name!r}: no such directory")
        return path
    from huggingface_hub import snapshot_download

    commit = resolve_commit(name, revision, key)
    try:
        return Path(snapshot_download(name, revision=commit, local_files_only=offline(),
                                      allow_patterns=allow_patterns))
    except Exception as e:  # noqa: BLE001
        raise UserError(f"{key}={name!r} at commit {commit}: cannot fetch it into {hub_cache()}: "
                        f"{type(e).__name__}") from None


def fingerprint(name: str, revision: str | None, cache_dir: Path | None = None, key: str = "model.pretrained") -> str:
    """What identifies a model's content: its hub name and resolved commit, or a local directory's file digests."""
    if not is_local(name):
        return f"hub:{name}@{resolve_commit(name, revision, key)}"
    from gptforge.data.sources import file_digest

    path = model_dir(name, revision, key)
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file() and ".cache" not in p.parts):
        h.update(f"{f.relative_to(path)}|{file_digest(f, cache_dir)}".encode())
    return f"local:{h.hexdigest()}"


def check_model(name: str, revision: str | None, trust_remote_code: bool, key: str,
                kind: str = "causal-lm") -> Path:
    """The model's directory, once it is known to be loadable as `kind` (causal-lm, sequence-classifier, or any:
    a backbone that gets a new head): a config transformers knows (or remote code allowed) and weights. Every
    failure is one UserError naming `key`."""
    from transformers import CONFIG_MAPPING

    path = model_dir(name, revision, key)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise UserError(f"{key}={name!r}: {path} is not a Hugging Face model directory (no config.json)")
    config = json.loads(config_file.read_text())
    needs_code = "auto_map" in config or config.get("model_type") not in CONFIG_MAPPING
    if needs_code and not trust_remote_code:
        raise ConfigError(f"{key}={name!r} needs its own modelling code (model_type {config.get('model_type')!r}"
                          f"{', auto_map' if 'auto_map' in config else ''}); set model.trust_remote_code=true to run "
                          "code from that repository")
    if not any((path / w).is_file() for w in WEIGHTS) and not list(path.glob("*.safetensors")):
        raise UserError(f"{key}={name!r}: {path} holds no model weights (none of {', '.join(WEIGHTS)})")
    architectures = config.get("architectures") or []
    if kind == "sequence-classifier" and not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise UserError(f"{key}={name!r} is not a sequence classifier (architectures: {architectures or 'none'}); "
                        "a reward model scores a sequence: give an AutoModelForSequenceClassification checkpoint")
    if kind == "causal-lm" and architectures and not any(
            a.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")) for a in architectures):
        raise UserError(f"{key}={name!r} has no causal-LM weights (architectures: {architectures})")
    return path


def load_dtype(dtype: str, bf16: bool):
    """The torch dtype a pretrained model loads in: model.dtype, or for auto the training precision."""
    import torch

    if dtype == "auto":
        return torch.bfloat16 if bf16 else torch.float32
    return getattr(torch, dtype)


def load_causal_lm(path: Path, model_cfg, bf16: bool, lora=None, **kwargs):
    """AutoModelForCausalLM.from_pretrained as every stage loads a start model: in model.dtype, its base quantized
    where `lora` (the stage's lora section) says so. Inside `partitioned` under ZeRO-3: loaded partitioned."""
    from transformers import AutoModelForCausalLM

    from gptforge.model.lora import quantization
    from gptforge.model.attention import load_kwargs

    dtype = load_dtype(model_cfg.dtype, bf16)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=model_cfg.trust_remote_code,
                                                **(quantization(lora, dtype) if lora else {}),
                                                **load_kwargs(path, model_cfg), **kwargs)


def load_policy(path: Path, cfg, bf16: bool):
    """A policy as the preference stages start it: `load_causal_lm`, with preference.lora's adapters (none at r=0;
    with them, the reference is the policy with them disabled). Inside `partitioned` under ZeRO-3."""
    from gptforge.model.lora import wrap

    lora = cfg.preference.lora
    return wrap(load_causal_lm(path, cfg.model, bf16, lora), lora, "causal-lm", "preference.lora",
                checkpointing=cfg.distributed.activation_checkpointing)


def reference_is_policy(cfg) -> bool:
    """Whether the preference stages' reference is the policy itself with its adapters disabled (preference.lora,
    no preference.reference): then no second copy is loaded."""
    return bool(cfg.preference.lora.r) and not cfg.preference.reference


def with_new_head(cls, path, stage: str, rank: int, **kwargs):
    """`cls.from_pretrained(path, **kwargs)` where the model gets a head its checkpoint lacks on purpose (a reward
    model's score on a causal LM): transformers' table of the weights it initialised (its LOAD REPORT, with advice
    to train them) becomes one line of ours naming them."""
    log = logging.getLogger("transformers.modeling_utils")  # (its level left alone: transformers reads it)
    report = console.Drop("LOAD REPORT")
    log.addFilter(report)
    try:
        model, info = cls.from_pretrained(path, output_loading_info=True, **kwargs)
    finally:
        log.removeFilter(report)
    if info["missing_keys"] and rank == 0:
        print(f"[{stage}] a new head, initialised here: {', '.join(sorted(info['missing_keys']))}", flush=True)
    return model


def start_model(cfg, inputs: dict[str, Path]) -> Path:
    """The model SFT starts from (and eval-sft compares with): the pretrain stage's output when the pipeline
    pretrains, else model.pretrained (a hub snapshot or a local directory)."""
    if (pretrained := inputs.get("pretrain")) is not None:
        return pretrained / "model"
    return model_dir(cfg.model.pretrained, cfg.model.revision)


def architecture(model_cfg):
    """(Arch, transformers config or None) of the model the pipeline trains: the preset's, or model.pretrained's
    own (its config.json alone is read: no weights needed, for the planner)."""
    if not model_cfg.pretrained:
        return model_cfg.arch(), None
    from transformers import AutoConfig

    from gptforge.model.build import arch_of

    path = model_dir(model_cfg.pretrained, model_cfg.revision)
    if not (path / "config.json").is_file():
        raise UserError(f"model.pretrained={model_cfg.pretrained!r}: no config.json in {path}")
    from gptforge.model.attention import configure

    config = AutoConfig.from_pretrained(path, trust_remote_code=model_cfg.trust_remote_code)
    configure(config, model_cfg, resolve_kernel=False)  # RoPE scaling, windows: the context the model will have
    return arch_of(config), config


def reward_model_dir(cfg, inputs: dict[str, Path]) -> Path | None:
    """The reward model that judges the policy: preference.reward_model, else the reward stage's output; None where
    preference.rewards has no reward model."""
    if not cfg.preference.uses_reward_model():
        return None
    if cfg.preference.reward_model:
        return model_dir(cfg.preference.reward_model, None, "preference.reward_model")
    return inputs["reward"] / "model"


def reference_dir(cfg, inputs: dict[str, Path]) -> Path:
    """The reference policy: preference.reference, else the SFT model."""
    if cfg.preference.reference:
        return model_dir(cfg.preference.reference, None, "preference.reference")
    return inputs["sft"] / "model"


def has_generation_markers(template: str | None) -> bool:
    import re

    return bool(template) and re.search(r"{%-?\s*generation\s*-?%}", template) is not None


def prepare_tokenizer(tokenizer, chat_template: str | None = None, grow: bool = True) -> list[str]:
    """Give a tokenizer what the chat stages need, in place: `chat_template` where given (in place of its own),
    else ChatML where it has none (its turn tokens added as special tokens); and a pad token where it has none: a
    special token that no rendered conversation holds (so a reward model, which reads its score at the last token
    that is not padding, and anything that masks padding, never confuse it with an end of turn), else a new
    `<|pad|>`.
    Returns the tokens added to the vocabulary."""
    before = len(tokenizer)
    if chat_template is not None:  # given: the template the model is trained and saved with, in place of its own
        tokenizer.chat_template = chat_template
    elif not tokenizer.chat_template:
        if grow:
            tokenizer.add_special_tokens({"extra_special_tokens": list(CHATML_TOKENS)},
                                         replace_extra_special_tokens=False)
        tokenizer.chat_template = CHATML
    if tokenizer.pad_token_id is None:
        sample = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
        rendered = set(tokenizer.apply_chat_template(sample, tokenize=True, return_dict=True)["input_ids"])
        special = sorted(i for i, t in tokenizer.added_tokens_decoder.items() if t.special)
        unused = [tokenizer.convert_ids_to_tokens(i) for i in special
                  if i not in rendered and i not in (tokenizer.bos_token_id, tokenizer.eos_token_id)]
        if unused:  # a special token no conversation holds (Llama 3's end of text): nothing to grow
            tokenizer.pad_token = unused[0]
        elif not grow:
            tokenizer.pad_token = tokenizer.eos_token
        else:
            tokenizer.add_special_tokens({"pad_token": PAD})
    return tokenizer.convert_ids_to_tokens(list(range(before, len(tokenizer))))


def fit_embeddings(model, tokenizer) -> list[int]:
    """Grow the input (and output) embeddings to the tokenizer's size where it outgrew them: new rows drawn from
    the old rows' mean and covariance (transformers' mean resizing, which gathers the partitions under ZeRO-3).
    Returns the ids of the new rows, less the pad's (it is never predicted): the rows a LoRA stage trains besides
    its adapters."""
    rows = model.get_input_embeddings().weight
    old = getattr(rows, "ds_shape", rows.shape)[0]
    if len(tokenizer) <= old:
        return []
    model.resize_token_embeddings(len(tokenizer), mean_resizing=True)
    return [i for i in range(old, len(tokenizer)) if i != tokenizer.pad_token_id]


def stop_tokens_of(model) -> list[int]:
    """The model's own stop tokens (its generation_config's eos, a list such as Llama 3's), if it has any."""
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    return [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos]



def roles(cfg) -> list[tuple[str, str, str]]:
    """(key, model name, kind for `check_model`) of each model the config names for a role beside the policy (a
    distill teacher or student that names a model, not a stage of the run, among them)."""
    from gptforge.core.declarations import STAGE_OR_MODEL
    from gptforge.core.registry import named_stage, setting

    pc = cfg.preference
    named = [("reward.pretrained", cfg.reward.pretrained, "any"), ("preference.reference", pc.reference, "causal-lm"),
             ("preference.reward_model", pc.reward_model, "sequence-classifier"),
             ("preference.ppo.critic", pc.ppo.critic, "any")]
    if cfg.distill.enabled:
        named += [(key, setting(cfg, key), "causal-lm")
                  for key in STAGE_OR_MODEL if named_stage(cfg, key) is None]
    return [(key, name, kind) for key, name, kind in named if name]


def check_same_tokenizer(student_dir: Path, teacher_dir: Path, key: str) -> None:
    """One error line naming both tokenizers where a teacher's vocabulary (`key` names it) is not its student's."""
    from transformers import AutoTokenizer

    student, teacher = AutoTokenizer.from_pretrained(student_dir), AutoTokenizer.from_pretrained(teacher_dir)
    if student.get_vocab() != teacher.get_vocab():
        raise UserError(f"{key}: the teacher's tokenizer ({teacher_dir}, {len(teacher)} tokens) is not the "
                        f"student's ({student_dir}, {len(student)} tokens); on-policy distillation here compares "
                        "their next-token distributions token for token, so they must share one vocabulary: give a "
                        "teacher with the student's tokenizer (docs/distill.md)")


def stage_or_model(cfg, inputs: dict[str, Path], ref: str) -> Path:
    """The model directory `ref` names: a stage of the run (its output's model, from `inputs`), or a config key
    (`distill.teacher`) whose value is a stage of the run or a model (hub name or local directory)."""
    from gptforge.core.registry import named_stage, setting

    if ref in inputs:
        return inputs[ref] / "model"
    stage = named_stage(cfg, ref)
    return inputs[stage] / "model" if stage else model_dir(setting(cfg, ref), None, ref)


def modeling_modules(cfg) -> list[str]:
    """The transformers modules that hold the classes of the models a stage of `cfg` builds or loads: the policy's
    family (the preset's, or model.pretrained's model type) and each role's (`roles`), read from config.json alone.
    transformers imports them on a process's first model (about 2 s of a CPU core)."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    from gptforge.model.build import model_type

    named = [(key, name, None) for key, name, _ in roles(cfg)]
    if cfg.model.pretrained:
        named.append(("model.pretrained", cfg.model.pretrained, cfg.model.revision))
    types = set() if cfg.model.pretrained else {model_type(cfg.model.arch(), cfg.model)}
    for key, name, revision in named:
        config = model_dir(name, revision, key) / "config.json"
        if config.is_file():
            types.add(json.loads(config.read_text()).get("model_type"))
    names = [model_type_to_module_name(t) for t in sorted(types - {None})]
    return ["transformers.modeling_utils", *(f"transformers.models.{n}.modeling_{n}" for n in names)]


def check_models(cfg) -> None:
    """Every model the config starts from, checked before anything runs (`check_model`); its RoPE scaling, windows
    and sequence parallelism against its own family, heads and context; the attention kernel where the stages run
    here (no work pools: a GPU worker may have what this machine lacks); and each training section's
    lora.target_modules matched against the model's modules (on a model built without memory). torch and the
    modelling code are imported only for the checks that need them: `gptforge run` checks before anything starts."""
    from gptforge.core.attention_rules import kernel

    path = None
    if cfg.model.pretrained:
        from gptforge.model.train import sequence_parallel

        path = check_model(cfg.model.pretrained, cfg.model.revision, cfg.model.trust_remote_code, "model.pretrained")
        _, config = architecture(cfg.model)
        sp = cfg.distributed.sequence_parallel
        if sp > 1 and cfg.pretrain.enabled:
            sequence_parallel.check(config, sp, cfg.pretrain.seq_len, "pretrain.seq_len")
        if sp > 1 and cfg.sft.enabled:
            sequence_parallel.check(config, sp, cfg.sft.max_length, "sft.max_length")
    if not cfg.run.work_pools and not cfg.run.default_work_pool:
        kernel(cfg.model.attention)
    for key, name, kind in roles(cfg):
        check_model(name, None, cfg.model.trust_remote_code, key, kind)
    sections = [(n, getattr(cfg, n)) for n in ("pretrain", "sft", "reward", "preference")]
    named = [(n, s.lora) for n, s in sections if s.enabled and s.lora.r and s.lora.target_modules != "all-linear"]
    if not named:
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from gptforge.model.build import build_model
    from gptforge.model.lora import targets

    with torch.device("meta"):
        model = build_model(cfg.model.arch(), cfg.model.arch().vocab_size) if path is None else \
            AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(
                path, trust_remote_code=cfg.model.trust_remote_code), trust_remote_code=cfg.model.trust_remote_code)
    for name, lora in named:
        targets(model, lora, f"{name}.lora")
