"""Agents: what an online stage rolls out. A rollout is one episode: the prompt, then turns of the policy, each of
which may call tools whose results come back as the template renders a tool turn, until a turn calls none or
`max_turns` or the length budget is reached.

- `episode` and `trajectory`: the multi-turn loop, token-exact (the ids trained are the ids sampled, the tokens
  between turns added as the template renders them, the mask exactly the policy's own tokens);
- `tools`, `calls`, `concurrency`: environments and tools in TRL's conventions, run with a timeout, a failure the
  tool's error message to the model; the tool calls of a turn parsed in the model's own format; what a batch waits
  on, at once;
- bridges to other programs: `environments/` (other libraries' environments), `endpoint` (the policy behind an
  OpenAI-compatible endpoint), `mcp` (tools over the Model Context Protocol), `sandbox` and `judge` (model-written
  code, and the unit_tests reward judged where that code cannot reach).
"""
