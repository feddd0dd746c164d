"""A failed attempt in words. The ranks' side: an error a rank reports as one line rather than a traceback
(:func:`report`, into ``DEEPSHARD_ERROR_DIR``), printed once per message by the launcher. The launcher's side, for
one machine: ranks that left early, the ranks' one-line errors, which rank failed first with its traceback and last
output, what happened to the others, then their output since, its lost-connection noise folded."""
from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from collections.abc import Collection, Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the launcher starts without torch: rank_streams is torch's LogsSpecs
    from deepshard.launcher.rank_streams import RankStream, RankStreams

ERROR_DIR_ENV = "DEEPSHARD_ERROR_DIR"
VERBOSE_ENV = "DEEPSHARD_VERBOSE"


def report(message: str, environ: Mapping[str, str] = os.environ) -> None:
    """A rank's side: tell the launcher (a file in ``DEEPSHARD_ERROR_DIR``) or, run alone, the terminal."""
    where = environ.get(ERROR_DIR_ENV)
    if where and os.path.isdir(where):
        Path(where, f"rank{environ.get('RANK', '0')}.txt").write_text(message, encoding="utf-8")
        return
    print(f"deepshard: error: {message}\n(set {VERBOSE_ENV}=1 for the traceback)", file=sys.stderr, flush=True)


@contextmanager
def error_dir(environ: MutableMapping[str, str]) -> Iterator[str]:
    """A fresh directory for the ranks' messages, named in ``environ`` (which the ranks inherit) while
    the launch runs; removed afterwards."""
    saved = environ.get(ERROR_DIR_ENV)
    with tempfile.TemporaryDirectory(prefix="deepshard-errors-", ignore_cleanup_errors=True) as path:
        environ[ERROR_DIR_ENV] = path
        try:
            yield path
        finally:
            if saved is None:
                environ.pop(ERROR_DIR_ENV, None)
            else:
                environ[ERROR_DIR_ENV] = saved


def collect(directory: str | None) -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    if not directory or not os.path.isdir(directory):
        return found
    for path in sorted(Path(directory).glob("rank*.txt")):  # written by report() below, named by torch's RANK
        found.setdefault(path.read_text(encoding="utf-8").strip(), []).append(int(path.stem[len("rank"):]))
    return {message: sorted(ranks) for message, ranks in found.items()}


def format_errors(errors: dict[str, list[int]]) -> str:
    lines = []
    for message, ranks in errors.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        lines.append(f"deepshard: error ({who}): {message}")
    lines.append(f"(the traceback: deepshard --verbose ..., or {VERBOSE_ENV}=1)")
    return "\n".join(lines)


_NOISE = re.compile(r"GLHF|Connection closed by peer|Connection reset by peer|Broken pipe|^frame #\d+|"
                    r"^Exception raised from|<omitting python frames>|\[c10d\]|ProcessGroupGloo|TCPStore|"
                    r"terminate called after|gloo::")


_OWN = re.compile(r"CollectiveTimeout|deepshard|^(\[rank\d+\]: )?[\w.]+(Error|Exception|Timeout): ")


def fold_noise(text: str) -> tuple[str, int]:
    """``text`` without the lines of a backend's lost-connection fallout (gloo's "Connection closed by
    peer" warnings, c10d's C++ frames), and how many lines were folded. Python's exception lines and the
    library's own diagnoses stay."""
    kept = [line for line in text.splitlines() if not _NOISE.search(line) or _OWN.search(line)]
    return "\n".join(kept).strip("\n"), len(text.splitlines()) - len(kept)


def early_exits(streams: RankStreams, failed: RankStream) -> str | None:
    """A line naming the ranks that exited 0 before ``failed`` failed (they left the others waiting in their
    next collective), or None."""
    early = [s for s in streams.streams.values() if s is not failed and s.returncode == 0
             and s.ended_at is not None and failed.ended_at is not None and s.ended_at <= failed.ended_at]
    if not early:
        return None
    names = ", ".join(s.name for s in early)
    lead = max(failed.ended_at - s.ended_at for s in early)  # type: ignore[operator]
    verb = "was" if len(early) == 1 else "were"
    return (f"deepshard: {names} exited 0 while the others were still running ({lead:.1f}s before "
            f"{failed.name} failed): {names} {verb} done while the others still expected it in their "
            "collectives. Every rank must run the same number of steps (and call save_checkpoint) alike; "
            "look for a rank-dependent loop bound, break or early return")


