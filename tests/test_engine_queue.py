"""Queued extract jobs take the engine with the most tokens to compute first (eagle3data.engine_queue):
places are files in a directory, and a place whose process is gone does not hold up the queue."""

from __future__ import annotations

import subprocess
import sys

from eagle3data import engine_queue

KEY = "0123456789abcdef"


def test_the_job_with_the_most_tokens_goes_first_and_of_equal_ones_the_earliest(tmp_path):
    small = engine_queue.join(tmp_path, KEY, 10)
    large = engine_queue.join(tmp_path, KEY, 30)
    large_later = engine_queue.join(tmp_path, KEY, 30)
    other_engine = engine_queue.join(tmp_path, "fedcba9876543210", 99)  # queued for an engine of other settings
    assert [engine_queue.first(tmp_path, KEY, p) for p in (small, large, large_later)] == [False, True, False]
    assert engine_queue.first(tmp_path, "fedcba9876543210", other_engine)
    assert engine_queue.anyone_with_more(tmp_path, KEY, 29) and not engine_queue.anyone_with_more(tmp_path, KEY, 30)
    engine_queue.leave(large)  # it took the engine
    assert [engine_queue.first(tmp_path, KEY, p) for p in (small, large_later)] == [False, True]
    engine_queue.leave(large_later)
    assert engine_queue.first(tmp_path, KEY, small)
    engine_queue.leave(small)
    assert sorted(p.name for p in tmp_path.iterdir()) == [other_engine.path.name]


def test_a_place_left_by_a_killed_job_is_ignored_and_removed_one_of_a_live_job_counts(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    live = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        dead_place = tmp_path / f"{KEY}.1000.1.{gone.pid}{engine_queue.SUFFIX}"
        live_place = tmp_path / f"{KEY}.500.2.{live.pid}{engine_queue.SUFFIX}"
        dead_place.touch()
        live_place.touch()
        mine = engine_queue.join(tmp_path, KEY, 100)
        assert not engine_queue.first(tmp_path, KEY, mine)  # the live job has more to compute
        assert not dead_place.exists()  # and the killed one's place is gone
        assert engine_queue.anyone_with_more(tmp_path, KEY, 499) and not engine_queue.anyone_with_more(tmp_path, KEY, 500)
    finally:
        live.communicate(b"")
    assert engine_queue.first(tmp_path, KEY, mine)  # its process ended: its place no longer counts
    assert not live_place.exists()
