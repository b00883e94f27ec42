"""``python -m replaybuf`` (or ``replaybuf``): look into checkpoints without loading a buffer.

    replaybuf inspect DIR [--json]   what the checkpoint holds: kind, format version, tensors
                                     with shapes and dtypes, size and counters, episodes, bytes
    replaybuf verify DIR             every size and checksum, and the buffer's own meta checks;
                                     exit 0 and "OK", or exit 1 and "FAILED" with every problem

Exit status: 0 success, 1 a damaged or missing checkpoint (the message says which file), 2 a
usage error. User errors print one message, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from replaybuf import buffer_checkpoint, episode_checkpoint
from replaybuf.checkpoint import describe_checkpoint, read_checkpoint, verify_checkpoint
from replaybuf.errors import ReplayBufError

PROG = "replaybuf"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except (ReplayBufError, OSError, ValueError) as exc:
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        return 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Inspect and verify checkpoints.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    inspect = commands.add_parser("inspect", help="print what a checkpoint holds")
    inspect.add_argument("directory", metavar="DIR", help="a checkpoint directory")
    inspect.add_argument("--json", action="store_true", help="print it as JSON")
    inspect.set_defaults(run=_inspect)
    verify = commands.add_parser("verify", help="check every size and checksum")
    verify.add_argument("directory", metavar="DIR", help="a checkpoint directory")
    verify.set_defaults(run=_verify)
    return parser


def _inspect(args: argparse.Namespace) -> int:
    summary = describe_checkpoint(args.directory)
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print("\n".join(describe_lines(summary)))
    return 0


def _verify(args: argparse.Namespace) -> int:
    problems = verify_checkpoint(args.directory)
    if not problems:
        problems = _buffer_problems(args.directory)
    if problems:
        print(f"FAILED: {args.directory}: {len(problems)} problem(s)")
        for problem in problems:
            print(f"  - {problem}")
        return 1
    summary = describe_checkpoint(args.directory)
    print(
        f"OK: {summary['directory']} ({summary['kind']}, {len(summary['tensors'])} tensors,"
        f" {summary['bytes']:,} bytes, every sha256 checked)"
    )
    return 0


def _buffer_problems(directory: str) -> list[str]:
    """What ``load_checkpoint`` of the checkpoint's buffer kind would refuse in it."""
    with read_checkpoint(directory, verify=False) as checkpoint:
        try:
            if checkpoint.kind == buffer_checkpoint.KIND:
                buffer_checkpoint.check(checkpoint)
            elif checkpoint.kind == episode_checkpoint.KIND:
                episode_checkpoint.check(checkpoint, f"checkpoint {directory!r}")
        except ReplayBufError as exc:
            return [str(exc)]
    return []


def describe_lines(summary: dict[str, Any]) -> list[str]:
    """``describe_checkpoint``'s summary as aligned text lines."""
    meta = summary["meta"]
    versions = summary.get("versions") or {}
    lines = [
        f"checkpoint      {summary['directory']}",
        f"kind            {summary['kind']}",
        f"format_version  {summary['format_version']}",
        f"created         {summary.get('created')}",
        "written by      " + ", ".join(f"{k} {v}" for k, v in sorted(versions.items())),
    ]
    if isinstance(meta.get("size"), int) and isinstance(meta.get("capacity"), int):
        lines.append(f"size            {meta['size']:,} of {meta['capacity']:,}")
    counters = {k: v for k, v in meta.items() if isinstance(v, (int, float, str, bool))}
    if counters:
        lines.append("meta            " + ", ".join(f"{k}={v}" for k, v in counters.items()))
    episodes = meta.get("episodes_by_status")
    if isinstance(episodes, dict):
        lines.append("episodes        " + ", ".join(f"{k} {v}" for k, v in episodes.items()))
    tensors = summary["tensors"]
    lines.append(f"tensors         {len(tensors)}, {summary['bytes']:,} bytes")
    width = max((len(name) for name in tensors), default=0)
    for name, info in tensors.items():
        shape = "[" + ", ".join(map(str, info["shape"])) + "]"
        lines.append(f"  {name:<{width}}  {info['dtype']:<8} {shape:<16} {info['bytes']:>14,} B")
    if summary["extra_files"]:
        lines.append("not listed      " + ", ".join(summary["extra_files"]) + " (never opened)")
    return lines
