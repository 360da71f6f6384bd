"""One writer per run directory: an exclusive advisory lock, and the temporary files its writers own.

Two training processes on one out_dir lose data (one deletes the other's temporary checkpoint, the log
truncation of a resume swaps the file under the other's open handle), so the process that writes a run
directory holds `fcntl.flock(LOCK_EX)` on `<out_dir>/.lock` for its whole life. The kernel drops the lock
when the process dies however it dies (SIGKILL included), so a lock is never stale; the file itself stays
(removing it would let a third process lock a fresh inode while the second still holds the old one).
The lock file holds the holder's pid, host and start time, for the refusal message only.

Temporary files and dirs are named `.tmp-<name>.<pid>` by the process that writes them. Under the lock
the only writer is the lock holder, so at start-up every temporary entry left by another process is a
leftover of a crash and is removed (`clean_stale_temps`).
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import time
from pathlib import Path

LOCK_NAME = ".lock"
TMP_PREFIX = ".tmp-"


class RunDirError(RuntimeError):
    """The run directory cannot be used (not a directory, read-only, ...); the message says what to do."""


class RunDirBusy(RunDirError):
    """Another process holds the run directory's lock; the message names it and what to do."""


def tmp_name(name: str, pid: int | None = None) -> str:
    """The name of a temporary file or dir for `name`, owned by process `pid` (default: this one)."""
    return f"{TMP_PREFIX}{name}.{os.getpid() if pid is None else pid}"


def tmp_owner(name: str) -> int | None:
    """The pid in a temporary entry's name (None if it is not one)."""
    if not name.startswith(TMP_PREFIX):
        return None
    tail = name.rsplit(".", 1)[-1]
    return int(tail) if tail.isdigit() else None


class RunLock:
    """Exclusive lock on a run directory for this process's life (or until `release`).

    `acquire` never blocks: a held lock raises RunDirBusy naming the holder's pid and how to proceed.
    """

    def __init__(self, out_dir: str | os.PathLike) -> None:
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> "RunLock":
        fd = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            for _ in range(20):  # the holder writes its pid just after taking the lock: wait for it (<= 1 s)
                if holder:
                    break
                time.sleep(0.05)
                holder = _read_holder(fd)
            os.close(fd)
            raise RunDirBusy(self._busy_message(holder)) from None
        except OSError as e:  # e.g. a network filesystem without flock: say so rather than run unguarded
            os.close(fd)
            raise RunDirBusy(f"cannot lock {self.path} ({e}): the filesystem of out_dir does not support flock; "
                             "use an out_dir on a local filesystem") from None
        except BaseException:
            os.close(fd)
            raise
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                               time.gmtime())}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        self._fd = fd
        return self

    def _open(self) -> int:
        """The lock file's descriptor (out_dir created as needed); RunDirError saying what to fix."""
        if self.out_dir.exists() and not self.out_dir.is_dir():
            raise RunDirError(f"out_dir={str(self.out_dir)!r} is a file, not a directory: choose another out_dir")
        if self.path.is_dir():
            raise RunDirError(f"{self.path} is a directory, but it must be the run's lock file: remove it "
                              f"(`rmdir {self.path}`) and rerun")
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            return os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise RunDirError(f"cannot create the lock file {self.path}: {describe_os_error(e)}; choose a writable "
                              "out_dir (or fix its permissions)") from None

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _busy_message(self, holder: dict) -> str:
        who = f"pid {holder['pid']}" if "pid" in holder else "a process whose pid is not recorded"
        where = f" on host {holder['host']}" if holder.get("host") else ""
        since = f", since {holder['since_utc']}" if holder.get("since_utc") else ""
        stop = f"stop it (`kill {holder['pid']}`)" if "pid" in holder else "stop it"
        return (f"out_dir={str(self.out_dir)!r} is in use by another training process ({who}{where}{since}; lock "
                f"file {self.path}). Only one process may write a run directory: wait for it to finish, or {stop} "
                "and rerun with --resume to continue from its newest checkpoint; or choose another out_dir.")


def describe_os_error(e: OSError) -> str:
    """An OSError in words, naming a full disk as such."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"no space left on device (errno {errno.errorcode[e.errno]})"
    name = errno.errorcode.get(e.errno, str(e.errno)) if e.errno is not None else None
    return f"{e.strerror or e} (errno {name})" if name else str(e)


def _read_holder(fd: int) -> dict:
    try:
        raw = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        info = json.loads(raw) if raw else {}
        return info if isinstance(info, dict) else {}
    except (OSError, ValueError):
        return {}


def clean_stale_temps(*dirs: Path) -> list[Path]:
    """Remove the temporary entries (`.tmp-*`) in `dirs` that this process does not own; return them.

    Call it only while holding the run lock: then no other live writer exists, and an entry of another pid
    (dead, or a reused pid of an unrelated process) is a crash's leftover.
    """
    me = os.getpid()
    removed = []
    for d in dirs:
        if not d.is_dir():
            continue
        for entry in d.iterdir():
            if not entry.name.startswith(TMP_PREFIX) or tmp_owner(entry.name) == me:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed
