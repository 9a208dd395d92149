"""Small tokenizer directories in the style of three model families, built here (nothing downloaded).

Each function trains a BPE of a few hundred ids on :data:`CORPUS` (milliseconds) and writes a
directory as the family's models ship it: ``tokenizer.json``, ``tokenizer_config.json`` (special
tokens, BOS setting, ``tokenizer_class``, ``added_tokens_decoder`` and a ``chat_template`` in the
family's own format) and ``special_tokens_map.json``. ``transformers.AutoTokenizer`` loads each
offline. What is copied from each family is its *shape* — pre-tokenizer, special tokens and their
ids' place, how BOS is added, the chat format — not its vocabulary.

* :func:`llama3` — byte-level BPE behind a regex split (digits in runs of at most 3), specials
  appended after the vocabulary, a ``TemplateProcessing`` post-processor that puts
  ``<|begin_of_text|>`` first, ``tokenizer_config.json`` without ``add_bos_token`` (as Llama 3).
* :func:`mixtral` — SentencePiece-style BPE (Mixtral, Llama 2, Mistral): a Metaspace ``▁``
  pre-tokenizer and decoder, ``byte_fallback`` with the 256 ``<0xXX>`` byte tokens at ids 3-258,
  ``<unk>`` ``<s>`` ``</s>`` at ids 0-2, ``add_bos_token: true``, ``add_eos_token: false``.
* :func:`deepseek_v3` — byte-level BPE, ``<｜begin▁of▁sentence｜>`` / ``<｜end▁of▁sentence｜>`` at
  ids 0 / 1, the chat markers ``<｜User｜>`` / ``<｜Assistant｜>`` appended, ``add_bos_token: true``
  and the config's tokens in transformers' ``{"content": ...}`` form.

Each returns the directory. :data:`FAMILIES` maps the family name to (builder, BOS token, EOS token).
"""

from __future__ import annotations

import json
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors, trainers

__all__ = ["CORPUS", "FAMILIES", "llama3", "mixtral", "deepseek_v3"]

_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A mixture of experts routes every token to a few of its many feed-forward networks.",
    "In 2024 the cluster trained on 15,000,000,000,000 tokens over 54 days.",
    "She said: \"It's fine, we'll restart from step 1200.\"",
    "Tabs\tand  double  spaces, new\nlines and\r\ncarriage returns are text too.",
    "def add(a, b):\n    return a + b  # numbers: 3.14159, 2.71828",
    "Über den Wolken muss die Freiheit wohl grenzenlos sein.",
    "Le cœur a ses raisons que la raison ne connaît point.",
    "Shall I compare thee to a summer's day? Thou art more lovely and more temperate.",
    "Loss fell from 10.4 to 3.2; the router's balance loss stayed near 1.0.",
    "Experts, heads, layers and shards: everything is split along some axis.",
    "What is the capital of France? The capital of France is Paris.",
]
CORPUS: list[str] = [" ".join(_SENTENCES[(i * 7 + j) % len(_SENTENCES)] for j in range(1 + i % 5)) for i in range(200)]
"""Documents of English, German, French, code and numbers the tokenizers are trained on."""

# A regex split in the style of the tiktoken-era tokenizers (Llama 3, DeepSeek-V3): contractions,
# words with one leading non-letter, digits in runs of at most three, punctuation runs, spaces.
_WORDS = r"'(?:s|t|re|ve|m|ll|d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

LLAMA3_CHAT = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{{- message['content'] | trim }}{{- '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)
# Mistral's [INST] format: a system message goes before the first user message; each assistant
# reply ends with </s>. The user turn ends with [/INST], which is already the generation prompt,
# so add_generation_prompt adds nothing.
MISTRAL_CHAT = (
    "{{- bos_token }}"
    "{%- set system = messages | selectattr('role', 'equalto', 'system') | map(attribute='content') | list %}"
    "{%- for message in messages if message['role'] != 'system' %}"
    "{%- if message['role'] == 'user' %}"
    "{{- '[INST] ' + (system[0] + '\n\n' if loop.first and system else '') + message['content'] + ' [/INST]' }}"
    "{%- else %}{{- message['content'] + eos_token }}{%- endif %}"
    "{%- endfor %}"
)
DEEPSEEK_V3_CHAT = (
    "{{- bos_token }}"
    "{%- for message in messages if message['role'] == 'system' %}{{- message['content'] }}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{- '<｜User｜>' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' %}{{- '<｜Assistant｜>' + message['content'] + eos_token }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<｜Assistant｜>' }}{%- endif %}"
)


def _special(content: str) -> AddedToken:
    return AddedToken(content, special=True, normalized=False)


def _train(tok: tokenizers.Tokenizer, vocab_size: int, special: list[str], alphabet: list[str]) -> None:
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[_special(t) for t in special],
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)


def _added_tokens_decoder(tok: tokenizers.Tokenizer) -> dict:
    """``added_tokens_decoder`` of a tokenizer_config.json, as transformers saves it."""
    return {str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                     "single_word": t.single_word, "special": t.special}
            for i, t in sorted(tok.get_added_tokens_decoder().items())}


