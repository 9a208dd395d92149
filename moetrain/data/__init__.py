"""Data: text corpora (``corpus``), tokenizers (``tokenizer``), token shards on disk (their format
and manifest: ``format``; written by ``writer``, checked by ``verify``, read by ``reader``),
Megatron-LM ``.bin/.idx`` files (``megatron``), parallel and resumable corpus tokenization
(``pipeline``, on SLURM: ``slurm_array``) and the training batch loader (``loader``).
Command-line entry points live in ``tools/``."""
