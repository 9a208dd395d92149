"""Parallelism: the mesh state, expert/data/tensor/pipeline/context parallel, and the function that applies them."""
