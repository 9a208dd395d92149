#!/usr/bin/env python
"""Tokenize a corpus into checksummed train/val token shards with a manifest.json:
in parallel, on many nodes, resumably, skipping broken documents.

    python tools/tokenize_corpus.py --input data/demo/corpus --tokenizer data/demo/tokenizer.json \\
        --out data/demo/shards --val-fraction 0.01 [--workers 8] [--format megatron]
    python tools/tokenize_corpus.py --input /data/crawl --tokenizer gpt2 --out /data/shards \\
        --slurm --slurm-tasks 64 --slurm-cpus-per-task 32 --slurm-partition cpu [--detach]

Every document is [BOS] + text + EOS, as the tokenizer's family trains: EOS is the eos_token its
tokenizer_config.json / special_tokens_map.json names (else <|endoftext|>); a BOS comes first when
tokenizer_config.json says add_bos_token: true or, without that key, when the tokenizer's own
post-processor adds one (Llama 3). Validation split: with --val-fraction F, the documents at
0-based input position i with i % round(1/F) == 0; with --val-docs N, the first N documents.
The result is the same for any --workers, any number of SLURM tasks, and any interruption.

Run it again after a kill, a preemption or a failed input: the inputs with a completion record
in OUT/.tokenize/parts are skipped, the others are tokenized, then everything is merged. Broken
documents (not UTF-8, not JSON, no text key, lone surrogates) are skipped by default and counted
per reason in the manifest, with a sample of their file:line in OUT/skipped_documents.jsonl;
--on-bad-document fail stops at the first. A corrupt or truncated compressed file always fails,
naming the file; the other inputs still finish and keep their records.

Fine-tuning data (--chat --seq-len L): records of {"messages": [{"role", "content"}, ...]} rendered
with the tokenizer's chat template (or --chat-template FILE.jinja), or {"prompt", "completion"};
a loss mask beside the tokens trains only the assistant turns / the completion; whole records
are packed into sequences of L tokens (split only when longer than one), padding masked out.
Train it with data.loss_mask: true and data.document_mask: true, model.seq_len L.

Format: moetrain/data/format.py (--format megatron: Megatron-LM .bin/.idx, moetrain/data/megatron.py).
Pipeline: moetrain/data/pipeline.py. Check a result with tools/inspect_shards.py.
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

from moetrain.data.corpus import DEFAULT_UNIT_BYTES  # noqa: E402
from moetrain.data.format import DEFAULT_SHARD_TOKENS  # noqa: E402
from moetrain.data.pipeline import TokenizeJob, available_cpus  # noqa: E402
from moetrain.data.tokenizer import load_tokenizer  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, metavar="PATH",
                        help="corpus files or directories, read in this order")
    parser.add_argument("--tokenizer", required=True, metavar="SPEC",
                        help="'gpt2'; a tokenizer.json; a tokenizer directory as models ship it (tokenizer.json with "
                             "tokenizer_config.json and/or special_tokens_map.json, which name EOS and BOS); or a "
                             "model directory holding those files beside config.json")
    parser.add_argument("--out", required=True, metavar="DIR", help="shard directory (created)")
    parser.add_argument("--format", choices=("moetrain", "megatron"), default="moetrain",
                        help="moetrain shards, or one Megatron-LM .bin/.idx per split (default: %(default)s)")
    parser.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS,
                        help="tokens per shard, moetrain format (default: %(default)s)")
    val = parser.add_mutually_exclusive_group()
    val.add_argument("--val-fraction", type=float, help="hold out every round(1/F)-th document (default: 0.01)")
    val.add_argument("--val-docs", type=int, help="hold out the first N documents")
    chat = parser.add_argument_group("fine-tuning data")
    chat.add_argument("--chat", action="store_true",
                      help="records of messages (chat template) or prompt/completion, with a loss mask")
    chat.add_argument("--seq-len", type=int, default=None, metavar="L",
                      help="with --chat: pack whole records into sequences of L tokens (the model's seq_len)")
    chat.add_argument("--chat-template", default=None, metavar="FILE",
                      help="with --chat: a Jinja chat template to use instead of the tokenizer's")
    parser.add_argument("--text-key", default="text",
                        help="JSON key / parquet column of the text (default: %(default)s)")
    parser.add_argument("--on-bad-document", choices=("skip", "fail"), default="skip",
                        help="skip broken documents (counted per reason) or stop at the first (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=None,
                        help=f"worker processes (default: the CPUs available, here {available_cpus()}; "
                             f"under --slurm: per task, default its CPUs)")
    parser.add_argument("--unit-mb", type=float, default=DEFAULT_UNIT_BYTES / 2**20,
                        help="split .jsonl / .parquet files larger than this into units of work (default: %(default)s)")
    parser.add_argument("--batch-docs", type=int, default=256, help="documents per encode batch (default: %(default)s)")
    parser.add_argument("--keep-parts", action="store_true",
                        help="keep the per-input token parts after the merge (re-merge without re-tokenizing)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    slurm = parser.add_argument_group("many nodes (SLURM array job through submitit)")
    slurm.add_argument("--slurm", action="store_true", help="run the inputs as a SLURM array job, then merge")
    slurm.add_argument("--slurm-tasks", type=int, default=8, help="array tasks (nodes), each a group of inputs (default: %(default)s)")
    slurm.add_argument("--slurm-cpus-per-task", type=int, default=8, help="CPUs per task (default: %(default)s)")
    slurm.add_argument("--slurm-time-min", type=int, default=24 * 60,
                       help="time limit per task in minutes; a task past it is requeued and resumes (default: %(default)s)")
    slurm.add_argument("--slurm-partition", default=None, help="partition (default: the cluster's)")
    slurm.add_argument("--slurm-folder", default=None, help="logs and batch scripts (default: OUT/.tokenize/slurm)")
    slurm.add_argument("--detach", action="store_true",
                       help="submit the merge as a SLURM job after the array and return at once")
    return parser


def _print_result(manifest: dict, out: str, seconds: float) -> None:
    for name, split in manifest["splits"].items():
        trained = (f"  {split['trained_tokens']:>13,} trained ({split['trained_tokens'] / max(split['tokens'], 1):.0%})"
                   if "trained_tokens" in split else "")
        print(f"{name:5s}: {split['tokens']:>13,} tokens  {split['documents']:>9,} documents  "
              f"{len(split['shards'])} shards{trained}")
    if manifest.get("packed"):
        print(f"packed into sequences of {manifest['packed']['seq_len']} tokens; padding (masked out): "
              + ", ".join(f"{s} {n:,}" for s, n in manifest["packed"]["padding_tokens"].items()))
    skipped = manifest.get("skipped_documents") or {}
    if skipped.get("total"):
        reasons = ", ".join(f"{k} {v:,}" for k, v in skipped["by_reason"].items())
        print(f"skipped {skipped['total']:,} broken documents ({reasons}); where: {out}/{skipped['log']}")
    print(f"wrote {out}/manifest.json ({manifest['dtype']}, tokenizer {manifest['tokenizer']['name']}, "
          f"bos_id {manifest['bos_id']}, eos_id {manifest['eos_id']}) in "
          f"{seconds:.1f} s, {manifest['total_tokens'] / max(seconds, 1e-9):,.0f} tokens/s")


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    # What a user can get wrong, or a file can be: one line on stderr, no traceback.
    from moetrain.config import ConfigError

    try:
        tokenizer = load_tokenizer(args.tokenizer)
        encoder = _chat_encoder(args, tokenizer, parser)
        t0 = time.perf_counter()
        job = TokenizeJob(args.input, tokenizer, args.out, text_key=args.text_key,
                          on_bad_document=args.on_bad_document, shard_tokens=args.shard_tokens,
                          val_fraction=args.val_fraction, val_docs=args.val_docs, layout=args.format,
                          unit_bytes=max(1, int(args.unit_mb * 2**20)), batch_docs=args.batch_docs,
                          keep_parts=args.keep_parts, chat=encoder, pack_seq_len=args.seq_len)
        if job.is_complete():
            print(f"{args.out} is up to date ({len(job.units)} inputs, same settings): nothing to do")
            return
        done = len(job.units) - len(job.pending())
        if done:
            print(f"resuming: {done} of {len(job.units)} inputs already tokenized "
                  f"(records in {job.parts}); tokenizing the other {len(job.units) - done}")
        if args.slurm:
            manifest = _run_slurm(job, args)
            if manifest is None:
                return
        else:
            job.run(workers=args.workers, progress=not args.quiet)
            manifest = job.merge(progress=not args.quiet)
    except KeyboardInterrupt:
        parser.exit(130, f"{parser.prog}: interrupted; run the same command again to resume\n")
    except (OSError, ValueError, ImportError, RuntimeError, ConfigError) as e:
        parser.exit(1, f"{parser.prog}: error: {e}\n")
    _print_result(manifest, args.out, time.perf_counter() - t0)


def _chat_encoder(args: argparse.Namespace, tokenizer, parser: argparse.ArgumentParser):
    """The fine-tuning records' encoder with --chat (None without): the tokenizer's chat template,
    or --chat-template's; none at all is fine until a messages record needs one."""
    if not args.chat:
        if args.seq_len is not None or args.chat_template is not None:
            parser.error("--seq-len and --chat-template go with --chat")
        return None
    if args.seq_len is None or args.seq_len < 1:
        parser.error("--chat needs --seq-len L (the model.seq_len the records are packed for)")
    if args.format != "moetrain":
        parser.error("--chat writes a loss mask, which only the moetrain format holds: drop --format megatron")
    from moetrain.data.chat import ChatEncoder, ChatTemplateError, load_chat_template

    try:
        template = load_chat_template(args.tokenizer, args.chat_template)
    except ChatTemplateError as e:
        if args.chat_template is not None:
            raise
        print(f"note: {e}; prompt/completion records can be encoded, a messages record stops the job",
              file=sys.stderr)
        template = None
    return ChatEncoder(tokenizer, template)  # checks the template on a plain exchange before any record


def _run_slurm(job: TokenizeJob, args: argparse.Namespace) -> dict | None:
    from moetrain.data.slurm_array import submit_array, wait_and_merge
    from moetrain.launch.slurm import query_cluster

    query_cluster()  # a clear error now if SLURM does not answer
    folder = args.slurm_folder or str(Path(args.out) / ".tokenize" / "slurm")
    sub = submit_array(job, tasks=args.slurm_tasks, folder=folder, cpus_per_task=args.slurm_cpus_per_task,
                       time_min=args.slurm_time_min, partition=args.slurm_partition, workers=args.workers,
                       detach=args.detach)
    print(f"submitted SLURM array {sub.array_id}: {len(sub.tasks)} tasks over {len(job.units)} inputs; logs in {folder}")
    if args.detach:
        print(f"merge job {sub.merge.job_id} runs after the array; watch it with `squeue -j {sub.array_id},"
              f"{sub.merge.job_id}`; the manifest appears in {args.out} when it is done")
        return None
    return wait_and_merge(job, sub, progress=not args.quiet)


if __name__ == "__main__":
    main()
