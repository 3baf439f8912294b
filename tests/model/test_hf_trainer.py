"""The TRL stages' model hook: a left-padded row is scored at the positions generation gave it."""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from gptforge.model.train.hf_trainer import positions_from_mask


def test_left_padded_rows_score_as_unpadded_with_the_hook():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2)).eval()
    row = torch.tensor([[5, 6, 7, 8]])
    padded, mask = torch.tensor([[0, 0, 5, 6, 7, 8]]), torch.tensor([[0, 0, 1, 1, 1, 1]])
    alone = model(input_ids=row).logits
    assert not torch.allclose(model(input_ids=padded, attention_mask=mask).logits[:, 2:], alone, atol=1e-4)
    positions_from_mask(model)
    assert torch.allclose(model(input_ids=padded, attention_mask=mask).logits[:, 2:], alone, atol=1e-5)
    # generation (KV cache: one new token a step) is unchanged by the hook
    out = model.generate(input_ids=padded, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out[0, 2:].tolist() == model.generate(input_ids=row, max_new_tokens=4, do_sample=False,
                                                 pad_token_id=0)[0].tolist()

