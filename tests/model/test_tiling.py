"""Tiled logits+loss and tiled MLPs give the untiled loss and gradients."""

import pytest
import torch

from gptforge.core.config import load_config
from gptforge.model.build import build_model
from gptforge.model.train.losses import causal_lm_loss
from gptforge.model.train.tiling import lm_loss, logit_tiles, mlp_shards, tile_mlps


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny", "moe-tiny"])
def test_tiled_loss_and_mlps_give_the_untiled_loss_and_gradients(preset):
    cfg = load_config(None, [f"model.preset={preset}"])
    torch.manual_seed(0)
    x = torch.randint(0, 512, (2, 48))
    y = x.roll(-1, 1)
    y[:, -1] = -100
    y[0, :7] = -100  # a masked prefix: the mean is over the targets that count

    def run(tiles, shards):
        torch.manual_seed(0)
        model = build_model(cfg.model.arch(), 512, model_cfg=cfg.model)
        tiled = tile_mlps(model, shards)
        loss, out = lm_loss(model, {"input_ids": x}, y, tiles)
        loss.backward()
        return loss.detach(), grads(model), out, tiled

    plain, plain_grads, out, _ = run(1, 1)
    tiled, tiled_grads, tiled_out, n_mlps = run(5, 3)
    assert out.logits.shape == (2, 48, 512) and tiled_out.logits.shape[1] == 0  # no logits built when tiled
    assert n_mlps == (0 if preset == "moe-tiny" else cfg.model.arch().n_layer)
    torch.testing.assert_close(tiled, plain, atol=1e-6, rtol=1e-6)
    assert tiled_grads.keys() == plain_grads.keys()
    for name in plain_grads:
        torch.testing.assert_close(tiled_grads[name], plain_grads[name], atol=1e-6, rtol=1e-5, msg=name)
    torch.testing.assert_close(plain, causal_lm_loss(out.logits, y))


def test_the_checkpointed_tiles_zero3_uses_give_the_fused_tiles_loss_and_gradients():
    from gptforge.model.train.tiling import FusedLinearCrossEntropy, tiled_cross_entropy

    torch.manual_seed(0)
    head = torch.nn.Linear(32, 200)
    hidden = torch.randn(2, 30, 32, requires_grad=True)
    y = torch.randint(0, 200, (2, 30))
    y[1, 20:] = -100
    results = []
    for fused in (True, False):
        head.zero_grad()
        hidden.grad = None
        loss = (FusedLinearCrossEntropy.apply(hidden, head.weight, head.bias, y, 4, (y != -100).sum()) if fused
                else tiled_cross_entropy(head, hidden, y, 4))
        (3.0 * loss).backward()  # a scaled loss (DeepSpeed's gradient accumulation) scales the gradients
        results.append((loss.detach(), hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_tiling_switches_on_by_size():
    dist = load_config(None, []).distributed
    assert logit_tiles(dist, 1, 2048, 32000) == 1  # 250 MiB of logits: under the 1 GiB tile
    assert logit_tiles(dist, 1, 32768, 128256) == 16  # 16 GiB
    assert mlp_shards(dist, 2048, 4096) == 1 and mlp_shards(dist, 32768, 4096) == 8
    off = dist.model_copy(update={"tiling": False})
    assert logit_tiles(off, 1, 32768, 128256) == 1 and mlp_shards(off, 32768, 4096) == 1
    on = dist.model_copy(update={"tiling": True})
    assert logit_tiles(on, 1, 64, 512) == 2


def test_tiled_token_logprobs_give_the_untiled_logprobs_entropy_and_gradients():
    from gptforge.model.train.tiling import token_logprobs

    cfg = load_config(None, ["model.preset=llama-tiny"])
    torch.manual_seed(0)
    model = build_model(cfg.model.arch(), 512, model_cfg=cfg.model)
    seqs = torch.randint(0, 512, (3, 20))
    start, index = 11, seqs[:, 12:]  # 8 response tokens after a 12-token prompt
    results = []
    for tiles in (1, 3):
        model.zero_grad()
        logp, entropy, out = token_logprobs(model, {"input_ids": seqs}, start, index, tiles)
        (logp.sum() + 0.1 * entropy.sum()).backward()
        results.append((logp.detach(), entropy.detach(), grads(model), out.logits.shape[1]))
    (a, ea, ga, la), (b, eb, gb, lb) = results
    assert la == 20 and lb == 0  # tiled: no logits built
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ea, eb, atol=1e-5, rtol=1e-5)
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], atol=1e-5, rtol=1e-4, msg=name)


def test_a_summed_loss_is_the_mean_times_the_targets_tiled_or_not():
    cfg = load_config(None, ["model.preset=tiny"])
    torch.manual_seed(0)
    model = build_model(cfg.model.arch(), 512, model_cfg=cfg.model)
    x = torch.randint(0, 512, (2, 16))
    y = x.roll(-1, 1)
    y[:, 10:] = -100
    for tiles in (1, 3):
        mean, _ = lm_loss(model, {"input_ids": x}, y, tiles)
        total, _ = lm_loss(model, {"input_ids": x}, y, tiles, reduction="sum")
        torch.testing.assert_close(total, mean * 20)
        nothing, _ = lm_loss(model, {"input_ids": x}, torch.full_like(y, -100), tiles, reduction="sum")
        assert nothing.item() == 0.0
