"""Whose batch directory this is: jobs run only on the gateways of the deployment they were
submitted to.

Three things keep another deployment out of a directory:

- **The default directory is per listening address**: ``$XDG_STATE_HOME/qosgate/batches/
  <host>-<port>`` (else ``~/.local/state/...``). Two gateways on one host never meet by default,
  and a gateway started again on its address (after a crash, a ``kill -9``) finds its jobs
  again. Port 0 has no address to come back to: its jobs are kept for the process alone, in a
  temporary directory removed when it stops.
- **A lock on the directory, held for the process's life** (``flock`` on ``lock``: the kernel
  lets it go when the process dies, however it dies). An instance alone takes it exclusively.
  Instances that share jobs on purpose -- through one Redis (``RedisLease`` decides which one
  runs a job) or as the workers of one ``serve --workers`` (worker 0 runs them) -- take it
  shared, and must agree on how they share: the lock file names the sharing of those holding
  it, and a newcomer that shares otherwise is refused. A second gateway started on a directory
  by mistake stops at start, told who holds it and what to do.
- **No network file system**: SQLite's locks and WAL's shared memory work between processes of
  one host; over NFS or SMB the database is not one. Jobs are a single host's.

Taking the lock and writing the holders' record happen under a second, brief lock
(``lock.gate``): ``flock`` turns an exclusive lock into a shared one by letting it go first,
and without the gate a newcomer could slip in between the two.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from qosgate.settings import GatewaySettings

__all__ = [
    "NETWORK_FS", "BatchDirectory", "DirectoryLock", "DirectoryRefused", "Holder", "Sharing",
    "batch_directory", "check_local", "default_directory", "lock_directory", "mount_of",
    "redis_identity", "state_home",
]

LOCK = "lock"
GATE = "lock.gate"
# the gate is held for a few file operations; one held this long belongs to a stuck process
GATE_WAIT_S = 10.0
SharingKind = Literal["alone", "redis", "workers"]

# File systems whose files live on another host (or are shared with other hosts): SQLite's
# locking and the shared memory of its WAL do not hold there.
NETWORK_FS = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "ncpfs", "afs", "9p", "ceph", "glusterfs",
    "lustre", "gpfs", "beegfs", "ocfs2", "gfs2", "fuse.sshfs", "fuse.glusterfs", "fuse.ceph",
    "fuse.s3fs", "fuse.gcsfuse", "fuse.rclone", "fuse.juicefs",
})


class DirectoryRefused(Exception):
    """This gateway may not keep its jobs in the directory: the message says why and what to
    do instead."""


def state_home() -> Path:
    """The XDG base directory spec's place for state that outlives a process."""
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")


def default_directory(host: str, port: int) -> Path:
    """Jobs of the gateway listening on ``host:port`` when ``batches.dir`` is not set."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", host) or "_"
    return state_home() / "qosgate" / "batches" / f"{safe}-{port}"


def redis_identity(url: str, prefix: str) -> str:
    """The Redis a deployment shares its jobs through, as written in the lock file: its URL
    without a password (the file is readable by whoever can list the directory), and the key
    prefix (two deployments may share one Redis under different prefixes)."""
    parts = urlsplit(url)
    userinfo, at, hostport = parts.netloc.rpartition("@")
    user = userinfo.partition(":")[0]
    netloc = f"{user}@{hostport}" if at and user else hostport
    query = urlencode([(k, v) for k, v in parse_qsl(parts.query) if k != "password"])
    return f"{urlunsplit(parts._replace(netloc=netloc, query=query))} prefix {prefix!r}"


@dataclass(frozen=True, slots=True)
class Sharing:
    """How the instances on a directory share its jobs: ``alone`` (one instance; the lock is
    exclusive), ``redis`` (``key``: ``redis_identity``) or ``workers`` (``key``: the group of
    one ``serve --workers``)."""

    kind: SharingKind
    key: str = ""

    def describe(self) -> str:
        if self.kind == "redis":
            return f"share their jobs through Redis {self.key}"
        if self.kind == "workers":
            return f"are the workers of one `qosgate serve --workers` (group {self.key})"
        return "runs alone (no redis.url)"


@dataclass(frozen=True, slots=True)
class Holder:
    """Who holds a directory, as a refused newcomer is told."""

    pid: int
    instance: str
    address: str

    def describe(self) -> str:
        return f"pid {self.pid}, listening on {self.address}, instance {self.instance}"


@dataclass(frozen=True, slots=True)
class _Record:
    """The lock file's content: how its holders share it, and the last one to take it."""

    sharing: Sharing
    holder: Holder

    def encode(self) -> bytes:
        return json.dumps({"sharing": self.sharing.kind, "key": self.sharing.key,
                           "pid": self.holder.pid, "instance": self.holder.instance,
                           "address": self.holder.address}).encode() + b"\n"

    @staticmethod
    def decode(raw: bytes) -> _Record | None:
        try:
            d = json.loads(raw)
            kind = d["sharing"]
            if kind not in ("alone", "redis", "workers"):
                return None
            return _Record(Sharing(kind, str(d["key"])),
                           Holder(int(d["pid"]), str(d["instance"]), str(d["address"])))
        except (ValueError, KeyError, TypeError):
            return None


