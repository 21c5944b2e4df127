"""Each states file checked as soon as vLLM's worker renames it into place (a file that exists is
whole), on a thread of its own, while the engine computes the next samples.

The extract job hands each batch's samples to the watcher and starts the next generate() at once: it
waits for files and checks only once, for the shard's last few files, instead of after every batch.
Nothing is fsynced here: fsyncs file by file beside vLLM's writes fell behind them (measured: 0.74 s
left to wait for after 25 s of prefill); the extract job syncs the files in bulk instead (storage/store.py).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from eagle3data.contracts.states import Expected, file_facts, judge_files
from eagle3data.utils import faults

POLL_SECONDS = 0.005


class StatesWatcher:
    """`with StatesWatcher(expected) as watcher:` then `watcher.expect(rows, paths)` per batch (rows with
    `sample_id` and `input_ids`), `watcher.drop(sample_id)` for a sample failed elsewhere, and
    `watcher.finish(timeout_s)`: sample id -> problems, for every expected sample whose file is wrong
    or did not come."""

    def __init__(self, expected: Expected):
        self.expected = expected
        self._pending: dict[str, tuple[object, Path]] = {}
        self._problems: dict[str, list[str]] = {}
        self._whole: dict[str, Path] = {}  # sample id -> path, each file checked and found whole
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._watch, name="eagle3data-states-watcher", daemon=True)

    def __enter__(self) -> StatesWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def expect(self, rows: list, paths: list[Path]) -> None:
        with self._lock:
            self._pending.update({row.sample_id: (row, Path(path)) for row, path in zip(rows, paths)})

    def drop(self, sample_id: str) -> None:
        """Forget a sample that failed elsewhere: never judged."""
        with self._lock:
            self._pending.pop(sample_id, None)
            self._problems.pop(sample_id, None)
            self._whole.pop(sample_id, None)

    def whole(self) -> list[Path]:
        """The files checked and found whole so far."""
        with self._lock:
            return list(self._whole.values())

    def pending(self) -> int:
        """How many expected files have not landed or not been checked yet."""
        with self._lock:
            return len(self._pending)

    def finish(self, timeout_s: float) -> dict[str, list[str]]:
        """Wait until every expected file has landed and been checked, or `timeout_s` has passed (the
        rest did not come); sample id -> problems."""
        deadline = time.monotonic() + timeout_s
        while self._pending and self._error is None and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS)
        if self._error is not None:
            raise self._error
        with self._lock:
            for sample_id, (_, path) in self._pending.items():
                self._problems[sample_id] = [f"sample {sample_id}: the engine did not write {path} within "
                                             f"{timeout_s:.0f} s of its last generate() returning"]
            self._pending.clear()
            return dict(self._problems)

    def _watch(self) -> None:
        try:
            while not self._stop.wait(POLL_SECONDS):
                with self._lock:
                    landed = [(sid, row, path) for sid, (row, path) in self._pending.items() if path.exists()]
                if landed:
                    self._check(landed)
        except BaseException as exc:  # raised in the job's thread by finish()
            self._error = exc

    def _check(self, landed: list) -> None:
        facts = [file_facts(sid, str(path), row.input_ids) for sid, row, path in landed]
        problems = judge_files(facts, self.expected)
        for sample_id, _, _ in landed:
            try:
                faults.point(f"landed:{sample_id}")
            except faults.Injected as exc:
                problems.setdefault(sample_id, []).append(f"sample {sample_id}: {exc}")
        with self._lock:
            for sample_id, _, path in landed:
                if self._pending.pop(sample_id, None) is None:
                    continue  # dropped meanwhile
                if sample_id in problems:
                    self._problems[sample_id] = problems[sample_id]
                else:
                    self._whole[sample_id] = path
