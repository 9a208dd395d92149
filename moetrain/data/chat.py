"""Fine-tuning data: conversations and prompt/completion pairs → token ids and a loss mask.

Two record shapes (one JSON object per line, or one parquet row):

* ``{"messages": [{"role": "system" | "user" | "assistant" | ..., "content": "..."}, ...]}`` —
  rendered with the tokenizer's chat template (the Jinja template of ``tokenizer_config.json``'s
  ``chat_template`` or ``chat_template.jinja`` beside it, as transformers reads them; rendered with
  ``jinja2`` in a sandbox, with transformers' settings: ``trim_blocks``, ``lstrip_blocks``,
  ``raise_exception``, the ``tojson`` filter), tokenized with the special tokens of the template
  recognised. Trained: every assistant turn, as the template writes it — its content and the
  end-of-turn token after it (``<|eot_id|>``, ``</s>``), so that the model learns to stop; not
  the role headers that open a turn, nor any other role's turns.
* ``{"prompt": "...", "completion": "..."}`` — ``[BOS] + prompt + completion + EOS`` with the
  tokenizer's framing (:mod:`moetrain.data.tokenizer`); trained: the completion and the EOS.

**Where an assistant turn is.** For the ``k``-th message, an assistant's, the template renders the
messages before it with the generation prompt (the header that opens an assistant turn) and the
messages up to it; the turn is the text between the two. That holds for every template that
renders a conversation as the concatenation of its turns (Llama 3, Mistral, DeepSeek-V3, ChatML);
a template that rewrites earlier turns (one that drops the reasoning of earlier answers, say)
is caught — the shorter rendering is not a prefix of the longer — and the record is refused as a
bad document rather than masked wrongly. A token is trained when its first character lies in a
turn (the tokenizer's offsets).

The mask has one byte per token, 1 where the token is trained *as a target* (its prediction
from the token before it enters the loss); the first token of a record is never trained.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tokenizers

__all__ = ["ChatError", "ChatTemplate", "ChatEncoder", "record_problem", "load_chat_template", "TRAINED_ROLES"]

TRAINED_ROLES = ("assistant",)


class ChatError(ValueError):
    """A chat template cannot be found, read or rendered, or cannot mark the assistant's turns."""


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

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The template's text for ``messages``.

        Raises:
            ChatError: the template raises (``raise_exception``) or fails to render.
        """
        import jinja2  # a dependency of torch, always present

        try:
            return _compiled(self.template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                   bos_token=self.bos_token, eos_token=self.eos_token)
        except jinja2.TemplateError as e:
            raise ChatError(f"chat template of {self.source} failed to render: {e}") from None


_TEMPLATES: dict[str, object] = {}


def _compiled(template: str):
    """The template compiled once per process in a sandbox, with transformers' settings."""
    if template not in _TEMPLATES:
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent,
                                                                                      ensure_ascii=ensure_ascii)
        env.globals["raise_exception"] = raise_exception
        try:
            _TEMPLATES[template] = env.from_string(template)
        except TemplateError as e:
            raise ChatError(f"the chat template is not valid Jinja: {e}") from None
    return _TEMPLATES[template]


def _token_string(value) -> str:
    if isinstance(value, dict):
        return value.get("content") or ""
    return value or ""


