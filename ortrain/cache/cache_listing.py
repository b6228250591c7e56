"""What ``ortrain cache list`` and ``ortrain cache clear`` print."""

from __future__ import annotations

import time
from pathlib import Path

from ortrain.cache.store import CacheStore
from ortrain.runtime.tuning_results import FILE_NAME as TUNING_FILE


def _size(size: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def _age(seconds: float) -> str:
    for unit, length in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= length:
            return f"{seconds / length:.0f} {unit}"
    return f"{seconds:.0f} s"


def list_cache(directory: Path) -> list[str]:
    entries = list(CacheStore(directory).entries()) if directory.is_dir() else []
    count = f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}"
    lines = [f"{directory}: {count}, {_size(sum(e.size for e in entries))}"]
    if entries:
        lines.append(f"{'key':<14} {'graph':<14} {'nodes':>6} {'size':>10} {'age':>7}  versions")
    now = time.time()
    for entry in sorted(entries, key=lambda e: e.header.get("created", 0), reverse=True):
        header = entry.header
        if not header:
            lines.append(f"{entry.path.name[:14]:<14} {'(unreadable)':<14} {'':>6} {_size(entry.size):>10}")
            continue
        versions = " ".join(f"{k} {v}" for k, v in sorted(header.get("versions", {}).items()))
        lines.append(
            f"{header['key'][:12]:<14} {header.get('what', '?'):<14} {header.get('nodes', '?'):>6} "
            f"{_size(entry.size):>10} {_age(now - header.get('created', now)):>7}  {versions}"
        )
    tuning = directory / TUNING_FILE
    if tuning.is_file():
        lines.append(
            f"{TUNING_FILE}: the placements op tuning chose on this machine, {_size(tuning.stat().st_size)}"
        )
    return lines


def clear_cache(directory: Path) -> list[str]:
    count, size = CacheStore(directory).clear() if directory.is_dir() else (0, 0)
    tuning = directory / TUNING_FILE
    if tuning.is_file():
        size += tuning.stat().st_size
        tuning.unlink()
        count += 1
    return [f"{directory}: removed {count} file{'' if count == 1 else 's'}, {_size(size)}"]
