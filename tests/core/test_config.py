import pytest
from pydantic import BaseModel

from gptforge.core.config import PipelineConfig, Section, load_config, result_fields, tokenizer_source
from gptforge.core.errors import ConfigError
from gptforge.core.registry import pipeline_stages
from tests.conftest import ROOT, TINY


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_yaml_loads(path):
    cfg = load_config(path)
    assert cfg.run.name


def test_overrides_are_typed():
    cfg = load_config(TINY, ["pretrain.lr=3e-4", "model.n_layer=2", "data.on_bad_row=fail"])
    assert cfg.pretrain.lr == pytest.approx(3e-4)
    assert cfg.model.arch().n_layer == 2
    assert cfg.data.on_bad_row == "fail"


def test_unknown_key_names_the_closest_valid_key():
    with pytest.raises(ConfigError, match=r"unknown key pretrain\.lrr; did you mean pretrain\.lr\?"):
        load_config(TINY, ["pretrain.lrr=1"])
    with pytest.raises(ConfigError, match=r"unknown key tokenizr; did you mean tokenizer\?"):
        load_config(TINY, ["tokenizr.vocab_size=1"])


def test_wrong_type_names_the_key():
    with pytest.raises(ConfigError, match=r"pretrain\.max_steps"):
        load_config(TINY, ["pretrain.max_steps=lots"])


@pytest.mark.parametrize("overrides, message", [
    (["model.n_embd=100", "model.n_head=3"], r"model: n_embd=100 is not divisible by n_head=3"),
    (["pretrain.global_batch_size=30"], r"global_batch_size=30 is not divisible"),
    (["pretrain.enabled=false"], r"pretrain.enabled is false and model.pretrained is not set: sft has no model"),
    (["sft.enabled=false"], r"reward.enabled is true but its input stage sft is disabled"),
    (["sft.lora.quantize=4"], r"sft.lora: quantize=4 needs adapters: set r > 0"),
    (["tokenizer.vocab_size=100"], r"vocab_size=100 is smaller than the byte alphabet"),
    (["pretrain.seq_len=4096"], r"exceeds the model context"),
    (["model.preset=gpt9"], r"unknown preset 'gpt9'"),
    (["data.preference=pairs.jsonl", "preference.algorithm=[dpo,ppo]"],  # tiny.yaml: exact_match among the rewards
     r"preference.rewards\[0\] \(exact_match\) compares responses with reference answers, but the prompts are "
     r"data.preference's \('pairs.jsonl'\), which have none: set data.prompts"),
    (["preference.rewards=[]"], r"preference.rewards is empty"),
    (["preference.rewards=[{name: math_eq}]"], r"reward name 'math_eq' is neither a built-in .* did you mean "
     r"'math_equal'\?"),
    (["preference.rewards=[{name: mymodule}]"], r"reward name 'mymodule' is neither a built-in"),
    (["preference.rewards=[{name: format}]"], r"preference.rewards names format but preference.format_pattern is "
     r"not set"),
    (["preference.rewards=[{name: format}]", "preference.format_pattern=(a"], r"preference.format_pattern '\(a' is "
     r"not a regex"),
    (["preference.rewards=[{url: ftp://x}]"], r"reward url 'ftp://x' is not an http"),
    (["preference.rewards=[{name: exact_match}, {name: exact_match, weight: 2}]"], r"preference.rewards\[1\]: a "
     r"second reward logged as 'exact_match'"),
    (["preference.ppo.verifier_reward=true"], r"unknown key preference.ppo.verifier_reward; the online stages' "
     r"rewards are preference.rewards now"),
    (["data.preference=pairs.jsonl", "reward.policy_samples=100"],
     r"reward.policy_samples needs data.preference: demo"),
    (["preference.algorithm=grpo", "preference.global_batch_size=64", "preference.grpo.ptx_batch_size=6"],
     r"preference.grpo.ptx_batch_size=6 is not divisible by global_batch_size/micro_batch_size = 4"),
    (["preference.dpo.los_type=ipo"], r"unknown key preference.dpo.los_type; did you mean preference.dpo.loss_type\?"),
    (["pretrain.spike_factor=1"], r"pretrain.spike_factor"),  # a spike is over the median, not at it
    (["sft.max_bad_steps=0"], r"sft.max_bad_steps"),
    (["distributed.timeout_minutes=0"], r"distributed.timeout_minutes"),
])
def test_impossible_combinations(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, overrides)