# ---------------------------------------------------------------------- file systems
def _unescape(field_: str) -> str:
    """A path as ``/proc/self/mounts`` writes it: blanks and backslashes octal-escaped."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field_)


def mount_of(path: Path, mounts: str) -> tuple[str, str] | None:
    """The mount point ``path`` (absolute, symbolic links resolved) is under and its file
    system type, from the text of ``/proc/self/mounts``: the longest mount point containing it
    (of equal ones, the last mounted, which hides the others)."""
    target = str(path)
    best: tuple[str, str] | None = None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = _unescape(fields[1])
        inside = point == "/" or target == point or target.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[0])):
            best = (point, fields[2])
    return best


def check_local(directory: Path, mounts: str | None = None) -> None:
    """``DirectoryRefused`` if ``directory`` is on a network file system (``mounts``: the text
    of ``/proc/self/mounts``, read if not given; where there is none, nothing is checked)."""
    if mounts is None:
        try:
            mounts = Path("/proc/self/mounts").read_text()
        except OSError:
            return
    found = mount_of(Path(os.path.realpath(directory)), mounts)
    if found is not None and found[1] in NETWORK_FS:
        point, fstype = found
        raise DirectoryRefused(
            f"the batch directory {directory} is on a network file system ({fstype}, mounted "
            f"at {point}). Jobs live in SQLite, whose locks and write-ahead log work between "
            "the processes of one host only: over a network file system the database can be "
            "corrupted and a job run twice. Set batches.dir to a local disk. Jobs are kept per "
            "host; see docs/guides/several-instances.md, 'Batch jobs'.")


# ---------------------------------------------------------------------- the lock
def _try(fd: int, op: int) -> bool:
    try:
        fcntl.flock(fd, op | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _read(fd: int) -> _Record | None:
    return _Record.decode(os.pread(fd, 1 << 16, 0))


def _write(fd: int, record: _Record) -> None:
    # in place: a rename would make a new file, and the lock is on the old one
    data = record.encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


@contextlib.contextmanager
def _gate(directory: Path, wait_s: float) -> Iterator[None]:
    fd = os.open(directory / GATE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        deadline = time.monotonic() + wait_s
        while not _try(fd, fcntl.LOCK_EX):
            if time.monotonic() >= deadline:
                raise DirectoryRefused(
                    f"{directory / GATE} stayed locked for {wait_s:g} s: another gateway "
                    f"starting on {directory} is stuck (stop it, or give this one its own "
                    "batches.dir)")
            time.sleep(0.01)
        yield
    finally:
        os.close(fd)  # the last descriptor of the file closed: the gate opens


def _refusal(directory: Path, sharing: Sharing, held: _Record | None) -> str:
    if held is None:
        who = "another process (its lock file names no holder)"
    elif held.sharing.kind == "alone":
        who = f"another gateway ({held.holder.describe()})"
    else:
        who = (f"gateways that {held.sharing.describe()} (the last to start: "
               f"{held.holder.describe()})")
    fix = ("give this gateway its own batches.dir, or, to share the jobs on purpose, start "
           "every instance on the directory with the same redis.url and redis.prefix")
    if sharing.kind != "alone":
        fix = f"this one {sharing.describe()}: " + fix
    return (f"the batch directory {directory} holds the jobs of {who}. A gateway lists and runs "
            f"only its own deployment's jobs: {fix} (docs/guides/several-instances.md, "
            "'Batch jobs').")


class DirectoryLock:
    """A directory's lock, held until ``release`` or the process's end."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor lets the lock go
            self._fd = None


