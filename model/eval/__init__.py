"""Generating and judging: greedy answers scored against references and the preference report (generation), the
rewards of online RL (rewards: checkers, the user's functions, reward servers, the reward model), and standard
benchmarks through lm-evaluation-harness (harness)."""
