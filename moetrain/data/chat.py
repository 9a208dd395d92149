"""Fine-tuning data: conversations and prompt/completion pairs → token ids and a loss mask.

Two record shapes (one JSON object per line, or one parquet row):

* ``{"messages": [{"role": "system" | "user" | "assistant" | ..., "content": "..."}, ...]}`` —
  rendered with the tokenizer's chat template (the Jinja template of ``tokenizer_config.json``'s
  ``chat_template`` or ``chat_template.jinja`` beside it, as transformers reads them; rendered with
  ``jinja2`` in a sandbox, with transformers' settings: ``trim_blocks``, ``lstrip_blocks``,
  ``raise_exception``, ``tojson``, ``{% generation %}``), tokenized with the special tokens of the
  template recognised. Trained: every assistant turn as the template writes it after the
  generation prompt — its content, the end-of-turn token (``<|eot_id|>``, ``</s>``), so that the
  model learns to stop, and whatever the template puts after it (ChatML's newline) —; not the
  role headers that open a turn, nor any other role's turns. A message whose content holds a
  special token's string (``<|eot_id|>``) is refused: the template's text is tokenized with the
  special tokens recognised, so it would forge a turn.
* ``{"prompt": "...", "completion": "..."}`` — ``[BOS] + prompt + completion + EOS`` with the
  tokenizer's framing (:mod:`moetrain.data.tokenizer`), the text encoded in one piece (a
  SentencePiece tokenizer would otherwise start the completion with a word boundary of its own),
  special-token strings as plain text; trained: the completion and the EOS.

**Where an assistant turn is.** When the template marks assistant content with
``{% generation %} ... {% endgeneration %}`` (transformers' ``return_assistant_tokens_mask``, TRL's
``assistant_only_loss``), the marked text. Otherwise, for the ``k``-th message, an assistant's,
the template renders the messages before it with the generation prompt (the header that opens an
assistant turn) and the messages up to it; the turn is the text between the two. That holds for
every template that renders a conversation as the concatenation of its turns (Llama 3, Mistral,
DeepSeek-V3, ChatML); a template that rewrites earlier turns (one that drops the reasoning of
earlier answers, say) is caught — the shorter rendering is not a prefix of the longer — and the
record refused as a bad document rather than masked wrongly (mark its assistant content with
``{% generation %}`` to train such records). A token is trained when its characters overlap a turn
(as ``char_to_token``: a token that also holds the generation prompt's trailing space is trained).

The mask has one byte per token, 1 where the token is trained *as a target* (its prediction
from the token before it enters the loss); the first token of a record is never trained.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tokenizers

from moetrain.data.tokenizer import TokenizerError, special_token_names

__all__ = ["ChatError", "ChatTemplateError", "ChatTemplate", "ChatEncoder", "record_problem", "load_chat_template",
           "TRAINED_ROLES", "MASK_RULE"]

TRAINED_ROLES = ("assistant",)
MASK_RULE = 2  # bumped when what a record's mask trains changes: tokenize units keyed on it are redone
_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use characters around {% generation %} output
_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


class ChatError(ValueError):
    """One record cannot be encoded: the template refuses it or cannot mark its assistant turns,
    or its content would forge a special token. Counted as a bad document (``bad_chat``)."""


class ChatTemplateError(ValueError):
    """The chat template itself is missing, not valid Jinja, or fails on a plain two-turn
    conversation: every record would fail, so the job stops before tokenizing."""


def record_problem(obj: dict) -> str | None:
    """What is wrong with a fine-tuning record (a JSON object), in words; None when it is usable:
    ``messages``, a non-empty list of ``{role, content}`` with string values and at least one
    assistant turn; or ``prompt`` and ``completion``, both strings (the completion non-empty)."""
    if "messages" in obj:
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages:
            return "'messages' must be a non-empty list of {role, content} objects"
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                return f"messages[{i}] is not a {{\"role\": str, \"content\": str}} object"
        if not any(m["role"] in TRAINED_ROLES for m in messages):
            return "no assistant message: nothing to train"
        return None
    if "prompt" in obj or "completion" in obj:
        if not isinstance(obj.get("prompt"), str) or not isinstance(obj.get("completion"), str):
            return "'prompt' and 'completion' must both be strings"
        if not obj["completion"]:
            return "an empty 'completion': nothing to train"
        return None
    return f"neither 'messages' nor 'prompt'/'completion' (keys: {sorted(obj)[:8]})"


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template and what it renders with: ``source`` (where it came from, for messages),
    ``template`` (Jinja), ``bos_token`` / ``eos_token`` (the strings the template may use, or "")."""

    source: str
    template: str
    bos_token: str = ""
    eos_token: str = ""

    @property
    def sha256(self) -> str:
        return hashlib.sha256(json.dumps([self.template, self.bos_token, self.eos_token]).encode()).hexdigest()

    @property
    def marks_generation(self) -> bool:
        """Whether the template marks assistant content with ``{% generation %}``."""
        return bool(_GENERATION_TAG.search(self.template))

    def render(self, messages: list[dict], add_generation_prompt: bool = False, mark_generation: bool = False) -> str:
        """The template's text for ``messages``; ``mark_generation``: ``{% generation %}`` output
        between two private-use characters (:meth:`generation_spans`).

        Raises:
            ChatTemplateError: the template is not valid Jinja.
            ChatError: the template refuses the conversation (``raise_exception``) or fails on it.
        """
        compiled = _compiled(self.template, self.source)
        try:
            return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   bos_token=self.bos_token, eos_token=self.eos_token,
                                   _mark_generation=mark_generation)
        except Exception as e:  # the template's own raise_exception, or a bug of the template's
            raise ChatError(f"the chat template of {self.source} failed on this conversation: "
                            f"{type(e).__name__}: {e}") from None

    def generation_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """``(text, [(start, end)])``: the rendered conversation and the character spans of its
        ``{% generation %}`` blocks."""
        pieces = re.split(f"([{_OPEN}{_CLOSE}])", self.render(messages, mark_generation=True))
        text, spans, at, start = [], [], 0, None
        for piece in pieces:
            if piece == _OPEN:
                start = at
            elif piece == _CLOSE:
                spans.append((start, at))
            else:
                text.append(piece)
                at += len(piece)
        return "".join(text), spans