def others_outcome(streams: RankStreams, failed: RankStream, stopped: Collection[int]) -> str:
    """What became of the other ranks: ``; stopped the other 2 ranks`` (running when ``failed`` failed;
    ``stopped`` holds their local ranks), ``; the other 1 rank failed too`` (on its own), both, or nothing."""
    others = [s for s in streams.streams.values() if s is not failed]
    groups = (([s for s in others if s.local_rank not in stopped and s.returncode not in (None, 0)], "{} failed too"),
              ([s for s in others if s.local_rank in stopped], "stopped {}"))
    parts = []
    for group, text in groups:
        if group:
            noun = "rank" if len(group) == 1 else "ranks"
            whom = f"the other {len(group)} {noun}" if len(group) == len(others) else f"{len(group)} other {noun}"
            parts.append(text.format(whom))
    return "".join(f"; {part}" for part in parts)


def failure_text(headline: str, name: str, rank: int | None, tail: str, trace: str | None = None,
                 log_path: str | None = None, full: bool = True) -> str:
    """A failed rank in a report (one machine's and the job board's alike): ``headline``, then with ``full`` its
    traceback (from its error file) and the end of its output (``name``: how the rank is called; the output is left
    out when it ends with that traceback), then where its full log is."""
    lines = [headline]
    if full and trace:
        lines += [f"----- traceback of rank {rank} (its error file) -----", trace.rstrip()]
    if full and not (trace and trace.strip().splitlines()[-1] in tail):
        lines += [f"----- last output of {name} -----", tail] if tail else [f"({name} printed nothing)"]
    if full and (tail or trace):
        lines.append(f"----- end of rank {rank} output -----")
    return "\n".join(lines + ([f"full log of rank {rank}: {log_path}"] if log_path else []))


def report_local(failed: RankStream, streams: RankStreams, stopped: Collection[int]) -> None:
    """One node's report: early exits, the ranks' one-line errors, then who failed and its last output (unless
    its one-line error said it all)."""
    early = early_exits(streams, failed)
    if early is not None:
        print(early, file=sys.stderr, flush=True)
    errors = collect(os.environ.get(ERROR_DIR_ENV))
    if errors:
        print(format_errors(errors), file=sys.stderr, flush=True)
    headline = f"deepshard: {failed.who} exited with {failed.exit}{others_outcome(streams, failed, stopped)}"
    print(failure_text(headline, failed.name, failed.rank, failed.text(), error_file_traceback(failed.error_file),
                       failed.log_path, full=not any(failed.rank in ranks for ranks in errors.values())),
          file=sys.stderr, flush=True)


def error_file_traceback(path: str) -> str | None:
    """The traceback a rank wrote to torch's elastic error file (``@record``, or deepshard's rank entry)."""
    try:
        with open(path, encoding="utf-8") as handle:
            message = json.load(handle).get("message", {})
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(message, dict):
        return None
    trace = message.get("extraInfo", {}).get("py_callstack")
    return trace if isinstance(trace, str) and trace.strip() else None


def report_held(streams: RankStreams, failed: RankStream | None) -> None:
    """The other ranks' output since the failure, after the report, their connection noise folded."""
    for stream in streams.streams.values():
        if stream is failed or not stream.held:
            continue
        text, folded = fold_noise(bytes(stream.held).decode("utf-8", errors="replace"))
        stream.held.clear()
        if text:
            print(f"----- {stream.name}'s output after the failure -----\n{text}", file=sys.stderr, flush=True)
        if folded:
            where = f" (in {stream.log_path})" if stream.log_path else ""
            print(f"deepshard: folded {folded} lines of {stream.name}'s lost-connection fallout{where}",
                  file=sys.stderr, flush=True)