def load_chat_template(spec: str | os.PathLike, template_file: str | os.PathLike | None = None) -> ChatTemplate:
    """The chat template of the tokenizer at ``spec`` (a ``tokenizer.json`` or its directory):
    ``template_file`` when given (a ``.jinja`` file), else ``chat_template.jinja`` beside the
    tokenizer, else ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of
    ``{name, template}`` of which ``default`` is taken). ``bos_token`` / ``eos_token`` come from
    ``tokenizer_config.json`` (or ``special_tokens_map.json``).

    Raises:
        ChatError: no template anywhere (the message names where it looked and the fix), or a
            file that cannot be read.
    """
    path = Path(spec)
    directory = path if path.is_dir() else path.parent
    tokens: dict[str, str] = {}
    config: dict = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the config wins, as in transformers
        f = directory / name
        if f.is_file():
            try:
                conf = json.loads(f.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise ChatError(f"{f}: cannot be read ({e})") from None
            if name == "tokenizer_config.json":
                config = conf
            for role in ("bos_token", "eos_token"):
                if _token_string(conf.get(role)):
                    tokens[role] = _token_string(conf.get(role))
    if template_file is not None:
        source, template = str(template_file), Path(template_file).read_text(encoding="utf-8")
    elif (directory / "chat_template.jinja").is_file():
        source, template = str(directory / "chat_template.jinja"), (directory / "chat_template.jinja").read_text(
            encoding="utf-8")
    else:
        template, source = config.get("chat_template"), str(directory / "tokenizer_config.json")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if not isinstance(template, str) or not template.strip():
            raise ChatError(f"{spec}: no chat template (looked for chat_template.jinja and the chat_template of "
                            f"tokenizer_config.json in {directory}). Fix: pass the tokenizer directory of an "
                            f"instruction-tuned model, or --chat-template FILE.jinja")
    return ChatTemplate(source, template, tokens.get("bos_token", ""), tokens.get("eos_token", ""))


def _id_token(tokenizer, token_id: int | None) -> str:
    return tokenizer.hf.id_to_token(token_id) if token_id is not None else ""


class ChatEncoder:
    """Fine-tuning records → (token ids, loss mask) with a tokenizer's framing and chat template.

    Args:
        tokenizer: a :class:`~moetrain.data.tokenizer.TextTokenizer` (its ``hf`` tokenizer,
            ``bos_id``, ``eos_id``).
        template: the chat template for ``messages`` records (its missing ``bos_token`` /
            ``eos_token`` strings are the tokenizer's BOS / EOS); None: only prompt/completion
            records can be encoded.
    """

    def __init__(self, tokenizer, template: ChatTemplate | None):
        if template is not None:  # a template may write bos_token / eos_token: the tokenizer's own
            template = dataclasses.replace(
                template, bos_token=template.bos_token or _id_token(tokenizer, tokenizer.bos_id),
                eos_token=template.eos_token or _id_token(tokenizer, tokenizer.eos_id))
        self.tokenizer, self.template = tokenizer, template
        self._specials: tokenizers.Tokenizer | None = None

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
            ChatError: a ``messages`` record without a template, a template that fails, or one
                whose turns cannot be located (module docstring).
        """
        if "messages" in record:
            return self._messages(record["messages"])
        tok = self.tokenizer
        prompt, completion = tok.encode(record["prompt"]), tok.encode(record["completion"])
        bos = [tok.bos_id] if tok.bos_id is not None else []
        ids = bos + prompt + completion + [tok.eos_id]
        mask = [0] * (len(bos) + len(prompt)) + [1] * (len(completion) + 1)
        mask[0] = 0
        return ids, mask

    def _messages(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        if self.template is None:
            raise ChatError("a 'messages' record needs a chat template (the tokenizer has none: pass "
                            "--chat-template FILE.jinja)")
        full = self.template.render(messages)
        spans = []
        for k, m in enumerate(messages):
            if m["role"] not in TRAINED_ROLES:
                continue
            before = self.template.render(messages[:k], add_generation_prompt=True)
            upto = self.template.render(messages[:k + 1])
            if not (upto.startswith(before) and full.startswith(upto)):
                raise ChatError(f"the chat template of {self.template.source} does not render this conversation as "
                                f"the concatenation of its turns (message {k} changes what comes before it): its "
                                f"assistant turns cannot be located")
            spans.append((len(before), len(upto)))
        enc = self._special_aware().encode(full, add_special_tokens=False)
        starts = np.array([a for a, _ in enc.offsets], dtype=np.int64)
        trained = np.zeros(len(enc.ids), dtype=bool)
        for a, b in spans:
            trained |= (starts >= a) & (starts < b)
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
