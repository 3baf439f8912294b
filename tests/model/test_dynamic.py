"""Dynamic sampling's splice of a new draw's groups into a generation batch (gptforge.model.trainers.dynamic), on
batches shaped as TRL's trainers return them: prompts left-padded, completions right-padded, of other widths."""

import torch

from gptforge.model.trainers.dynamic import splice

PAD = 9


def batch(prompts: list[list[int]], completions: list[list[int]], advantages: list[float]) -> dict:
    P, C = max(map(len, prompts)), max(map(len, completions))
    return {
        "prompt_ids": torch.tensor([[PAD] * (P - len(p)) + p for p in prompts]),
        "prompt_mask": torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts]),
        "completion_ids": torch.tensor([c + [PAD] * (C - len(c)) for c in completions]),
        "completion_mask": torch.tensor([[1] * len(c) + [0] * (C - len(c)) for c in completions]),
        "old_per_token_logps": torch.tensor([[-0.5] * len(c) + [0.0] * (C - len(c)) for c in completions]),
        # the rollout room's policy mask: its first token, then a tool's result; padded with 1 as TRL pads it
        "tool_mask": torch.tensor([[1] + [0] * (len(c) - 1) + [1] * (C - len(c)) for c in completions]),
        "importance_sampling_ratio": torch.ones(len(prompts), 1),  # GSPO's: one a sequence
        "advantages": torch.tensor(advantages),
        "num_items_in_batch": torch.tensor(7),
    }


def test_a_new_draws_group_takes_an_equal_groups_place_padded_to_the_wider_batch():
    # groups of 2: group 0 (rows 0, 1) had equal rewards; the new draw's group 1 (rows 2, 3) did not
    out = batch([[1, 2], [1, 2], [3], [3]], [[5], [6], [7, 8], [7]], [0.0, 0.0, 0.5, -0.5])
    new = batch([[4], [4], [1, 2, 3], [1, 2, 3]], [[5, 5], [5, 5], [6, 6, 6], [2]], [0.0, 0.0, 1.0, -1.0])
    got = splice(out, new, [(0, 1)], 2, PAD)
    # the new group's prompt, left-padded to its width of 3; the others padded with it, unchanged
    assert got["prompt_ids"].tolist() == [[1, 2, 3], [1, 2, 3], [PAD, PAD, 3], [PAD, PAD, 3]]
    assert got["prompt_mask"].tolist() == [[1, 1, 1], [1, 1, 1], [0, 0, 1], [0, 0, 1]]
    assert got["completion_ids"].tolist() == [[6, 6, 6], [2, PAD, PAD], [7, 8, PAD], [7, PAD, PAD]]
    assert got["completion_mask"].tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 0, 0]]
    # the policy's mask moves with its rows (past a completion's end it is multiplied by completion_mask's 0)
    assert got["tool_mask"].tolist() == [[1, 0, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]]
    assert got["old_per_token_logps"].tolist() == [[-0.5] * 3, [-0.5, 0, 0], [-0.5, -0.5, 0], [-0.5, 0, 0]]
    assert got["advantages"].tolist() == [1.0, -1.0, 0.5, -0.5]
    assert got["importance_sampling_ratio"].shape == (4, 1)
    assert got["num_items_in_batch"] is out["num_items_in_batch"]  # a scalar: the trainer takes it again
    assert out["completion_ids"].shape == (4, 2)  # the batch it was given is left as it was


def test_no_place_leaves_the_batch_as_drawn():
    out = batch([[1], [1]], [[5], [6]], [0.0, 0.0])
    assert splice(out, batch([[2], [2]], [[3, 4], [4]], [1.0, -1.0]), [], 2, PAD) is out
