import pytest
import torch

from gptforge.core.config import load_config
from gptforge.model.train.engine import lr_schedule
from tests.conftest import TINY


def lrs(lr: float, min_lr: float, warmup: int, steps: int) -> list[float]:
    train = load_config(TINY, [f"pretrain.lr={lr}", f"pretrain.min_lr={min_lr}", f"pretrain.warmup_steps={warmup}",
                               f"pretrain.max_steps={steps}"]).pretrain
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = lr_schedule(opt, train)
    out = []
    for _ in range(steps + 1):
        out.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return out


def test_warmup_then_cosine_to_min_lr_by_hand():
    # warmup 2: 0, 1/2; then cos over 4 steps from 1 to 0.1: progress 0, 1/4, 1/2, 3/4, 1
    c = [0.5 * (1 + __import__("math").cos(__import__("math").pi * p)) for p in (0, 0.25, 0.5, 0.75, 1)]
    assert lrs(1.0, 0.1, 2, 6) == pytest.approx([0.0, 0.5] + [0.1 + 0.9 * x for x in c])


def test_never_decays_upwards():
    assert lrs(1.0, 2.0, 0, 4) == pytest.approx([1.0] * 5)


def test_the_schedule_is_the_one_the_trl_stages_take():
    """Our loops' schedule and transformers' cosine_with_min_lr (the TRL stages' lr_scheduler_type) agree at every
    step, warm-up and the end included."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-4)
    theirs = get_cosine_with_min_lr_schedule_with_warmup(opt, 7, 50, min_lr_rate=1e-5 / 3e-4)
    expected = []
    for _ in range(51):
        expected.append(theirs.get_last_lr()[0])
        opt.step()
        theirs.step()
    assert lrs(3e-4, 1e-5, 7, 50) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_wsd_holds_the_peak_then_decays_linearly_as_the_trl_stages_schedule_it():
    """warmup-stable-decay in our loops (lr_factor with a decay share) and in the TRL stages (transformers'
    warmup_stable_decay, as hf_trainer.schedule_kwargs asks for it) agree at every step: warmup, the peak held until
    the last 30% of the steps, a linear fall to min_lr at the end (warmup from min_lr, as transformers' does)."""
    from transformers import get_scheduler

    from gptforge.model.train.engine import lr_factor
    from gptforge.model.train.hf_trainer import schedule_kwargs

    section = load_config(TINY, ["preference.schedule=wsd", "preference.decay_fraction=0.3", "preference.lr=3e-4",
                                 "preference.min_lr=1e-5", "preference.warmup_steps=7",
                                 "preference.max_steps=50"]).preference
    ours = [3e-4 * lr_factor(s, 7, 50, 1e-5 / 3e-4, 0.3) for s in range(51)]
    assert ours[0] == pytest.approx(1e-5) and ours[7:36] == pytest.approx([3e-4] * 29)
    assert ours[50] == pytest.approx(1e-5)
    assert ours[40] == pytest.approx(3e-4 - (3e-4 - 1e-5) * 5 / 15)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-4)
    kwargs = schedule_kwargs(section)
    theirs = get_scheduler(kwargs["lr_scheduler_type"], opt, num_warmup_steps=7, num_training_steps=50,
                           scheduler_specific_kwargs=kwargs["lr_scheduler_kwargs"])
    expected = []
    for _ in range(51):
        expected.append(theirs.get_last_lr()[0])
        opt.step()
        theirs.step()
    assert ours == pytest.approx(expected, rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_muon_leaves_every_embedding_table_and_head_to_adamw(family):
    """What gptforge gives AdamW under `optimizer: muon`, whatever the names: GPT-2's `wte` and `wpe` (its head tied
    to `wte`), Llama's `embed_tokens` and untied `lm_head`, and a reward model's `score` (a 1 x hidden matrix
    DeepSpeed's names would orthogonalise); Muon steps every other matrix, the norms and biases stay AdamW's."""
    from transformers import AutoModelForSequenceClassification

    from gptforge.core.presets import PRESETS
    from gptforge.model.build import build_model
    from gptforge.model.train.engine import embedding_params

    arch = PRESETS["tiny" if family == "gpt2" else "llama-tiny"]
    lm = build_model(arch, 320)
    scorer = AutoModelForSequenceClassification.from_config(lm.config.__class__(**{**lm.config.to_dict(),
                                                                                   "num_labels": 1}))
    for model, head in ((lm, "lm_head.weight"), (scorer, "score.weight")):
        kept = embedding_params(model)
        named = {n for n, p in model.named_parameters() if id(p) in kept}
        tables = {"transformer.wte.weight", "transformer.wpe.weight"} if family == "gpt2" else {
            "model.embed_tokens.weight"}
        heads = set() if (family == "gpt2" and head == "lm_head.weight") else {head}  # tied: named as wte
        assert named == tables | heads, named
        matrices = {n for n, p in model.named_parameters() if p.dim() >= 2 and id(p) not in kept}
        assert matrices and all(".h." in n or ".layers." in n for n in matrices), matrices