_TEMPLATES: dict[str, object] = {}


def _compiled(template: str, source: str):
    """The template compiled once per process in a sandbox, with transformers' settings and
    filters (``tojson`` as transformers defines it) and the ``{% generation %}`` block."""
    if template not in _TEMPLATES:
        from jinja2 import TemplateError, nodes
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class Generation(Extension):
            """``{% generation %}...{% endgeneration %}``: its output as is, or between the
            private-use marks when the template is rendered with ``_mark_generation``."""

            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                call = self.call_method("_mark", [nodes.Name("_mark_generation", "load")])
                return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

            def _mark(self, mark, caller):
                out = caller()
                return f"{_OPEN}{out}{_CLOSE}" if mark else out

        def raise_exception(message: str):
            raise TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, Generation])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        try:
            _TEMPLATES[template] = env.from_string(template)
        except TemplateError as e:
            raise ChatTemplateError(f"the chat template of {source} is not valid Jinja: {e}") from None
    return _TEMPLATES[template]


def load_chat_template(spec: str | os.PathLike, template_file: str | os.PathLike | None = None) -> ChatTemplate:
    """The chat template of the tokenizer at ``spec`` (a ``tokenizer.json`` or its directory):
    ``template_file`` when given (a ``.jinja`` file), else ``chat_template.jinja`` beside the
    tokenizer, else ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of
    ``{name, template}`` of which ``default`` is taken). ``bos_token`` / ``eos_token`` come from
    ``tokenizer_config.json`` (or ``special_tokens_map.json``).

    ``spec`` ``"gpt2"`` has no files: only ``template_file`` can give it a template.

    Raises:
        ChatTemplateError: no template anywhere (the message names where it looked and the fix),
            or a file that cannot be read.
    """
    path = Path(spec)
    directory = None if str(spec) == "gpt2" else path if path.is_dir() else path.parent
    config: dict = {}
    try:
        tokens = special_token_names(directory) if directory is not None else {}
        if directory is not None and (directory / "tokenizer_config.json").is_file():
            config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (TokenizerError, OSError, ValueError) as e:
        raise ChatTemplateError(f"{spec}: its tokenizer config cannot be read ({e})") from None
    if template_file is not None:
        try:
            source, template = str(template_file), Path(template_file).read_text(encoding="utf-8")
        except OSError as e:
            raise ChatTemplateError(f"--chat-template {template_file}: cannot be read ({e})") from None
    elif directory is not None and (directory / "chat_template.jinja").is_file():
        source, template = str(directory / "chat_template.jinja"), (directory / "chat_template.jinja").read_text(
            encoding="utf-8")
    else:
        template, source = config.get("chat_template"), str(directory / "tokenizer_config.json" if directory else spec)
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if not isinstance(template, str) or not template.strip():
            where = (f"looked for chat_template.jinja and the chat_template of tokenizer_config.json in {directory}"
                     if directory is not None else "gpt2 has none")
            raise ChatTemplateError(f"{spec}: no chat template ({where}). Fix: pass the tokenizer directory of an "
                                    f"instruction-tuned model, or --chat-template FILE.jinja")
    return ChatTemplate(source, template, tokens.get("bos_token", ""), tokens.get("eos_token", ""))


