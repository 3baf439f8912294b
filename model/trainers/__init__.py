"""The hooks into TRL's trainers, and all of gptforge's use of their private API (tests/model/test_trl_hooks.py names
each method overridden or called, and fails when a TRL upgrade changes one): `trl_online` (GRPO's and RLOO's body
around TRL's GRPOTrainer and RLOOTrainer), `online` (the agents' episodes inside them), `dynamic` (DAPO's dynamic
sampling), `overlong` (responses cut at their budget: masked, or DAPO's soft penalty), `sequence_parallel` (DPO,
GRPO and RLOO sequence-parallel), `ptx` (the chosen responses' loss added to the policy's)."""
