"""Whose batch directory this is: the default per listening address, the lock that makes a
directory one deployment's (refusals naming the holder and the fixes, sharing through one Redis
or as one group of workers), and the network file systems a directory may not be on. (A lock
that dies with its process, newcomers racing: ``tests/e2e/batches/test_directory.py``.)"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest

from qosgate.runtime.batches.directory import (
    DirectoryRefused,
    Holder,
    Sharing,
    batch_directory,
    check_local,
    default_directory,
    lock_directory,
    mount_of,
    redis_identity,
)
from qosgate.settings import settings_from_mapping
from tests.support.directory_holders import ALONE, holder

RED_A = Sharing("redis", redis_identity("redis://10.0.0.1:6379/0", "qosgate:"))
RED_B = Sharing("redis", redis_identity("redis://10.0.0.2:6379/0", "qosgate:"))


# ---------------------------------------------------------------------- where
def test_the_default_directory_is_per_listening_address(monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    base = tmp_path / "qosgate" / "batches"
    assert default_directory("127.0.0.1", 8000) == base / "127.0.0.1-8000"
    assert default_directory("127.0.0.1", 8001) == base / "127.0.0.1-8001"
    assert default_directory("::", 8000) == base / "__-8000"
    monkeypatch.delenv("XDG_STATE_HOME")
    assert default_directory("0.0.0.0", 80) == (
        Path.home() / ".local" / "state" / "qosgate" / "batches" / "0.0.0.0-80")


def test_how_a_gateway_keeps_and_shares_its_jobs(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))

    def resolve(worker: tuple[str, int] | None = None, **sections: Any) -> Any:
        return batch_directory(settings_from_mapping(sections), "gw", worker)

    d = resolve(server={"port": 9000})
    assert d.path == tmp_path / "qosgate" / "batches" / "127.0.0.1-9000"
    assert (d.sharing, d.feeds, d.temporary, d.notes) == (ALONE, True, False, [])
    assert d.holder == Holder(os.getpid(), "gw", "127.0.0.1:9000")
    assert resolve(batches={"dir": str(tmp_path / "x")}).path == tmp_path / "x"
    d = resolve(redis={"url": "redis://:pw@10.0.0.1:6379/0"})
    assert d.sharing == RED_A and d.feeds
    # the workers of one `serve --workers`: one deployment; without Redis worker 0 runs jobs
    w0, w1 = resolve(("g1", 0)), resolve(("g1", 1))
    assert w0.sharing == w1.sharing == Sharing("workers", "g1") and w0.path == w1.path
    assert w0.feeds and not w1.feeds
    assert [lvl for lvl, _ in w1.notes] == [logging.INFO] and "worker 0" in w1.notes[0][1]
    assert resolve(("g1", 1), redis={"url": "redis://10.0.0.1:6379/0"}).feeds
    assert not resolve(batches={"feed": False}).feeds
    # port 0: no address to come back to; the process's own directory, gone when it stops
    d = resolve(server={"port": 0})
    assert d.temporary and d.sharing == ALONE and d.notes[0][0] == logging.WARNING
    assert "port is 0" in d.notes[0][1] and str(d.path) in d.notes[0][1]
    assert resolve(server={"port": 0}).path != d.path
    d.claim()
    assert (d.path / "lock").exists()
    d.release()
    assert not d.path.exists()
    assert resolve(server={"port": 0}, batches={"dir": str(tmp_path / "y")}).path == tmp_path / "y"


def test_jobs_of_the_old_shared_default_are_pointed_at(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    (tmp_path / "qosgate").mkdir()
    (tmp_path / "qosgate" / "batches.sqlite3").write_bytes(b"")
    d = batch_directory(settings_from_mapping({}), "gw")
    d.claim()
    try:
        (level, note), = d.notes
        assert level == logging.WARNING
        assert f"batches.dir: {tmp_path / 'qosgate'}" in note and str(d.path) in note
    finally:
        d.release()


def test_the_redis_identity_leaves_the_password_out() -> None:
    assert redis_identity("redis://:s3cret@r:6379/0", "q:") == "redis://r:6379/0 prefix 'q:'"
    assert redis_identity("rediss://app:s3cret@r:6380/1?password=x&db=1", "q:") == (
        "rediss://app@r:6380/1?db=1 prefix 'q:'")
    assert redis_identity("redis://r/0", "a:") != redis_identity("redis://r/0", "b:")


# ---------------------------------------------------------------------- the lock
def test_a_second_gateway_alone_is_refused_with_the_holder_and_the_fixes(tmp_path: Path) -> None:
    first = lock_directory(tmp_path, ALONE, holder(1))
    with pytest.raises(DirectoryRefused) as refused:
        lock_directory(tmp_path, ALONE, holder(2))
    msg = str(refused.value)
    for part in (str(tmp_path), "pid 1001", "127.0.0.1:8001", "gw-1", "its own batches.dir",
                 "the same redis.url"):
        assert part in msg, msg
    first.release()
    lock_directory(tmp_path, ALONE, holder(2)).release()  # free once its holder lets go


def test_instances_share_a_directory_only_through_the_same_redis(tmp_path: Path) -> None:
    a1 = lock_directory(tmp_path, RED_A, holder(1))
    a2 = lock_directory(tmp_path, RED_A, holder(2))
    with pytest.raises(DirectoryRefused) as other_redis:
        lock_directory(tmp_path, RED_B, holder(3))
    assert "10.0.0.1:6379" in str(other_redis.value) and "10.0.0.2:6379" in str(other_redis.value)
    with pytest.raises(DirectoryRefused) as alone:
        lock_directory(tmp_path, ALONE, holder(4))
    assert "gw-2" in str(alone.value)  # the last to start is named
    with pytest.raises(DirectoryRefused):
        lock_directory(tmp_path, Sharing("workers", "g1"), holder(5))
    a1.release()
    with pytest.raises(DirectoryRefused):  # one holder is left
        lock_directory(tmp_path, ALONE, holder(4))
    a2.release()
    b = lock_directory(tmp_path, RED_B, holder(3))  # nobody holds it: the sharing is the newcomer's
    with pytest.raises(DirectoryRefused):
        lock_directory(tmp_path, RED_A, holder(1))
    b.release()


def test_a_gateway_alone_keeps_out_those_sharing(tmp_path: Path) -> None:
    lone = lock_directory(tmp_path, ALONE, holder(1))
    for sharing in (RED_A, Sharing("workers", "g1")):
        with pytest.raises(DirectoryRefused) as refused:
            lock_directory(tmp_path, sharing, holder(2))
        assert "gw-1" in str(refused.value)
    lone.release()
    w0 = lock_directory(tmp_path, Sharing("workers", "g1"), holder(1))
    w1 = lock_directory(tmp_path, Sharing("workers", "g1"), holder(2))
    with pytest.raises(DirectoryRefused):  # workers of another start
        lock_directory(tmp_path, Sharing("workers", "g2"), holder(3))
    w0.release()
    w1.release()










# ---------------------------------------------------------------------- file systems
MOUNTS = r"""/dev/vda / ext4 rw,relatime 0 0
proc /proc proc rw 0 0
srv:/export/home /home nfs4 rw,vers=4.2 0 0
/dev/vdb /home/alice/local ext4 rw 0 0
//nas/share /mnt/my\040share cifs rw 0 0
tmpfs /mnt/my tmpfs rw 0 0
sshfs#bob@h: /mnt/remote fuse.sshfs rw 0 0
"""


@pytest.mark.parametrize(("path", "mount"), [
    ("/var/lib/qosgate", ("/", "ext4")),
    ("/home/alice/.local/state/qosgate", ("/home", "nfs4")),
    ("/home", ("/home", "nfs4")),
    ("/homework", ("/", "ext4")),
    ("/home/alice/local/q", ("/home/alice/local", "ext4")),
    ("/mnt/my share/jobs", ("/mnt/my share", "cifs")),
    ("/mnt/my/jobs", ("/mnt/my", "tmpfs")),
    ("/mnt/remote", ("/mnt/remote", "fuse.sshfs")),
])
def test_the_mount_a_directory_is_on(path: str, mount: tuple[str, str]) -> None:
    assert mount_of(Path(path), MOUNTS) == mount


def test_a_directory_on_a_network_file_system_is_refused() -> None:
    for path in ("/home/alice/.local/state/qosgate", "/mnt/my share/x", "/mnt/remote/q"):
        with pytest.raises(DirectoryRefused, match="network file system") as refused:
            check_local(Path(path), MOUNTS)
        assert "batches.dir" in str(refused.value)
    check_local(Path("/home/alice/local/q"), MOUNTS)
    check_local(Path("/var/lib/qosgate"), MOUNTS)


def test_a_directory_it_cannot_write_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    d = batch_directory(settings_from_mapping({"batches": {"dir": str(tmp_path / "file" / "q")}}),
                        "gw")
    with pytest.raises(DirectoryRefused, match="cannot use the batch directory"):
        d.claim()
    assert not d.claimed
