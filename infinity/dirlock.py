"""Owning a directory through a lock that dies with its process: swap directories and checkpoint directories.

[Note: directories are owned through flock]
Two runs that share a swap directory read each other's values; two runs that share a save directory
overwrite each other's checkpoints, and the first one's --resume continues from the second's weights. A
pid file read and then written leaves a window in which both claim the directory (3 of 40 synchronised
starts did), and a pid can be reused by an unrelated process after a kill -9. So a directory is owned by
an exclusive flock on its `owner.pid`, taken without waiting and held until the owner lets go or dies:
the kernel drops it with the process, whatever killed it, and exactly one of any number of simultaneous
claimers gets it. The file also holds the owner's pid, for the message the others get.

The owner may remove the directory while it holds the lock (a swapper's close). A claimer that opened
`owner.pid` just before that then locks a file no longer in the directory; it sees the inode changed (or the
name gone), and tries again on a fresh file. A lock held only for a moment (`probe`, which a cleaner uses to
tell a dead owner from a live one) is retried for a short while before a claimer gives up.

Within one process a directory can be owned more than once where the owner is the process, not an object
(`reentrant`: several engines saving into one directory one after another); the lock goes with the last.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import os
import threading
import time
import weakref

from infinity.errors import DirectoryInUse  # noqa: F401 - raised here, defined there

OWNER = "owner.pid"
RETRY_S = 0.2  # how long a claimer retries a lock that may be a probe's, not an owner's

_NO_FLOCK = (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP)
_said_no_flock: set = set()
_held: dict[str, list] = {}  # realpath of a reentrant directory -> [fd, count]
_held_lock = threading.Lock()
_live: "weakref.WeakSet" = weakref.WeakSet()  # released at exit (a script's engine is often never closed)


def _say_no_flock(directory: str, err: int) -> None:
    import warnings

    if directory not in _said_no_flock:
        _said_no_flock.add(directory)
        warnings.warn(f"infinity: {directory} is on a filesystem without flock ({os.strerror(err)}), so another "
                      "run using it cannot be detected; give each run its own directory", stacklevel=4)


class DirLock:
    """The exclusive ownership of `directory` (created if missing) by this process; `release()` gives it up.

    Raises DirectoryInUse, naming the owner's pid, `what` the directory is and `fix`, when another process
    holds it."""

    def __init__(self, directory, *, what: str, fix: str, reentrant: bool = False):
        self.directory = os.path.realpath(os.fspath(directory))
        self.path = os.path.join(self.directory, OWNER)
        self.reentrant = reentrant
        self._fd: int | None = None
        self._pid = os.getpid()  # a forked child inherits the fd, not the ownership
        if reentrant:
            with _held_lock:
                entry = _held.get(self.directory)
                if entry is not None:
                    entry[1] += 1
                    self._fd = entry[0]
                    return
                self._fd = self._acquire(what, fix)
                if self._fd is not None:
                    _held[self.directory] = [self._fd, 1]
        else:
            self._fd = self._acquire(what, fix)
        if self._fd is not None:
            _live.add(self)

    def _acquire(self, what: str, fix: str) -> int:
        deadline = time.monotonic() + RETRY_S
        while True:
            os.makedirs(self.directory, exist_ok=True)
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except FileNotFoundError:  # the directory went between makedirs and open: try again
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in _NO_FLOCK:  # Lustre without -o flock, some FUSE and object-store mounts
                    _say_no_flock(self.directory, exc.errno)
                    return None
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise OSError(exc.errno, f"cannot lock {self.path}: {os.strerror(exc.errno)}") from None
                if time.monotonic() < deadline:
                    time.sleep(0.02)
                    continue
                owner = read_pid(self.path)
                raise DirectoryInUse(f"{what} {self.directory} is in use by running process "
                                     f"{owner or '(unknown)'}; {fix}") from None
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # the owner removed the directory after our open: the lock is on a dead file
                os.close(fd)
                continue
            try:
                data = f"{os.getpid()}\n".encode()
                os.ftruncate(fd, 0)
                os.pwrite(fd, data, 0)
            except BaseException:
                os.close(fd)
                raise
            return fd

    @property
    def held(self) -> bool:
        """False where the filesystem has no flock (said once), or once released."""
        return self._fd is not None

    def release(self) -> None:
        """Give the directory up, and remove its owner.pid (once the last reentrant owner in this process lets
        go): the file means something only while it is locked. Idempotent; run at exit for any still held."""
        _live.discard(self)
        fd, self._fd = self._fd, None
        if fd is None:
            return
        if os.getpid() != self._pid:  # inherited through fork: the parent still owns it
            os.close(fd)
            return
        if self.reentrant:
            with _held_lock:
                entry = _held.get(self.directory)
                if entry is None or entry[0] != fd:
                    return
                entry[1] -= 1
                if entry[1] > 0:
                    return
                del _held[self.directory]
        try:  # still locked: a claimer that opened it meanwhile sees the name gone, and retries
            st, mine = os.stat(self.path), os.fstat(fd)
            if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):  # not a newer owner's file
                os.unlink(self.path)
        except FileNotFoundError:  # the owner removed the whole directory first
            pass
        os.close(fd)  # closing the only descriptor of the open file drops the flock

    def __del__(self):
        try:
            self.release()
        except Exception:  # noqa: BLE001 - interpreter shutdown; the kernel drops the lock with the process
            pass


def probe(directory) -> bool | None:
    """Whether a live process owns `directory`: True (locked), False (an owner.pid nobody holds: its owner
    died or let go), None (no owner.pid). The lock is taken for a moment only; a claimer retries past it."""
    path = os.path.join(os.fspath(directory), OWNER)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return True
        raise
    finally:
        os.close(fd)
    return False


def own_checkpoint_dir(directory) -> DirLock:
    """This process's claim of a checkpoint directory (reentrant: the run and its engine hold it together)."""
    return DirLock(directory, what="the checkpoint directory", reentrant=True,
                   fix="another run saves its checkpoints there; give each run its own save directory (--save-dir)")


def alive(pid: int) -> bool:
    """Whether a process `pid` exists (one we may not signal counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_pid(path: str) -> int:
    """The pid an owner.pid names; 0 when it is empty, unreadable or garbled."""
    try:
        with open(path) as f:
            return int(f.read().strip() or "0")
    except (OSError, ValueError):
        return 0


def _release_all() -> None:
    """At exit, the reentrant ones (checkpoint directories: their owner.pid should not outlive the run). A swap
    directory's lock stays until its swapper's close removes the directory (engine/lifetime.py closes them at
    exit, after this runs): released first, a new run could claim the directory and lose its files to that
    close. The kernel drops whatever is left with the process."""
    for lock in list(_live):
        if lock.reentrant:
            try:
                lock.release()
            except Exception:  # noqa: BLE001 - exiting; the kernel drops the locks with the process anyway
                pass


def _forget_inherited() -> None:
    """In a forked child: the parent's locks are the parent's. Their fds are closed here (the parent's own keep
    the flock), so a claim in the child is a claim of its own."""
    _held.clear()
    for lock in list(_live):
        lock.release()  # closes the inherited fd only: the pid differs
    _live.clear()


atexit.register(_release_all)
os.register_at_fork(after_in_child=_forget_inherited)
