"""Sampling from a policy: the engine seam an inference engine fits (`engine`: ids in, ids and their
log-probabilities out, weights in by name; `hf` built in), gptforge's own samplers (`generate`), a step's rollouts
through an engine, in a training process or a rollout worker (`sampling`), the workers themselves (`workers`: sync
in process, or async on Ray, with versioned weights and bounded staleness), and the off-policy correction of what
they sampled (`offpolicy`: TIS, IcePop, the mismatch)."""
