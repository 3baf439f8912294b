"""gptforge: tokenize, pretrain under DeepSpeed ZeRO, SFT, reward model, DPO/PPO/GRPO/RLOO, chained by Prefect.

Layers, each importing only from those before it:

    gptforge.core      errors, the config schema, model presets
    gptforge.data      sources, format adapters, the demo data, tokenizer training, shards, loaders
    gptforge.model     building models, losses, the training machinery, export, evaluation
    gptforge.stages    one module per stage, each runnable under any launcher
    gptforge.pipeline  the stage store, launching, Prefect flows, the CLI, reports

`data`, `model`, `stages` and `pipeline` sit at the repository root and install as subpackages of this one.
"""

__version__ = "0.1.0"
