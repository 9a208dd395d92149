"""Data: text corpora (``corpus``), tokenizers (``tokenizer``), token shards on disk (``shards``)
and the training batch loader (``loader``). Command-line entry points live in ``tools/``."""
