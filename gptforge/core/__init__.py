"""What every layer needs and that needs nothing of gptforge: errors, the config schema, presets, atomic files."""
