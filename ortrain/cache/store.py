"""A directory of content-addressed entries that processes share safely.

One file per entry, ``<kind>-<key>.ortc``::

    ORTRAIN-CACHE 1\\n
    <header: one line of JSON: key, what, created, versions, payload size and SHA-256>\\n
    <payload bytes>

Writes go to a temporary file in the same directory, are fsynced, then renamed over the entry
(``os.replace``, atomic on POSIX): a reader sees a whole entry or none, a writer killed mid-way
leaves only a ``.tmp-`` file that no reader opens, and two processes writing the same entry both
write complete files, the last rename winning. A payload whose size or checksum does not match
the header is logged at WARNING, deleted and reported as a miss, never returned. A directory that
cannot be created or written gives one WARNING and the process goes on without it: every store of
that directory, made before or after, neither loads nor saves (until wave 54 a failed capture
write warned "running uncached" while the export entries went on being written and read).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger("ortrain.cache")

MAGIC = b"ORTRAIN-CACHE 1\n"
SUFFIX = ".ortc"
TEMP_PREFIX = ".tmp-"
# Directories this process found unusable (a full disk, no permission): warned about once, then
# left alone by every store.
_unusable_roots: set[str] = set()


@dataclass(frozen=True)
class EntryInfo:
    path: Path
    size: int
    header: dict[str, Any]  # empty when the header cannot be read


class CorruptEntry(ValueError):
    pass


class CacheStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        if not self.usable:
            return
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            self._disable(error)

    @property
    def usable(self) -> bool:
        return str(self.root) not in _unusable_roots

    def _disable(self, error: OSError) -> None:
        if self.usable:
            _unusable_roots.add(str(self.root))
            logger.warning(
                "ORTMODULE_CACHE_DIR=%s cannot be used (%s: %s); running uncached",
                self.root,
                type(error).__name__,
                error,
            )

    def path(self, kind: str, key: str) -> Path:
        return self.root / f"{kind}-{key}{SUFFIX}"

    def load(self, kind: str, key: str) -> bytes | None:
        """The payload stored under ``key``, or None (absent, unreadable or corrupt)."""
        if not self.usable:
            return None
        path = self.path(kind, key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as error:
            logger.warning("cannot read cache entry %s (%s); rebuilding it", path, error)
            return None
        try:
            header, payload = _split(data)
            if header.get("key") != key:
                raise CorruptEntry(f"it holds key {header.get('key')!r}")
            if len(payload) != header.get("payload_size"):
                raise CorruptEntry(
                    f"payload is {len(payload)} bytes, header says {header.get('payload_size')}"
                )
            if hashlib.sha256(payload).hexdigest() != header.get("payload_sha256"):
                raise CorruptEntry("payload checksum does not match")
        except CorruptEntry as error:
            logger.warning("cache entry %s is corrupt (%s); rebuilding it", path, error)
            self._delete(path)
            return None
        return payload

    def _delete(self, path: Path) -> None:
        """Delete a bad entry where the directory allows it: a cache shipped read-only (in an
        image) keeps it, and the run goes on uncached for that graph (until wave 45 the deletion
        raised "Read-only file system" out of the training step)."""
        try:
            path.unlink(missing_ok=True)
        except OSError as error:
            logger.warning(
                "cannot delete the bad cache entry %s (%s); it stays and is never loaded", path, error
            )

    def save(self, kind: str, key: str, payload: bytes, header: dict[str, Any]) -> bool:
        """Store ``payload`` atomically; False (after one warning per directory) if it cannot."""
        if not self.usable:
            return False
        header = {
            **header,
            "key": key,
            "kind": kind,
            "created": time.time(),
            "payload_size": len(payload),
            "payload_sha256": hashlib.sha256(payload).hexdigest(),
        }
        line = json.dumps(header, sort_keys=True).encode() + b"\n"
        temp: str | None = None
        try:
            handle, temp = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=SUFFIX, dir=self.root)
            with os.fdopen(handle, "wb") as file:
                file.write(MAGIC + line + payload)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temp, self.path(kind, key))
        except OSError as error:
            if temp is not None:
                Path(temp).unlink(missing_ok=True)
            self._disable(error)
            return False
        return True

    def private(self) -> bool:
        """Owned by this user and writable by no one else: the only kind of directory whose entries
        may be unpickled (a pickle runs code when it loads)."""
        if not self.usable:
            return False
        try:
            status = self.root.stat()
        except OSError:
            return False
        getuid = getattr(os, "getuid", None)
        owned = getuid is None or status.st_uid == getuid()
        return owned and not status.st_mode & (stat.S_IWGRP | stat.S_IWOTH)

    def remove(self, kind: str, key: str) -> None:
        """Delete an entry that turned out unreadable after its checksum passed."""
        self._delete(self.path(kind, key))

    def entries(self) -> Iterator[EntryInfo]:
        if not self.root.is_dir():
            return
        for path in sorted(self.root.glob(f"*{SUFFIX}")):
            if path.name.startswith(TEMP_PREFIX):
                continue
            try:
                size = path.stat().st_size
                with path.open("rb") as file:
                    header = _read_header(file.read(len(MAGIC)), file.readline())
            except (OSError, CorruptEntry):
                header = {}
            yield EntryInfo(path, size, header)

    def clear(self) -> tuple[int, int]:
        """Delete every entry and every leftover temporary file; (files, bytes) removed."""
        count = size = 0
        if not self.root.is_dir():
            return 0, 0
        for path in self.root.glob(f"*{SUFFIX}"):
            try:
                length = path.stat().st_size
                path.unlink()
            except FileNotFoundError:
                continue
            count += 1
            size += length
        return count, size


def _read_header(magic: bytes, line: bytes) -> dict[str, Any]:
    if magic != MAGIC:
        raise CorruptEntry("not an ortrain cache file")
    if not line.endswith(b"\n"):
        raise CorruptEntry("truncated header")
    try:
        header = json.loads(line)
    except ValueError as error:
        raise CorruptEntry(f"unreadable header: {error}") from None
    if not isinstance(header, dict):
        raise CorruptEntry("unreadable header")
    return header


def _split(data: bytes) -> tuple[dict[str, Any], bytes]:
    end = data.find(b"\n", len(MAGIC))
    if end < 0:
        raise CorruptEntry("truncated header")
    header = _read_header(data[: len(MAGIC)], data[len(MAGIC) : end + 1])
    return header, data[end + 1 :]
