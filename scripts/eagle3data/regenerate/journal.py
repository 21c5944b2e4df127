"""An append-only journal of finished results, one JSON line each, that survives a killed job.

The regenerate stage stores each response the moment it finishes: a line is appended and fsynced, so
a job killed at any point (SIGKILL, OOM, a lost node) has lost at most the responses still in flight.
Each line carries a CRC32 of its own JSON; a resumed job reads every line back, keeps those whose
checksum holds, and cuts the file after the last whole one (the torn line a kill leaves, if any), so
new lines never glue onto a broken one. A bad line anywhere else is damage, not a kill: it is refused.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from isal import isal_zlib

from eagle3data.utils.logs import get_logger

logger = get_logger(__name__)


class JournalError(RuntimeError):
    pass


def _crc(body: str) -> str:
    return f"{isal_zlib.crc32(body.encode()):08x}"


def _parse(line: bytes) -> dict | None:
    """The entry of one line, or None when the line is not whole (torn, or its checksum fails)."""
    try:
        doc = json.loads(line)
        body = json.dumps(doc["entry"], sort_keys=True, ensure_ascii=False)
    except (ValueError, KeyError, TypeError):
        return None
    return doc["entry"] if doc.get("crc") == _crc(body) else None


class Journal:
    """Entries keyed by `entry["key"]`; `append` makes one durable before it returns."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.entries: dict[str, dict] = {}
        whole = self._read()
        self._file = open(self.path, "ab")
        if self._file.tell() != whole:
            logger.warning("%s: dropping a torn last line (%d bytes) left by a killed job",
                           self.path, self._file.tell() - whole)
            self._file.truncate(whole)
            self._file.seek(whole)
            os.fsync(self._file.fileno())

    def _read(self) -> int:
        """Load every whole line; return the byte offset just after the last one. Only the bytes after
        the last newline can be torn (a line and its newline are one write)."""
        if not self.path.exists():
            return 0
        data = self.path.read_bytes()
        *lines, tail = data.split(b"\n")
        for number, line in enumerate(lines, 1):
            entry = _parse(line)
            if entry is None:
                raise JournalError(
                    f"{self.path}: line {number} is damaged (not JSON, or its checksum does not hold) "
                    f"but is not the last line, so no kill left it: the file was changed. Delete the "
                    f"journal to generate this shard's responses again."
                )
            self.entries[entry["key"]] = entry
        return len(data) - len(tail)

    def append(self, entry: dict) -> None:
        body = json.dumps(entry, sort_keys=True, ensure_ascii=False)
        line = json.dumps({"crc": _crc(body), "entry": entry}, sort_keys=True, ensure_ascii=False)
        self._file.write(line.encode() + b"\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self.entries[entry["key"]] = entry

    def close(self) -> None:
        self._file.close()
