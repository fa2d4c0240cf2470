"""
Writing a file or a directory so that an interruption leaves the old one whole, and stopping on
SIGTERM/SIGINT: the two jobs every command that writes something shares (as nanochat's common.py),
and the repository root.

    ROOT                                  the repository
    atomic_write(path) -> tmp             with-block: write the file tmp any way you like; it takes
                                          path's place if the block completes
    atomic_dir(path) -> tmp               the same for a whole directory (an HF export, a prepared
                                          dataset)
    written(path, flag) -> tmp            atomic_write, and a failed write (a full disk) one error line
                                          (cannot_write, which the exports use too)
    swapped_out(path)                     where path's previous directory is, if a writer was killed
                                          mid-swap
    link_or_copy(src, dst)                a hard link, or a copy where the filesystem has none
    StopSignal, Interrupted, stoppable    SIGTERM/SIGINT as a flag checked at a step boundary, or at
                                          once

The one writer: the new file or directory is written beside path under a name of its own (two
writers of one path never share a temporary file), synced, and renamed into path's place (atomic on
POSIX), so path is always the whole old one or the whole new one. A rename cannot replace a
directory that holds files, so a directory is swapped in by two renames, path ->
.<name>.old_<owner>_<random> and .<name>.tmp_<owner>_<random> -> path, with SIGTERM and SIGINT held
until both are done. owner = <host>_<pid>_<start> (start: when that process started, from
/proc/<pid>/stat, so a pid reused by a later process is told apart; without /proc, <host>_<pid>): a
later writer, on this machine or another one sharing the disk, tells what a writer that is gone left
(removed; an old directory whose path is missing is put back) from what a running one is using (left
alone), and each one removed is named in a line. Any other name beside path (<name>.tmp,
.<name>.old-backup, .<name>.tmp_mine) is not provably a writer's and is never touched.
Test: python -m pytest tests/test_atomic.py tests/test_prepare.py
"""

import contextlib
import errno
import os
import re
import shutil
import signal
import socket
import stat
import threading
import time

from tools.flags import die

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository

# a leftover whose writer cannot be asked (another host's) counts as gone after a day
STALE_AFTER_S = 86400

# -----------------------------------------------------------------------------
# writing: the old file (or directory) stays whole until the new one is complete


@contextlib.contextmanager
def atomic_write(path):
    """with atomic_write(path) as tmp: write the new file at tmp, any way (open, torch.save, a
    library's writer). When the block completes, tmp is synced to disk and renamed over path (atomic
    on POSIX), then the directory is synced: path is always the whole old file or the whole new one.
    On any exception (an OSError such as a full disk, errno ENOSPC; torch.save's RuntimeError;
    Ctrl-C; SystemExit) tmp is removed and path is left as it was. tmp is path +
    ".<owner>_<random>.tmp", this writer's own (two writers of one path never share it), in the same
    directory (a rename cannot cross filesystems); what a writer that is gone left (stale_tmps) is
    removed first. A symlink at path is written through: the file it names is replaced, the link
    stays."""
    path = os.path.realpath(path)
    clear_stale(path)
    tmp = f"{path}.{_owner()}_{os.urandom(4).hex()}.tmp"
    with _installing(tmp, path):
        yield tmp


@contextlib.contextmanager
def written(path, flag=None, what="it"):
    """with written(path, "--out") as tmp: atomic_write(path), for a command's output: an OSError in the block
    (the disk filled, a permission) ends the command with cannot_write's one line; the file there before is
    unchanged."""
    try:
        with atomic_write(path) as tmp:
            yield tmp
    except OSError as e:
        cannot_write(flag, path, what, e)


def cannot_write(flag, path, what, e, kept="the file there, if any, is unchanged"):
    """The one error line of an output that could not be written: flag=path (or the path), the cause (a full
    disk with what it has free, or the file-size limit: write_failed), what became of the earlier output, and
    the fix. Never blames the input: it was read."""
    why, cause, fix = write_failed(e, path)
    die(f"{f'{flag}={path}' if flag else path}: cannot write {what} ({why}); {cause}; {kept}; {fix}" +
        (f" or pass another {flag}" if flag else ""))


def stale_tmps(path):
    """The files atomic_write(path) left beside path whose writer is gone:
    path.<host>_<pid>[_<start>]_<hex>.tmp of a process of this host that no longer runs (a pid now
    another process's counts as gone; another host's after STALE_AFTER_S). No other name: a user's
    path.tmp is not ours."""
    parent, name = os.path.split(os.path.abspath(path))
    ours = re.compile(re.escape(name) + r"\.([A-Za-z0-9-]+)_(\d+)(?:_(\d+))?_[0-9a-f]+\.tmp")
    return [os.path.join(parent, n) for n, st, m in _beside(parent, ours, stat.S_ISREG)
            if _writer_gone(m[1], m[2], m[3], st.st_mtime)]