def test_a_pipeline_from_a_pretrained_model_without_pretraining_starts_at_sft():
    cfg = load_config(TINY, ["model.pretrained=org/name", "pretrain.enabled=false"])
    assert pipeline_stages(cfg)[:2] == ["sft", "reward"]
    assert tokenizer_source(cfg) == ("org/name", None)
    assert tokenizer_source(load_config(TINY, ["model.pretrained=org/name", "model.revision=v2"])) == ("org/name", "v2")
    assert pipeline_stages(load_config(TINY, ["model.pretrained=org/name"]))[:2] == ["tokenize", "pretrain"]
    assert tokenizer_source(load_config(TINY, ["model.pretrained=org/name", "tokenizer.pretrained=other"]))[0] == \
        "other"


def test_reference_checks_are_ignored_where_no_online_algorithm_runs():
    cfg = load_config(TINY, ["data.preference=pairs.jsonl", "preference.algorithm=dpo", "reward.policy_samples=0"])
    assert [r.name for r in cfg.preference.rewards] == ["exact_match", "reward_model"]


def test_without_a_reward_model_among_the_rewards_there_is_no_reward_stage():
    from gptforge.pipeline.store import upstream

    cfg = load_config(TINY, ["preference.algorithm=[dpo,ppo,grpo]", "preference.rewards=[{name: exact_match}]"])
    assert pipeline_stages(cfg) == ["tokenize", "pretrain", "sft", "dpo", "ppo", "grpo"]
    assert upstream(cfg, "ppo") == ("sft",) and upstream(cfg, "eval-grpo") == ("grpo", "sft")
    assert pipeline_stages(load_config(TINY, ["preference.algorithm=ppo"]))[3] == "reward"


def test_each_algorithm_reads_its_own_section():
    cfg = load_config(TINY, ["preference.ppo.ptx_coef=0.5", "preference.grpo.num_generations=8"])
    assert (cfg.preference.ppo.ptx_coef, cfg.preference.grpo.ptx_coef, cfg.preference.rloo.ptx_coef) == (0.5, 1.0, 1.0)
    assert (cfg.preference.grpo.num_generations, cfg.preference.rloo.num_generations) == (8, 4)
    assert cfg.preference.grpo.scale_rewards == "none" and cfg.preference.dpo.loss_type == ["sigmoid", "sft"]


def test_ptx_rows_per_micro_batch():
    """The ptx rows of an update spread over processes and micro-batches; by default one per response."""
    oc = load_config(TINY).preference.grpo.model_copy(update={"ptx_batch_size": None})
    assert oc.ptx_rows(8, world=2, micro_steps_per_update=4) == 8  # TRL: 64 completions a step, 8 per micro-batch
    assert oc.ptx_rows(8, world=2, micro_steps_per_update=1) == 8  # PPO: an update is one minibatch of 8 a process
    oc = oc.model_copy(update={"ptx_batch_size": 256})
    assert oc.ptx_rows(8, world=2, micro_steps_per_update=4) == 32
    assert oc.ptx_rows(8, world=2, micro_steps_per_update=1) == 128


def sections(model: type[BaseModel], prefix=""):
    for name, field in model.model_fields.items():
        yield f"{prefix}{name}", field
        if isinstance(field.annotation, type) and issubclass(field.annotation, Section):
            yield from sections(field.annotation, f"{prefix}{name}.")


