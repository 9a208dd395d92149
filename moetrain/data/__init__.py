"""Data: text corpora (``corpus``), tokenizers (``tokenizer``), token shards on disk (``shards``),
Megatron-LM ``.bin/.idx`` files (``megatron``), parallel and resumable corpus tokenization
(``pipeline``, on SLURM: ``slurm_array``) and the training batch loader (``loader``).
Command-line entry points live in ``tools/``."""