def clear_stale(path):
    """Remove stale_tmps(path), one line naming each (what a killed writer of path left)."""
    for stale in stale_tmps(path):
        with contextlib.suppress(FileNotFoundError):
            os.remove(stale)
            print(f"removed {stale}, left by a writer of {path} that is gone")


def _beside(parent, pattern, kind):
    """(name, lstat, match) of each entry of parent whose whole name matches pattern and whose mode
    passes kind (stat.S_ISREG, stat.S_ISDIR); one removed meanwhile is skipped."""
    for n in os.listdir(parent):
        m = pattern.fullmatch(n)
        try:
            st = os.lstat(os.path.join(parent, n)) if m else None
        except FileNotFoundError:
            st = None
        if st is not None and kind(st.st_mode):
            yield n, st, m


def _writer_gone(host, pid, start, mtime):
    """Whether the writer named by (host, pid, start) is gone: on this host, its pid no longer runs
    or is another process's (start given); on another host, the leftover is older than
    STALE_AFTER_S."""
    if host == _host() and os.name == "posix":
        return not _running(int(pid), int(start) if start else None)
    return time.time() - mtime > STALE_AFTER_S


@contextlib.contextmanager
def atomic_dir(path):
    """with atomic_dir(path) as tmp: write a whole directory at tmp, a new
    .<name>.tmp_<owner>_<random> beside path with path's permissions (or, for a new path, the
    umask's). When the block completes, tmp takes path's place by the swap and the old directory is
    deleted; on any exception tmp is deleted and path is left as it was. What writers that are gone
    left beside path is cleared first (_recover). A symlink at path is written through, as by
    atomic_write."""
    path = os.path.realpath(path)
    # checked before anything is written: the swap's rename of it would fail (EBUSY)
    if os.path.ismount(path):
        raise OSError(errno.EBUSY, f"{path} is a mount point, which a new directory cannot replace")
    _recover(path)
    parent, name = os.path.split(path)
    mine = f"{_owner()}_{os.urandom(4).hex()}"
    tmp, old = os.path.join(parent, f".{name}.tmp_{mine}"), os.path.join(parent, f".{name}.old_{mine}")
    os.mkdir(tmp)
    if os.path.isdir(path):
        os.chmod(tmp, stat.S_IMODE(os.stat(path).st_mode))
    with _installing(tmp, path, old):
        yield tmp


@contextlib.contextmanager
def _installing(tmp, path, old=None):
    """The block writes tmp (a file; a directory when old is given); then tmp is synced, takes
    path's place (_swap) and the directory holding path is synced. On any exception tmp is removed;
    old never stays."""
    try:
        yield
        if old is not None:  # a directory: the files in it, then the directory itself
            for n in os.listdir(tmp):
                if not os.path.islink(os.path.join(tmp, n)):
                    _fsync(os.path.join(tmp, n))
        _fsync(tmp)
        with _signals_deferred():
            _swap(tmp, path, old)
        _fsync(os.path.dirname(os.path.abspath(path)))
    except BaseException:
        _delete(tmp)
        raise
    finally:
        if old is not None:
            _delete(old)


def _swap(tmp, path, old):
    """tmp takes path's place: a file by one rename over it; a directory by two, path -> old, then
    tmp -> path. If the second fails, old goes back to path. Retried when another writer swaps the
    same path meanwhile (nodes sharing a disk): the directory of the writer that swaps last is the
    one kept."""
    for _ in range(10):
        try:
            if old is not None and os.path.lexists(path):
                os.rename(path, old)
            os.rename(tmp, path)
            return
        except BaseException as e:
            _put_back(old, path)
            raced = isinstance(e, OSError) and e.errno in (errno.ENOENT, errno.ENOTEMPTY, errno.EEXIST)
            if old is None or not raced or not os.path.isdir(tmp):
                raise
            _delete(old)  # another writer's directory took path meanwhile: what it replaced goes
    raise OSError(errno.EBUSY, f"{path} kept changing while this command tried to replace it")


def _put_back(old, path):
    """Move old, the directory a swap took away from path, back to path if path is missing. True if
    it did."""
    if old is None or not os.path.lexists(old) or os.path.lexists(path):
        return False
    os.rename(old, path)
    return True