def test_every_field_has_a_one_line_help():
    long = {key: field.description for key, field in sections(PipelineConfig)
            if not field.description or "\n" in field.description or len(field.description) > 160}
    assert not long


def test_result_fields_leave_out_cadence_and_nest():
    cfg = load_config(TINY)
    pretrain = result_fields(cfg.pretrain)
    assert "lr" in pretrain and "seq_len" in pretrain
    cadence = {"log_every", "eval_every", "save_every", "keep_last", "compile", "eval_batches", "enabled"}
    assert not cadence & set(pretrain)
    shared = result_fields(cfg.preference, leave_out=("dpo", "ppo", "grpo", "rloo"))
    assert "beta" in shared and not {"algorithm", "dpo", "ppo"} & set(shared)
    assert result_fields(cfg.preference)["ppo"]["ptx_coef"] == 1.0


@pytest.mark.parametrize("overrides, says", [
    (["distributed.sequence_parallel=3"], "distributed.sequence_parallel=3 does not divide the world size 2"),
    (["distributed.sequence_parallel=2", "pretrain.seq_len=95"], "does not divide pretrain.seq_len=95"),
    (["distributed.sequence_parallel=2", "sft.max_length=95"], "does not divide sft.max_length=95"),
    (["distributed.sequence_parallel=2", "sft.packing=true"], "sft.packing with distributed.sequence_parallel=2"),
    (["distributed.sequence_parallel=2", "pretrain.document_mask=true"], "pretrain.document_mask with"),
    (["distributed.sequence_parallel=2", "model.attention=eager"], "does not run on model.attention=eager"),
    (["distributed.nproc_per_node=3", "distributed.sequence_parallel=3", *[f"{s}.{k}" for s in (
        "pretrain", "sft", "reward", "preference") for k in ("micro_batch_size=1", "global_batch_size=3")],
      "pretrain.seq_len=96"], "does not divide the model's 4 attention heads"),
])
def test_sequence_parallelism_that_cannot_run_is_one_error_naming_the_key(overrides, says):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, overrides)
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("overrides, says, fixed", [
    (["model.preset=moe-tiny", "distributed.zero_stage=0", "pretrain.optimizer=muon"],
     "pretrain.optimizer=muon with distributed.zero_stage=0 does not serve a mixture of experts in bf16",
     ["distributed.zero_stage=2"]),
    (["distributed.sequence_parallel=2", "distributed.zero_stage=0", "sft.optimizer=muon"],
     "sft.optimizer=muon with distributed.zero_stage=0 does not serve sequence parallelism in bf16",
     ["distributed.precision=fp32"]),
    (["preference.optimizer=muon", "preference.algorithm=[ppo,grpo]"],
     "preference.optimizer=muon: grpo trains through TRL's GRPO trainer, which steps its own AdamW",
     ["preference.algorithm=ppo"]),
    (["reward.optimizer=sgd"], "reward.optimizer", ["reward.optimizer=adamw"]),
    (["pretrain.schedule=wsd", "pretrain.decay_fraction=0"], "pretrain.decay_fraction", ["pretrain.decay_fraction=1"]),
    (["preference.grpo.overlong=penalty", "preference.grpo.overlong_buffer=40"],
     "overlong_buffer=40 is longer than max_new_tokens=8", ["preference.grpo.max_new_tokens=40"]),
    (["preference.ppo.overlong=penalty"], "overlong=penalty needs overlong_buffer",
     ["preference.ppo.overlong_buffer=4"]),
    (["preference.rloo.loss_type=cispo"], "preference.rloo.loss_type", ["preference.grpo.loss_type=cispo"]),
    (["preference.grpo.loss_type=ppo"], "preference.grpo.loss_type", ["preference.grpo.loss_type=dr_grpo"]),
    (["preference.algorithm=rloo", "preference.rloo.dynamic_sampling=true", "preference.rloo.num_generations=64"],
     "preference.rloo.num_generations=64: a data-parallel rank's 32 rows a step (preference.global_batch_size over "
     "the 2 data-parallel ranks) must hold whole prompt groups, as dynamic sampling replaces whole groups",
     ["preference.rloo.num_generations=32"]),
])
def test_an_optimizer_schedule_or_loss_that_cannot_run_is_one_error_naming_the_key(overrides, says, fixed):
    """DeepSpeed's Muon without ZeRO (its bf16 optimizer on GPUs) steps dense matrices over data parallelism only,
    and TRL's trainers step their own AdamW; an overlong buffer past the budget; a loss type RLOO's trainer has not,
    or none of TRL's. The settings once fixed (ZeRO 1-3, fp32, gptforge's own PPO loop, ...) load."""
    with pytest.raises(ConfigError) as e:
        load_config(TINY, overrides)
    assert says in str(e.value) and "\n" not in str(e.value)
    assert load_config(TINY, [*[o for o in overrides if "loss_type" not in o], *fixed])


