"""Files of a run directory that a crash or a full disk cannot leave half-written.

JSONL logs (`metrics.jsonl`, `samples.jsonl`) grow by whole records: each append is one write(2) of complete
lines to an O_APPEND descriptor, so a killed process leaves at most a torn last line, which `read_records`
ignores and `truncate_records` removes. Whole files (`config.yaml`, `placement.json`, a checkpoint's
`driver_state.json`) are replaced atomically: written to a temporary sibling, then renamed over the target.
A full disk or quota surfaces as one `DiskFullError` naming the file, and a directory that stopped being
writable during the run (its permissions changed, its file system remounted read-only) as one
`RunDirUnwritableError`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from rollflow.errors import DiskFullError, RunDirUnwritableError

DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
UNWRITABLE_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})
# How a refused write reads as text (a worker's PermissionError inside a remote traceback).
UNWRITABLE_MESSAGES = ("Permission denied", "Read-only file system", "Operation not permitted")
# How a full disk reads when it comes back as text: torch.save / save_pretrained in a worker (torch's zip
# writer, safetensors' Rust IoError) and the OS messages of ENOSPC and EDQUOT inside a remote traceback.
DISK_FULL_MESSAGES = ("No space left on device", "Disk quota exceeded", "PytorchStreamWriter failed writing file",
                      "StorageFull")
# How torch.save given a path reports a write that failed, whatever the reason (its C++ writer drops the errno);
# it counts as a full disk when the file system being written has less than NEARLY_FULL_BYTES free then.
TORCH_WRITE_FAILURES = ("unexpected pos",)
NEARLY_FULL_BYTES = 16 * 2**20


def write_failure_error(err: BaseException, path: Path | str) -> DiskFullError | RunDirUnwritableError | None:
    """The one-line error for `err` when it means the disk (or quota) is full (`DiskFullError`) or the path
    cannot be written (`RunDirUnwritableError`), else None.

    Recognizes an `OSError` with errno ENOSPC / EDQUOT anywhere in the exception's chain, and the messages
    torch and safetensors raise when a save runs out of space, including inside a Ray worker's traceback;
    torch's `unexpected pos` (a write of its zip writer that fell short) when `path`'s file system is full;
    then EACCES / EPERM / EROFS, or their messages in a worker's traceback.

    Args:
        err: the exception a write raised (a worker's, through `ray.get`, included).
        path: the file or directory being written, named in the message.
    """
    for cause in _chain(err):
        if isinstance(cause, OSError) and cause.errno in DISK_FULL_ERRNOS:
            return DiskFullError(f"no space left on device writing {path}")
        if any(message in str(cause) for message in DISK_FULL_MESSAGES):
            return DiskFullError(f"no space left on device writing {path}")
        if any(message in str(cause) for message in TORCH_WRITE_FAILURES) and _nearly_full(path):
            return DiskFullError(f"no space left on device writing {path}")
    for cause in _chain(err):
        if isinstance(cause, OSError) and cause.errno in UNWRITABLE_ERRNOS or \
                any(message in str(cause) for message in UNWRITABLE_MESSAGES):
            reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else "permission denied"
            return RunDirUnwritableError(f"cannot write {path}: {reason} (the directory stopped being writable "
                                         "while the run ran: its permissions or its mount changed)")
    return None


def _chain(err: BaseException) -> Iterator[BaseException]:
    """`err`, then its causes and contexts (a Ray error's `cause` too), each once."""
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        yield cause
        cause = cause.__cause__ or cause.__context__ or getattr(cause, "cause", None)


def _nearly_full(path: Path | str) -> bool:
    """Whether the file system holding `path` (or its nearest existing parent) has under NEARLY_FULL_BYTES free
    for this user."""
    where = Path(path)
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        return shutil.disk_usage(where).free < NEARLY_FULL_BYTES
    except OSError:
        return False


@contextlib.contextmanager
def write_failure_as_error(path: Path | str) -> Iterator[None]:
    """Turn an exception of the block that means a full disk or an unwritable path (see `write_failure_error`)
    into its one-line error naming `path`; any other exception passes unchanged.

    Wrap a worker call too: `with write_failure_as_error(checkpoint): actor.call("save", ...)`.
    """
    try:
        yield
    except Exception as err:
        failure = write_failure_error(err, path)
        if failure is None:
            raise
        raise failure from err


def append_records(path: Path, records: Iterable[dict[str, Any]]) -> None:
    """Append `records` to a JSONL file as one write(2) of complete lines on an O_APPEND descriptor.

    A crash leaves either all of them or none (at worst a torn last line, which readers drop). A disk that
    fills up mid-write has its partial bytes cut off again before `DiskFullError` is raised. No records:
    only creates the file.
    """
    data = "".join(json.dumps(record) + "\n" for record in records).encode()
    with write_failure_as_error(path):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            written = os.write(fd, data)
            if written < len(data):  # a regular file writes short only when the disk filled up mid-write
                os.ftruncate(fd, os.lseek(fd, 0, os.SEEK_END) - written)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        finally:
            os.close(fd)


def read_records(path: Path) -> list[dict[str, Any]]:
    """The complete records of a JSONL file: a torn last line (no newline, or not JSON) is left out."""
    return _parse_lines(path)[0] if path.is_file() else []


def truncate_records(path: Path, last_step: int) -> int:
    """Keep the records of steps <= `last_step` (the checkpoint a run resumes from); drop later ones, which
    will run again, and any torn or unreadable line. Rewrites the file atomically when anything goes.

    Returns:
        How many lines were dropped (0 when the file is absent or already clean).
    """
    if not path.is_file():
        return 0
    records, bad_lines = _parse_lines(path)
    kept = [record for record in records if record.get("step", 0) <= last_step]
    dropped = bad_lines + len(records) - len(kept)
    if dropped:
        write_atomically(path, "".join(json.dumps(record) + "\n" for record in kept))
    return dropped


def write_atomically(path: Path, text: str) -> None:
    """Replace `path` with `text` so that readers (and a later crash) see the old file or the new one, never a
    part: write a temporary sibling, fsync it, rename it over `path`."""
    temporary = path.with_name(f".{path.name}.tmp")
    with write_failure_as_error(path):
        try:
            with temporary.open("w") as out:
                out.write(text)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temporary, path)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise


def _parse_lines(path: Path) -> tuple[list[dict[str, Any]], int]:
    """(the JSON-object lines of a JSONL file, how many other lines it has: torn or unreadable ones)."""
    records, bad_lines = [], 0
    for line in path.read_bytes().splitlines(keepends=True):
        try:
            record = json.loads(line) if line.endswith(b"\n") else None
        except ValueError:
            record = None
        if isinstance(record, dict):
            records.append(record)
        elif line.strip():
            bad_lines += 1
    return records, bad_lines