def _recover(path):
    """Before a directory is written at path: if a writer was killed between the swap's two renames
    (no path), its old directory (the newest) goes back to path; then what writers that are gone
    left beside path is removed."""
    parent = os.path.dirname(path)
    gone = [(n, kind) for n, kind, running in _leftovers(path) if not running]
    olds = [n for n, kind in gone if kind == "old"]
    if olds and _put_back(os.path.join(parent, olds[-1]), path):
        print(f"restored {path} from {olds[-1]}, left by a writer killed while replacing it")
        gone.remove((olds[-1], "old"))
    for n, _ in gone:
        _delete(os.path.join(parent, n))
        print(f"removed {os.path.join(parent, n)}, left by a writer of {path} that is gone")


def swapped_out(path):
    """For a reader that finds no path: where its previous directory is, if a writer was killed
    between the swap's two renames (the next atomic_dir(path) puts it back); else None."""
    path = os.path.abspath(path)
    if os.path.exists(path) or not os.path.isdir(os.path.dirname(path)):
        return None
    olds = [n for n, kind, _ in _leftovers(path) if kind == "old"]
    return os.path.join(os.path.dirname(path), olds[-1]) if olds else None


def _leftovers(path):
    """[(name, "tmp" or "old", whether its writer may still be running)] of the directories beside
    path that its writers made, oldest first. Only two shapes of name count:
    .<name>.tmp_<owner>_<hex> and .<name>.old_<owner>_<hex> (owner: <host>_<pid>_<start> or
    <host>_<pid>). A pid of this host is asked whether it runs, and when it carries a start, whether
    the process with that pid is the one that started then; another host's leftover is gone after
    STALE_AFTER_S."""
    parent, name = os.path.split(path)
    ours = re.compile(re.escape(f".{name}.") + r"(tmp|old)_([A-Za-z0-9-]+)_(\d+)(?:_(\d+))?_[0-9a-f]+")
    found = sorted((st.st_mtime, n, m[1], not _writer_gone(m[2], m[3], m[4], st.st_mtime))
                   for n, st, m in _beside(parent, ours, stat.S_ISDIR))
    return [(n, kind, running) for _, n, kind, running in found]


def _host():
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host"


def _owner():
    start = _start_time(os.getpid())
    return f"{_host()}_{os.getpid()}" + (f"_{start}" if start is not None else "")


def _start_time(pid):
    """When process pid started (clock ticks after boot: field 22 of /proc/<pid>/stat); with the pid
    it names one process until the machine restarts. None without /proc or without such a
    process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # the fields after the command name (comm)
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _running(pid, start=None):
    """Whether process pid runs on this machine (this process included) and, when start is given, is
    the process that started then: a pid reused by a later process (this one too) is not that
    writer."""
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, as another user's process
        pass
    now = _start_time(pid) if start is not None else None
    return now is None or now == start


def _fsync(path):
    fd = os.open(path, os.O_RDONLY)  # a file or a directory: fsync of any descriptor flushes it
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _delete(path):
    """Remove the file or the whole directory at path, if there is one."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


@contextlib.contextmanager
def _signals_deferred():
    """SIGTERM and SIGINT received in the block are raised again after it, so its steps are never
    cut in half."""
    # only the main thread gets Python's handlers
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got = []
    handlers = {s: signal.signal(s, lambda signum, frame: got.append(signum)) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in handlers.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
        for s in got:
            signal.raise_signal(s)


def size_limit():
    """The largest file this process may write (the soft RLIMIT_FSIZE: `ulimit -f` in bytes), or
    None."""
    try:
        import resource
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        return None if limit == resource.RLIM_INFINITY else limit
    except (ImportError, OSError, ValueError):
        return None


def past_size_limit(f):
    """Whether the open file f has reached this process's file-size limit: a write failing there
    failed for it (EFBIG; a library's writer, torch.save's, may report it as a RuntimeError
    "unexpected pos ...")."""
    limit = size_limit()
    # 8 KiB: a write buffer
    return limit is not None and os.fstat(f.fileno()).st_size + (1 << 13) >= limit


def write_failed(e, path):
    """(why, cause, fix) for the error line of a write of path that raised e (an OSError): the
    error's words; the file-size limit (EFBIG: `ulimit -f`), a mount point (EBUSY, atomic_dir) or
    the free space of the disk holding path (measured now, after the partial file is gone); and the
    fix: "raise the limit (ulimit -f unlimited)", a directory inside the mount point, making the path
    writable (EACCES, EPERM, EROFS: not a matter of space), or "free disk space"."""
    why = getattr(e, "strerror", None) or (str(e).splitlines() or [type(e).__name__])[0]
    if getattr(e, "errno", None) == errno.EFBIG:
        limit = size_limit()
        cap = f" ({_bytes(limit)})" if limit is not None else ""
        return why, f"this shell's file-size limit{cap} stopped it, not the disk", \
            "raise the limit (ulimit -f unlimited)"
    if getattr(e, "errno", None) == errno.EBUSY:
        return why, "a whole directory is swapped in by renames, which cannot move a mount point", \
            f"pass a directory inside it (e.g. {os.path.join(path, 'out')})"
    if getattr(e, "errno", None) in (errno.EACCES, errno.EPERM, errno.EROFS):  # not a matter of space
        what = "the file system is mounted read-only" if e.errno == errno.EROFS else \
            "the file or its directory does not let this user write (permissions, or an immutable flag)"
        return why, what, f"make {os.path.realpath(path)} and its directory writable"
    where = os.path.dirname(os.path.realpath(path))  # a symlink's target's disk: where the write went
    try:
        disk = f"the disk holding {where} has {_bytes(shutil.disk_usage(where).free)} free"
    except OSError:
        disk = f"the disk holding {where} cannot be read"
    return why, disk, "free disk space"


def _bytes(n):
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n:,} bytes"


