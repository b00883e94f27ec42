"""``python -m replaybuf`` (or ``replaybuf``): checkpoints, starter buffers and benchmarks.

    replaybuf inspect DIR [--json]   what the checkpoint holds: kind, format version, tensors
                                     with shapes and dtypes, size and counters, episodes, bytes
    replaybuf verify DIR             every size and checksum, then exactly the checks a load
                                     makes (manifest checksum, meta fields, tensors, links);
                                     exit 0 and "OK", or exit 1 and "FAILED" with every problem
    replaybuf clean [DIR]            remove the scratch folders of ended processes in DIR
                                     (default: the temp folder); print each and its bytes
    replaybuf populate --env ID --steps N --out DIR [--policy random] [--num-envs K]
                       [--seed S] [--max-steps M] [--max-episodes E]
                       [--max-episode-steps T] [--force]
                                     collect N steps from a gymnasium env into an episode
                                     buffer (progress bar on a terminal) and save it as a
                                     checkpoint at DIR, atomically (needs gymnasium)
    replaybuf --version              the installed version
    replaybuf bench                  run benchmarks/suite.py --quick of a source checkout and
                                     print its table; exit with the suite's status

Exit status: 0 success, 1 a damaged or missing checkpoint (the message says which file) or a
failed run, 2 a usage error (a bad flag value names the flag), 130 interrupted. User errors
print one message, never a traceback; a failed ``populate`` writes nothing at DIR.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import replaybuf
from replaybuf.args import INT64_MAX, SEED_MAX
from replaybuf.errors import CheckpointError, ReplayBufError
from replaybuf.persist.format import describe_checkpoint, read_checkpoint, verify_checkpoint
from replaybuf.persist.verify import examine_checkpoint

PROG = "replaybuf"


class UsageError(Exception):
    """A flag whose value cannot work (the message names the flag); exit status 2."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except UsageError as exc:
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (ReplayBufError, OSError, ValueError) as exc:
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return 130


