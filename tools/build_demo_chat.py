#!/usr/bin/env python
"""Fine-tuning data for the demo, from the Shakespeare plays (nothing downloaded): conversations in
which the assistant answers each speech with the next one, as its speaker, and a chat template.

    python tools/build_demo_chat.py --out data/demo/chat

writes ``OUT/chats.jsonl.zst`` — ``{"messages": [system, user, assistant, ...]}`` records (the
system message names the play and the assistant's character; 1-3 exchanges each) and every fifth
record a ``{"prompt", "completion"}`` pair instead — and ``OUT/chat_template.jinja``, a template
for a base model's tokenizer that has no chat format of its own (the demo's BPE): ``User:`` /
``Assistant:`` turns, each assistant turn ending with the EOS token. Then:

    python tools/tokenize_corpus.py --input data/demo/chat/chats.jsonl.zst --tokenizer data/demo/tokenizer.json \\
        --chat --chat-template data/demo/chat/chat_template.jinja --seq-len 256 --out data/demo/chat/shards

The same plays, speeches and order every time: the output is byte-identical across runs.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

from moetrain.data.corpus import DemoCorpusError, demo_chat_records, write_jsonl_zst  # noqa: E402

# Turns are "User: ...\n" and "Assistant: ...<eos>\n"; the generation prompt is "Assistant:", so
# what the assistant is trained on is its reply and the EOS after it.
TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m['role'] == 'system' %}{{ m['content'] + '\\n\\n' }}"
    "{%- elif m['role'] == 'user' %}{{ 'User: ' + m['content'] + '\\n' }}"
    "{%- elif m['role'] == 'assistant' %}{{ 'Assistant: ' + m['content'] + eos_token + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ 'Assistant:' }}{%- endif %}"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory to write chats.jsonl.zst and chat_template.jinja to")
    parser.add_argument("--max-records", type=int, default=6000, help="records at most (default: %(default)s)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        records = demo_chat_records(args.max_records)
    except DemoCorpusError as e:
        sys.exit(f"build_demo_chat: {e}")
    size = write_jsonl_zst(out / "chats.jsonl.zst", records)
    (out / "chat_template.jinja").write_text(TEMPLATE + "\n", encoding="utf-8")
    chats = sum("messages" in r for r in records)
    print(f"wrote {out / 'chats.jsonl.zst'} ({len(records):,} records: {chats:,} conversations, "
          f"{len(records) - chats:,} prompt/completion pairs; {size / 2**20:.1f} MiB) and {out / 'chat_template.jinja'}")


if __name__ == "__main__":
    main()
