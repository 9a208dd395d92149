"""Launching runs: preflight checks, the per-rank job callable, local and SLURM executors."""
