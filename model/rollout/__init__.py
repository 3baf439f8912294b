"""Rollouts: what an online stage samples from its policy. A rollout is one episode: the prompt, then turns of the
policy, each of which may call tools whose results come back as the template renders a tool turn, until a turn
calls none or `max_turns` or the length budget is reached.

- `tools`: environments and tools in TRL's conventions (an environment factory, `reset(**row)`, public methods with
  type hints and docstrings as tools, an optional `get_reward()`; stateless functions), run with a timeout, a
  failure becoming the tool's error message to the model;
- `calls`: the tool calls of a turn, parsed in the model's own format (Hermes / Qwen2.5 `<tool_call>`, Llama 3.1
  JSON);
- `episode`: the multi-turn loop, token-exact: the ids trained are the ids sampled, the tokens between turns are
  added as the template renders them, and the mask covers exactly the policy's own tokens;
- `online`: the same episodes inside TRL's GRPOTrainer (its `rollout_func` hook) and RLOOTrainer, so that PPO, GRPO
  and RLOO share them.
"""