@pytest.mark.parametrize("overrides, says, fixed", [
    (["distributed.sequence_parallel=2", "preference.algorithm=grpo"],
     "preference.grpo.ptx_coef with distributed.sequence_parallel=2", "preference.grpo.ptx_coef=0"),
    (["distributed.nproc_per_node=4", "distributed.sequence_parallel=2", "preference.algorithm=rloo",
      "preference.rloo.ptx_coef=0", "preference.global_batch_size=12", "preference.micro_batch_size=1",
      "preference.rloo.num_generations=4",
      *[f"{s}.{k}" for s in ("pretrain", "sft", "reward") for k in ("global_batch_size=8", "micro_batch_size=1")]],
     "preference.rloo.num_generations=4: a data-parallel rank's 6 rows a step (preference.global_batch_size over the "
     "2 data-parallel ranks) must hold whole prompt groups, as a sequence-parallel group of 2 samples once",
     "preference.rloo.num_generations=3"),
])
def test_an_online_stage_that_cannot_share_its_sequences_is_one_error_naming_the_key(overrides, says, fixed):
    """The whole-groups rule, one for sequence-parallel groups and dynamic sampling, over the registry's
    data-parallel world; the ptx rows a sequence-parallel group cannot share. PPO takes no sequence parallelism,
    so its ptx rows are its own."""
    with pytest.raises(ConfigError) as e:
        load_config(TINY, overrides)
    assert says in str(e.value) and "\n" not in str(e.value).strip(), str(e.value)
    load_config(TINY, [*overrides, fixed])
    load_config(TINY, ["distributed.sequence_parallel=2", "preference.algorithm=ppo"])


def test_a_sequence_parallel_stage_divides_its_batch_over_its_data_parallel_world():
    """2 processes sharing each sequence (sequence_parallel 2) are one data-parallel rank: a preference batch of 2
    in micro-batches of 2 serves DPO, GRPO and RLOO (sequence parallel), and is refused for PPO, which divides it
    over both processes; pretraining and SFT likewise."""
    sp = ["distributed.sequence_parallel=2", "preference.global_batch_size=2", "preference.micro_batch_size=2"]
    for algorithm in ("dpo", "grpo", "rloo"):
        load_config(TINY, [*sp, f"preference.algorithm={algorithm}", f"preference.{algorithm}.num_generations=2",
                           f"preference.{algorithm}.ptx_coef=0"] if algorithm != "dpo" else
                    [*sp, "preference.algorithm=dpo"])
    with pytest.raises(ConfigError, match=r"preference.global_batch_size=2 is not divisible by "
                                        r"micro_batch_size\*world_size = 2\*2"):
        load_config(TINY, [*sp, "preference.algorithm=[dpo,ppo]"])
    load_config(TINY, ["distributed.sequence_parallel=2", "sft.global_batch_size=2", "sft.micro_batch_size=2"])
    with pytest.raises(ConfigError, match=r"sft.global_batch_size=2 is not divisible"):
        load_config(TINY, ["sft.global_batch_size=2", "sft.micro_batch_size=2"])
