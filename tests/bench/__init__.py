"""Every script in bench/ runs, shrunk, so that none rots unseen: each is started as a user starts it, on a tiny
model and a few steps, and must exit 0 and print the figure it exists for. The figures themselves (ratios against
targets) are read from full runs, never asserted here. bench/gpu.sh, and bench/pretrain.py within it:
tests/test_infra.py."""
