"""Tests that start processes: forked gloo ranks (``dist_utils.run_ranks``), torchrun agents,
scripts."""
