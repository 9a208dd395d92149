"""Tabulate ``pytest --timings PATH`` (tests/timings.py): seconds by kind and by file, as Markdown.

    python -m pytest -q --timings runs/timings.jsonl      # the whole suite, as .ci/run runs it
    python tools/test_timings.py runs/timings.jsonl [--top 25] [--before OLD.jsonl]

The seconds are each test's setup + call + teardown as pytest measured them; under pytest-xdist
tests run side by side, so they add up to more than the wall time. ``--before`` puts an earlier
run's seconds beside each group (the before/after table of docs/development.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

KINDS = ("slurm", "multi-process", "hugging-face", "single-process")


def load(path: Path) -> list[dict]:
    """The rows of a timings file; each has ``test``, ``file``, ``kind``, ``setup``, ``call``,
    ``teardown`` (seconds) and ``outcome``.

    Raises:
        SystemExit: the file is missing or a line is not a JSON object.
    """
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise SystemExit(f"test_timings: cannot read {path}: {e}") from e
    rows = []
    for n, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise SystemExit(f"test_timings: {path}:{n} is not JSON: {e}") from e
        row["seconds"] = row["setup"] + row["call"] + row["teardown"]
        rows.append(row)
    return rows


def group(rows: list[dict], key: str) -> dict[str, tuple[int, float]]:
    out: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for r in rows:
        out[r.get(key, "?")][0] += 1
        out[r.get(key, "?")][1] += r["seconds"]
    return {k: (n, s) for k, (n, s) in out.items()}


def table(rows: list[dict], before: list[dict] | None, top: int) -> str:
    old_kind = group(before, "kind") if before else {}
    old_file = group(before, "file") if before else {}
    lines = []

    def header(first: str) -> None:
        extra = " | before (tests) | before (s)" if before else ""
        lines.append(f"| {first} | tests | seconds{extra} |")
        lines.append("|---|---:|---:|" + ("---:|---:|" if before else ""))

    def line(name: str, n: int, s: float, old: dict) -> None:
        extra = ""
        if before:
            on, os_ = old.get(name, (0, 0.0))
            extra = f" | {on} | {os_:.0f}"
        lines.append(f"| {name} | {n} | {s:.0f}{extra} |")

    kinds = group(rows, "kind")
    header("kind")
    for k in sorted(set(kinds) | set(old_kind), key=lambda k: KINDS.index(k) if k in KINDS else len(KINDS)):
        n, s = kinds.get(k, (0, 0.0))
        line(k, n, s, old_kind)
    line("**all**", len(rows), sum(r["seconds"] for r in rows), {"**all**": (len(before), sum(r["seconds"] for r in before))} if before else {})
    outcomes = defaultdict(int)
    for r in rows:
        outcomes[r["outcome"]] += 1
    lines.append("")
    lines.append("Outcomes: " + ", ".join(f"{n} {o}" for o, n in sorted(outcomes.items())) + ".")
    lines.append("")
    files = group(rows, "file")
    kind_of_file = {}
    for r in rows:
        kind_of_file.setdefault(r["file"], set()).add(r.get("kind", "?"))
    header(f"file (the {top} slowest)")
    for f, (n, s) in sorted(files.items(), key=lambda x: -x[1][1])[:top]:
        line(f"{f} ({', '.join(sorted(kind_of_file[f]))})", n, s,
             {f"{f} ({', '.join(sorted(kind_of_file[f]))})": old_file.get(f, (0, 0.0))})
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("timings", type=Path, help="the file `pytest --timings PATH` wrote")
    ap.add_argument("--before", type=Path, help="an earlier run's file, shown beside each group")
    ap.add_argument("--top", type=int, default=25, help="how many files to list, slowest first (default 25)")
    args = ap.parse_args(argv)
    print(table(load(args.timings), load(args.before) if args.before else None, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