def _write(out: Path, tok: tokenizers.Tokenizer, config: dict, special_map: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"added_tokens_decoder": _added_tokens_decoder(tok), **config}
    for name, content in (("tokenizer_config.json", config), ("special_tokens_map.json", special_map)):
        (out / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return out


def llama3(out: str | Path) -> Path:
    """A Llama-3-style tokenizer directory in ``out`` (created); returns it."""
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tok = tokenizers.Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_WORDS), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    _train(tok, 400, [], pre_tokenizers.ByteLevel.alphabet())
    tok.add_special_tokens([_special(t) for t in specials])  # after the vocabulary, as Llama 3's 128000+
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                                      special_tokens=[("<|begin_of_text|>", bos)]),
    ])
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "clean_up_tokenization_spaces": True,
              "model_input_names": ["input_ids", "attention_mask"], "model_max_length": 131072,
              "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": LLAMA3_CHAT}
    return _write(Path(out), tok, config, {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"})


def mixtral(out: str | Path) -> Path:
    """A Mixtral / Llama-2-style (SentencePiece BPE) tokenizer directory in ``out``; returns it."""
    specials = ["<unk>", "<s>", "</s>"]
    meta = dict(replacement="▁", prepend_scheme="first", split=False)
    trained = tokenizers.Tokenizer(models.BPE())
    # Trained word by word (SentencePiece never merges across a space); encoded as one piece.
    trained.pre_tokenizer = pre_tokenizers.Metaspace(**{**meta, "split": True})
    _train(trained, 330, specials, [])
    state = json.loads(trained.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    # SentencePiece's layout: the specials, then the 256 byte tokens <0x00>..<0xFF>, then pieces.
    vocab = {t: i for i, t in enumerate(specials + [f"<0x{b:02X}>" for b in range(256)])}
    for piece, _ in sorted(state["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True,
                                          byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(**meta)
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(**meta)])
    tok.add_special_tokens([_special(t) for t in specials])  # already ids 0-2: this marks them special
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B:1",
                                                       special_tokens=[("<s>", 1)])
    config = {"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "pad_token": None, "legacy": False, "clean_up_tokenization_spaces": False,
              "spaces_between_special_tokens": False, "sp_model_kwargs": {}, "model_max_length": 32768,
              "tokenizer_class": "LlamaTokenizer", "chat_template": MISTRAL_CHAT}
    return _write(Path(out), tok, config, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})


def deepseek_v3(out: str | Path) -> Path:
    """A DeepSeek-V3-style tokenizer directory in ``out`` (created); returns it."""
    bos, eos = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}{1,3}"), behavior="isolated"),
        pre_tokenizers.Split(Regex(_WORDS), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    _train(tok, 500, [bos, eos], pre_tokenizers.ByteLevel.alphabet())
    tok.add_special_tokens([_special("<｜User｜>"), _special("<｜Assistant｜>")])
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1",
                                                       special_tokens=[(bos, 0)])

    def added(content: str) -> dict:  # the AddedToken form of DeepSeek-V3's config
        return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": True, "rstrip": False,
                "single_word": False}

    config = {"add_bos_token": True, "add_eos_token": False, "bos_token": added(bos), "eos_token": added(eos),
              "pad_token": added(eos), "unk_token": None, "legacy": True, "clean_up_tokenization_spaces": False,
              "sp_model_kwargs": {}, "model_max_length": 131072, "tokenizer_class": "LlamaTokenizerFast",
              "chat_template": DEEPSEEK_V3_CHAT}
    return _write(Path(out), tok, config, {"bos_token": added(bos), "eos_token": added(eos), "pad_token": added(eos)})


FAMILIES = {
    "llama3": (llama3, "<|begin_of_text|>", "<|end_of_text|>"),
    "mixtral": (mixtral, "<s>", "</s>"),
    "deepseek_v3": (deepseek_v3, "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
}
