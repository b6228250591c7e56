"""The cache directory: atomic writes, corrupt entries, concurrent writers, unusable directories."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ortrain.cache import store as store_module
from ortrain.cache.store import CacheStore

KEY = "0" * 64


def _child(code: str, root: Path, *args: str) -> subprocess.Popen[bytes]:
    script = (
        "import sys\nfrom pathlib import Path\nfrom ortrain.cache.store import CacheStore\n"
        + textwrap.dedent(code)
    )
    return subprocess.Popen([sys.executable, "-c", script, str(root), *args])


def test_round_trip_and_listing(tmp_path: Path) -> None:
    store = CacheStore(tmp_path)
    assert store.load("export", KEY) is None
    assert store.save("export", KEY, b"payload", {"what": "forward"})
    assert store.load("export", KEY) == b"payload"
    [entry] = list(store.entries())
    assert entry.header["what"] == "forward" and entry.header["payload_size"] == 7
    assert store.clear() == (1, entry.size)
    assert store.load("export", KEY) is None


def test_writer_killed_before_rename_leaves_nothing_loadable(tmp_path: Path) -> None:
    killed = _child(
        """
        import os, signal
        os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)  # dies between fsync and rename
        CacheStore(Path(sys.argv[1])).save("export", "0" * 64, b"x" * 100000, {})
        """,
        tmp_path,
    )
    assert killed.wait(timeout=60) == -9
    assert [p.name.startswith(".tmp-") for p in tmp_path.iterdir()] == [True]  # the orphan temp file
    store = CacheStore(tmp_path)
    assert store.load("export", KEY) is None
    assert store.save("export", KEY, b"rebuilt", {}) and store.load("export", KEY) == b"rebuilt"
    assert store.clear()[0] == 2  # `ortrain cache clear` removes the orphan too


@pytest.mark.parametrize("damage", ["flip a payload byte", "truncate", "garbage", "wrong key"])
def test_corrupt_entry_is_detected_logged_and_removed(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = CacheStore(tmp_path)
    store.save("export", KEY, bytes(range(256)) * 10, {})
    path = store.path("export", KEY)
    data = bytearray(path.read_bytes())
    if damage == "flip a payload byte":
        data[-100] ^= 0xFF
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "garbage":
        data = bytearray(b"\x00" * 50)
    else:
        data = data.replace(KEY.encode(), b"1" * 64)
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="ortrain.cache"):
        assert store.load("export", KEY) is None
    assert "is corrupt" in caplog.text and not path.exists()


def test_a_corrupt_entry_in_a_read_only_directory_is_skipped_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A cache shipped read-only (in an image): deleting the bad entry raised "Read-only file
    system" out of the training step until wave 45. (Root writes through ``chmod``: the deletion's
    refusal is simulated.)"""
    store = CacheStore(tmp_path)
    store.save("export", KEY, b"payload" * 10, {})
    path = store.path("export", KEY)
    path.write_bytes(path.read_bytes()[:-5])

    def read_only(self: Path, missing_ok: bool = False) -> None:
        raise OSError(30, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "unlink", read_only)
    with caplog.at_level(logging.WARNING, logger="ortrain.cache"):
        assert store.load("export", KEY) is None
        store.remove("export", KEY)
    assert "is corrupt" in caplog.text and "cannot delete the bad cache entry" in caplog.text


def test_two_processes_writing_the_same_entry(tmp_path: Path) -> None:
    writer = """
        store = CacheStore(Path(sys.argv[1]))
        for _ in range(40):
            assert store.save("export", "0" * 64, sys.argv[2].encode() * 200000, {})
    """
    writers = [_child(writer, tmp_path, letter) for letter in "ab"]
    store = CacheStore(tmp_path)
    while any(w.poll() is None for w in writers):
        payload = store.load("export", KEY)  # never a mix, never corrupt
        if payload is not None:
            assert payload in (b"a" * 200000, b"b" * 200000)
    assert [w.returncode for w in writers] == [0, 0]
    assert store.load("export", KEY) in (b"a" * 200000, b"b" * 200000)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_unusable_directory_warns_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="ortrain.cache"):
        for _ in range(3):
            store = CacheStore(blocker / "cache")
            assert not store.save("export", KEY, b"x", {})
            assert store.load("export", KEY) is None
    assert len(caplog.records) == 1 and "running uncached" in caplog.text


def test_cli_lists_and_clears(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from ortrain.cli import main

    store = CacheStore(tmp_path)
    store.save("export", KEY, b"x" * 3000, {"what": "backward", "nodes": 42, "versions": {"torch": "9.9"}})
    (tmp_path / "export-damaged.ortc").write_bytes(b"junk")
    (tmp_path / "ortrain_tuning.json").write_text("{}")  # op tuning's choices live there too
    monkeypatch.setenv("ORTMODULE_CACHE_DIR", str(tmp_path))
    assert main(["cache", "list"]) == 0
    listing = capsys.readouterr().out
    assert "2 entries" in listing and "backward" in listing and "42" in listing and "torch 9.9" in listing
    assert "(unreadable)" in listing and "ortrain_tuning.json: the placements op tuning chose" in listing
    assert main(["cache", "clear", "--dir", str(tmp_path)]) == 0
    assert "removed 3 files" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())
    store.save("export", KEY, b"x", {"what": "forward"})
    assert main(["cache", "list", "--dir", str(tmp_path)]) == 0
    assert ": 1 entry, " in capsys.readouterr().out  # "1 entries" until wave 53
    assert main(["cache", "clear", "--dir", str(tmp_path)]) == 0
    assert ": removed 1 file, " in capsys.readouterr().out  # "1 files" until wave 53
    monkeypatch.delenv("ORTMODULE_CACHE_DIR")
    assert main(["cache", "list"]) == 2
    assert "ORTMODULE_CACHE_DIR" in capsys.readouterr().err


def test_a_failed_write_leaves_the_directory_alone_for_the_whole_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Until wave 54 a full disk failed the capture's write with "running uncached", and the
    export entries were still written (and read) by the other stores of the directory."""
    older = CacheStore(tmp_path)
    assert older.save("export", KEY, b"x", {})

    def full_disk(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    with caplog.at_level(logging.WARNING, logger="ortrain.cache"):
        with monkeypatch.context() as patch:
            patch.setattr(store_module.tempfile, "mkstemp", full_disk)
            assert not CacheStore(tmp_path).save("capture", KEY, b"y", {})
        for store in (older, CacheStore(tmp_path)):
            assert not store.save("translations", KEY, b"z", {})
            assert store.load("export", KEY) is None
    assert len(caplog.records) == 1 and "No space left on device); running uncached" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"export-{KEY}.ortc"]