def lock_directory(directory: Path, sharing: Sharing, holder: Holder,
                   gate_wait_s: float = GATE_WAIT_S) -> DirectoryLock:
    """Take ``directory`` (created if missing) for this process: exclusively if ``sharing`` is
    ``alone``, else shared with the instances holding it that share it the same way.
    ``DirectoryRefused`` if another deployment holds it."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        with _gate(directory, gate_wait_s):
            mine = _Record(sharing, holder)
            if _try(fd, fcntl.LOCK_EX):  # nobody holds it: ours to describe
                _write(fd, mine)
                if sharing.kind != "alone" and not _try(fd, fcntl.LOCK_SH):
                    raise DirectoryRefused(f"could not share the lock on {directory}")
                return DirectoryLock(fd)
            held = _read(fd)
            if sharing.kind != "alone" and _try(fd, fcntl.LOCK_SH):
                # those holding it shared wrote the record under the gate: it is theirs
                if held is not None and held.sharing == sharing:
                    _write(fd, mine)  # the latest to start names the holders
                    return DirectoryLock(fd)
                fcntl.flock(fd, fcntl.LOCK_UN)
            raise DirectoryRefused(_refusal(directory, sharing, held))
    except BaseException:
        os.close(fd)
        raise


# ---------------------------------------------------------------------- this gateway's
@dataclass
class BatchDirectory:
    """Where this gateway keeps its jobs, how it shares them, and whether it runs their lines
    (``feeds``). ``claim`` takes the directory; ``notes`` are what start-up logs about it."""

    path: Path
    sharing: Sharing
    holder: Holder
    feeds: bool
    temporary: bool = False  # port 0: the process's own, removed at ``release``
    notes: list[tuple[int, str]] = field(default_factory=list)  # (logging level, message)
    _lock: DirectoryLock | None = None

    @property
    def claimed(self) -> bool:
        return self._lock is not None

    def claim(self) -> None:
        """Take the directory (again a no-op): ``DirectoryRefused`` if it is on a network file
        system or another deployment holds it."""
        if self._lock is not None:
            return
        check_local(self.path)
        try:
            self._lock = lock_directory(self.path, self.sharing, self.holder)
        except OSError as exc:  # not ours to write, or a file system without flock
            raise DirectoryRefused(f"cannot use the batch directory {self.path}: "
                                   f"{exc.strerror or exc}") from exc
        legacy = state_home() / "qosgate" / "batches.sqlite3"
        if not self.temporary and legacy.exists() and legacy.parent != self.path:
            self.notes.append((logging.WARNING, (
                f"batch jobs of an earlier version are in {legacy.parent} (one directory every "
                f"gateway of this user shared); this gateway keeps its own in {self.path}. To "
                f"serve those jobs, start ONE gateway with batches.dir: {legacy.parent}")))

    def release(self) -> None:
        if self._lock is None:
            return
        self._lock.release()
        self._lock = None
        if self.temporary:
            shutil.rmtree(self.path, ignore_errors=True)


def batch_directory(settings: GatewaySettings, instance: str,
                    worker: tuple[str, int] | None = None) -> BatchDirectory:
    """Where this gateway keeps its jobs (nothing is taken yet: ``claim``). ``worker``: (group,
    index) of a process of ``serve --workers``."""
    srv, rs, bs = settings.server, settings.redis, settings.batches
    host = f"[{srv.host}]" if ":" in srv.host else srv.host
    holder = Holder(os.getpid(), instance, f"{host}:{srv.port}")
    notes: list[tuple[int, str]] = []
    if bs.dir is None and srv.port == 0:
        path = Path(tempfile.gettempdir()) / f"qosgate-batches-{os.getpid()}-{secrets.token_hex(4)}"
        notes.append((logging.WARNING, (
            f"batches.dir is not set and the port is 0: jobs are kept in {path} for this "
            "process only (started again it listens elsewhere, and could not tell its jobs "
            "from another gateway's); set batches.dir or a port to keep them")))
        return BatchDirectory(path, Sharing("alone"), holder, bs.feed, True, notes)
    path = bs.dir if bs.dir is not None else default_directory(srv.host, srv.port)
    feeds = bs.feed
    if rs.url:
        sharing = Sharing("redis", redis_identity(rs.url, rs.prefix))
    elif worker is not None:
        group, index = worker
        sharing = Sharing("workers", group)
        if index != 0 and feeds:
            feeds = False
            notes.append((logging.INFO, (
                f"batches: worker {index} runs no job lines: without Redis worker 0 runs every "
                "job of the workers' directory (with --redis every worker does); this one "
                "serves the Batch API")))
    else:
        sharing = Sharing("alone")
    return BatchDirectory(path, sharing, holder, feeds, False, notes)