def version() -> str:
    """The installed distribution's version, else the package's ``__version__`` (a source
    tree that is not installed)."""
    try:
        return importlib.metadata.version("replaybuf")
    except importlib.metadata.PackageNotFoundError:
        return replaybuf.__version__


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Inspect and verify checkpoints, populate starter buffers, bench."
    )
    parser.add_argument(
        "--version", action="version", version=f"{PROG} {version()}", help="print the version"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    inspect = commands.add_parser("inspect", help="print what a checkpoint holds")
    inspect.add_argument("directory", metavar="DIR", help="a checkpoint directory")
    inspect.add_argument("--json", action="store_true", help="print it as JSON")
    inspect.set_defaults(run=_inspect)
    verify = commands.add_parser(
        "verify", help="check every size and checksum, and everything a load checks"
    )
    verify.add_argument("directory", metavar="DIR", help="a checkpoint directory")
    verify.set_defaults(run=_verify)
    clean = commands.add_parser("clean", help="remove scratch folders of ended processes")
    clean.add_argument("directory", metavar="DIR", nargs="?", help="where (the temp folder)")
    clean.set_defaults(run=_clean)
    _populate_parser(commands)
    bench = commands.add_parser("bench", help="run the benchmark suite's quick mode")
    bench.set_defaults(run=_bench)
    return parser


def _populate_parser(commands: Any) -> None:
    populate = commands.add_parser(
        "populate", help="fill an episode buffer from a gymnasium env and save it at DIR"
    )
    populate.add_argument("--env", required=True, metavar="ID", help="gymnasium env id")
    populate.add_argument("--policy", choices=["random"], default="random", help="the actor")
    populate.add_argument(
        "--steps", type=_count(1), required=True, metavar="N", help="transitions to store"
    )
    populate.add_argument("--out", required=True, metavar="DIR", help="checkpoint to write")
    populate.add_argument(
        "--num-envs", type=_count(1), default=1, metavar="K", help="sub-environments (1)"
    )
    populate.add_argument(
        "--seed", type=_count(0, SEED_MAX), default=None, metavar="S", help="reset seed"
    )
    populate.add_argument(
        "--max-steps", type=_count(1), default=None, metavar="M", help="buffer capacity (N)"
    )
    populate.add_argument(
        "--max-episodes", type=_count(1), default=None, metavar="E", help="buffer episodes"
    )
    populate.add_argument(
        "--max-episode-steps", type=_count(1), default=None, metavar="T", help="time limit"
    )
    populate.add_argument(
        "--force", action="store_true", help="replace a replaybuf checkpoint already at DIR"
    )
    populate.set_defaults(run=_populate)


def _count(low: int, high: int = INT64_MAX) -> Any:
    """An argparse type: an int in [``low``, ``high``] (int64's largest by default)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        if value > high:
            raise argparse.ArgumentTypeError(f"expected an integer <= {high}, got {value}")
        return value

    return parse


def _inspect(args: argparse.Namespace) -> int:
    summary = describe_checkpoint(args.directory)
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print("\n".join(describe_lines(summary)))
    return 0


def _verify(args: argparse.Namespace) -> int:
    """Every file's size and sha256, then exactly the checks a load of the checkpoint's kind
    makes (one code path: the loader's ``examine``). Never a traceback: any failure, expected
    or not, is one message and exit status 1."""
    try:
        problems = verify_checkpoint(args.directory)
        if not problems:
            problems = _buffer_problems(args.directory)
        if not problems:
            summary = describe_checkpoint(args.directory)
    except Exception as exc:  # a bug the checks missed: still a message, not a traceback
        problems = [f"unexpected {type(exc).__name__}: {exc}"]
    if problems:
        print(f"FAILED: {args.directory}: {len(problems)} problem(s)")
        for problem in problems:
            print(f"  - {problem}")
        return 1
    print(
        f"OK: {summary['directory']} ({summary['kind']}, {len(summary['tensors'])} tensors,"
        f" {summary['bytes']:,} bytes, every sha256 checked)"
    )
    return 0


def _clean(args: argparse.Namespace) -> int:
    """Sweep DIR's ``replaybuf-*`` folders whose owner process has ended, and say what went."""
    from replaybuf.storage.sweep import sweep

    directory = args.directory or tempfile.gettempdir()
    if not os.path.isdir(directory):
        raise UsageError(f"DIR: {directory} is not a folder")
    swept = sweep(directory)
    for folder, size in swept.removed:
        print(f"removed {folder} ({size:,} bytes)")
    total = sum(size for _, size in swept.removed)
    print(f"{len(swept.removed)} folder(s) removed, {total:,} bytes freed in {directory}")
    if swept.alive:
        print(f"kept {len(swept.alive)} folder(s) whose process runs or cannot be checked here")
    if swept.unstamped:
        print(f"left {len(swept.unstamped)} replaybuf-* folder(s) without an owner stamp")
    return 0


def _buffer_problems(directory: str) -> list[str]:
    """What ``load_checkpoint`` of the checkpoint's buffer kind would refuse in it."""
    try:
        examine_checkpoint(directory)
    except (ReplayBufError, ValueError) as exc:
        return [str(exc)]
    return []


def _populate(args: argparse.Namespace) -> int:
    """Collect ``--steps`` transitions into a new episode buffer and save it at ``--out``."""
    from replaybuf.buffers import SyncEpisodeReplayBuffer
    from replaybuf.collecting import collect

    out = _writable_out(args.out, args.force)
    envs = _make_envs(args)
    capacity = args.max_steps or args.steps
    try:
        if args.seed is not None:
            envs.action_space.seed(args.seed)
        with SyncEpisodeReplayBuffer(capacity, args.max_episodes, seed=args.seed) as buf:
            stats = collect(envs, _random_policy(envs), buf, args.steps, seed=args.seed)
            held = buf.stats()
            buf.save_checkpoint(out)
    except ReplayBufError as exc:  # one the flags caused: named by the flag, exit status 2
        flag = _POPULATE_FLAGS.get(exc.argument or "")
        if flag is None:
            raise
        hint = _POPULATE_HINTS.get(flag, "")
        raise UsageError(f"{flag}: {exc}{hint}") from None
    finally:
        envs.close()
    returns = stats["returns"]
    mean = f"{sum(returns) / len(returns):.4g}" if returns else "n/a"
    print(
        f"collected {stats['steps']:,} steps: {stats['episodes']:,} finished episodes (mean "
        f"return {mean}), {stats['cut']:,} cut at the end"
    )
    print(f"saved {held['valid_steps']:,} steps in {held['episodes']:,} episodes to {out}")
    if held["evicted_episodes"]:
        print(
            f"note: {held['evicted_episodes']:,} episodes were evicted to fit --max-steps "
            "(or the final-observation rows: give --max-episodes for short episodes)"
        )
    print(f"inspect it: {PROG} inspect {out}")
    return 0


# The buffer arguments populate passes from its flags (the capacity: --max-steps, else --steps).
_POPULATE_FLAGS = {"max_steps": "--max-steps", "max_episodes": "--max-episodes", "seed": "--seed"}
_POPULATE_HINTS = {
    "--max-steps": " (an episode needs more steps than the buffer holds: give a larger "
    "--max-steps, or cut episodes with --max-episode-steps)",
}


def _random_policy(envs: Any) -> Any:
    """``--policy random``: a uniform draw from the vector env's batched action space."""

    def policy(observations: Any) -> Any:
        return envs.action_space.sample()

    return policy


def _writable_out(text: str, force: bool) -> Path:
    """``--out`` as an absolute path, refused (nothing written) unless a save there can work."""
    out = Path(os.path.abspath(text))
    if out.exists() or out.is_symlink():
        if out.is_symlink() or not out.is_dir():
            raise UsageError(f"--out: {out} exists and is not a folder")
        if any(out.iterdir()):
            if not _is_checkpoint(out):
                raise UsageError(
                    f"--out: {out} is a non-empty folder that is not a replaybuf checkpoint"
                )
            if not force:
                raise UsageError(f"--out: {out} holds a checkpoint; pass --force to replace it")
    ancestor = out.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UsageError(f"--out: {ancestor} is not a folder, so {out} cannot be created")
    try:
        with tempfile.TemporaryFile(dir=ancestor):
            pass  # a file can be created (and is gone): the save can write here
    except OSError as exc:
        raise UsageError(f"--out: cannot write in {ancestor}: {exc.strerror or exc}") from None
    return out


def _is_checkpoint(directory: Path) -> bool:
    try:
        with read_checkpoint(directory, verify=False):
            return True
    except CheckpointError:
        return False


def _make_envs(args: argparse.Namespace) -> Any:
    """The gymnasium vector env ``--env`` names, or a UsageError naming the flag."""
    try:
        import gymnasium
    except ImportError:
        raise UsageError(
            "populate needs gymnasium (and tqdm for the progress bar): "
            "pip install 'replaybuf[examples]'"
        ) from None
    kwargs = {} if args.max_episode_steps is None else {"max_episode_steps": args.max_episode_steps}
    try:
        return gymnasium.make_vec(
            args.env, num_envs=args.num_envs, vectorization_mode="sync", **kwargs
        )
    except gymnasium.error.Error as exc:
        raise UsageError(f"--env: cannot make {args.env!r}: {exc}") from None


def suite_path() -> Path:
    """Where a source checkout keeps the benchmark suite (absent from an installed wheel)."""
    return Path(replaybuf.__file__).resolve().parents[1] / "benchmarks" / "suite.py"


def _bench(args: argparse.Namespace) -> int:
    """Run the suite's quick mode in a child Python; its table goes straight to stdout."""
    suite = suite_path()
    if not suite.is_file():
        raise UsageError(
            f"no benchmark suite at {suite}: benchmarks/ ships with replaybuf's source "
            "checkout, not with the installed package; run this from a clone of the repository"
        )
    command = [sys.executable, str(suite), "--quick"]
    return subprocess.run(command, cwd=suite.parents[1], check=False).returncode


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