def link_or_copy(src, dst):
    """dst names the file src: a hard link (no extra space), or a copy where the filesystem has
    none."""
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)

# -----------------------------------------------------------------------------
# stopping: SIGTERM (a scheduler's preemption, torchrun) and SIGINT (Ctrl-C)


class Interrupted(SystemExit):
    """SIGTERM or SIGINT as an exception, raised by StopSignal where a signal stops the command at
    once. Uncaught, it ends the command with its one line `error: ...` and exit code 1; a command
    that has to say what it kept catches it (.signum)."""

    def __init__(self, signum, line):
        super().__init__(f"error: {line}")
        self.signum = signum


class StopSignal:
    """with StopSignal() as stop: ... `stop.requested` is the name of the first SIGTERM/SIGINT
    received, else None; a training loop checks it once per step. A second signal of the same kind
    raises Interrupted at once (torchrun follows a Ctrl-C with SIGTERM to its workers: that second,
    different signal is not an abort). StopSignal(at_once="why"): the first signal raises
    Interrupted, "error: SIGTERM: why" (leaving the with block, also where C code replaced it with
    an error of its own). StopSignal(forward=fn): fn(signum) is called first; when it
    returns True (it passed the signal on, e.g. to a child process that decides for itself), the
    signal only sets `requested`."""

    def __init__(self, signals=(signal.SIGTERM, signal.SIGINT), at_once=None, forward=None):
        self.signals, self.at_once, self.forward = signals, at_once, forward
        self.requested, self.old = None, {}

    def __enter__(self):
        self.old = {s: signal.signal(s, self._handle) for s in self.signals}
        return self

    def __exit__(self, exc_type, exc, tb):
        for s, h in self.old.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
        if self.at_once and self.requested and exc_type is not None and issubclass(exc_type, Exception):
            # the handler's Interrupted, raised inside C code that put its own error in its place
            # (numpy's tofile, whose os.PathLike check ran the handler, says TypeError): the signal
            # is what stopped the command
            raise Interrupted(signal.Signals[self.requested],
                              f"{self.requested}: {self.at_once}") from None

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.at_once:
            self.requested = name  # for __exit__, where C code replaced the exception with its own
            raise Interrupted(signum, f"{name}: {self.at_once}")
        passed_on = self.forward is not None and self.forward(signum)
        if self.requested == name and not passed_on:
            raise Interrupted(signum, f"second {name}: stopping now, without a checkpoint; the "
                                      "last one is kept")
        self.requested = self.requested or name


@contextlib.contextmanager
def stoppable(flag, path):
    """with stoppable("--out", out): a command writing its output (with atomic_write or atomic_dir)
    is stopped by SIGTERM or Ctrl-C at once, with one line saying whether path is as it was or
    already the whole new output, and exit code 128 + the signal (the shell's convention)."""
    def identity(p):
        return (os.lstat(p).st_dev, os.lstat(p).st_ino) if os.path.lexists(p) else None
    before = identity(path)
    try:
        with StopSignal(at_once="stopped"):
            yield
    except (KeyboardInterrupt, Interrupted) as e:
        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        how = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        now = identity(path)
        state = ("was already written whole" if now != before else
                 "is unchanged" if now is not None else "was not written")
        die(f"stopped by {how}: {flag}={path} {state}; run the same command again", 128 + signum)
