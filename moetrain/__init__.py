"""moetrain: train Mixture-of-Experts language models with composable parallelism on SLURM."""
__version__ = "0.1.0"