def _overlapping(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """bool [tokens]: the tokens whose characters ``[start, end)`` overlap one of ``spans``."""
    if not offsets:
        return np.zeros(0, dtype=bool)
    off = np.asarray(offsets, dtype=np.int64)
    out = np.zeros(len(off), dtype=bool)
    for a, b in spans:
        out |= (off[:, 0] < b) & (off[:, 1] > a)
    return out


def _id_token(tokenizer, token_id: int | None) -> str:
    return tokenizer.hf.id_to_token(token_id) if token_id is not None else ""


class ChatEncoder:
    """Fine-tuning records → (token ids, loss mask) with a tokenizer's framing and chat template.

    Args:
        tokenizer: a :class:`~moetrain.data.tokenizer.TextTokenizer` (its ``hf`` tokenizer,
            ``bos_id``, ``eos_id``).
        template: the chat template for ``messages`` records (its missing ``bos_token`` /
            ``eos_token`` strings are the tokenizer's BOS / EOS); None: only prompt/completion
            records can be encoded, a ``messages`` record stops the job.

    Raises:
        ChatTemplateError: the template is not valid Jinja, or cannot encode a plain two-turn
            conversation (checked here, before any record).
    """

    def __init__(self, tokenizer, template: ChatTemplate | None):
        if template is not None:  # a template may write bos_token / eos_token: the tokenizer's own
            template = dataclasses.replace(
                template, bos_token=template.bos_token or _id_token(tokenizer, tokenizer.bos_id),
                eos_token=template.eos_token or _id_token(tokenizer, tokenizer.eos_id))
        self.tokenizer, self.template = tokenizer, template
        self._specials: tokenizers.Tokenizer | None = None
        # The strings of the tokenizer's special tokens: refused inside message contents.
        self.special_strings = sorted(t.content for t in tokenizer.hf.get_added_tokens_decoder().values() if t.special)
        if template is not None:
            probe = [{"role": "user", "content": "Hello?"}, {"role": "assistant", "content": "Hello."}]
            try:
                self.encode({"messages": probe})
            except ChatError as e:
                raise ChatTemplateError(f"{e} (on a plain user / assistant exchange). Fix: use a template that "
                                        f"renders such a conversation, or mark its assistant content with "
                                        f"{{% generation %}} ... {{% endgeneration %}}") from None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_specials": None}

    def _special_aware(self) -> tokenizers.Tokenizer:
        # A copy that recognises special-token strings (the template writes them as text); the
        # TextTokenizer itself encodes them as plain text inside documents.
        if self._specials is None:
            self._specials = tokenizers.Tokenizer.from_str(self.tokenizer.hf.to_str())
            self._specials.encode_special_tokens = False
        return self._specials

    def encode(self, record: dict) -> tuple[list[int], list[int]]:
        """(ids, mask) of one record (:func:`record_problem` must have accepted it).

        Raises:
            ChatTemplateError: a ``messages`` record and no template.
            ChatError: the template refuses the conversation or cannot locate its assistant turns
                (module docstring), or a message's content holds a special token's string.
        """
        if "messages" in record:
            return self._messages(record["messages"])
        tok, prompt = self.tokenizer, record["prompt"]
        text = prompt + record["completion"]
        enc = tok.hf.encode(text, add_special_tokens=False)  # special-token strings as plain text
        bos = [tok.bos_id] if tok.bos_id is not None else []
        trained = _overlapping(enc.offsets, [(len(prompt), len(text))])
        ids = bos + enc.ids + [tok.eos_id]
        mask = [0] * len(bos) + trained.astype(np.uint8).tolist() + [1]
        mask[0] = 0
        return ids, mask

    def _messages(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        if self.template is None:
            raise ChatTemplateError("a 'messages' record and no chat template (the tokenizer has none). Fix: pass "
                                    "--chat-template FILE.jinja")
        for k, m in enumerate(messages):
            forged = next((s for s in self.special_strings if s in m["content"]), None)
            if forged is not None:
                raise ChatError(f"messages[{k}] holds the special token {forged!r} in its content: rendered, it would "
                                f"be read as that token and forge a turn")
        if self.template.marks_generation:
            full, spans = self.template.generation_spans(messages)
        else:
            full, spans = self.template.render(messages), []
            for k, m in enumerate(messages):
                if m["role"] not in TRAINED_ROLES:
                    continue
                before = self.template.render(messages[:k], add_generation_prompt=True)
                upto = self.template.render(messages[:k + 1])
                if not (upto.startswith(before) and full.startswith(upto)):
                    raise ChatError(f"the chat template of {self.template.source} does not render this conversation "
                                    f"as the concatenation of its turns (message {k} changes what comes before it): "
                                    f"its assistant turns cannot be located; mark them with {{% generation %}}")
                spans.append((len(before), len(upto)))
        if not any(b > a for a, b in spans):
            raise ChatError(f"the chat template of {self.template.source} marks no assistant text in this conversation")
        enc = self._special_aware().encode(full, add_special_tokens=False)
        trained = _overlapping(enc.offsets, spans)
        if len(trained):
            trained[0] = False
        return enc.ids, trained.astype(np.uint8).tolist()

    def encode_batch(self, records: list[dict], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Records → ``(tokens [T] dtype, lengths int64 [records], mask uint8 [T])``, back to back."""
        ids, masks, lengths = [], [], []
        for rec in records:
            i, m = self.encode(rec)
            ids.extend(i)
            masks.extend(m)
            lengths.append(len(i))
        return (np.asarray(ids, dtype=dtype), np.asarray(lengths, dtype=np.int64), np.asarray(masks, dtype=np.uint8))
