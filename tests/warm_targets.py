"""Jobs for tests/test_warm_jobs.py: each takes the one argument a warm server's child passes."""

from __future__ import annotations

import json
import os
import signal
import sys
import time


def report(job) -> None:
    """What the job runs as: its process, directory, environment and the input it reads."""
    print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "group": os.getpgrp(), "cwd": os.getcwd(),
                      "marker": os.environ.get("WARM_TEST_MARKER"), "stdin": sys.stdin.read(), "job": job}))
    print("on stderr", file=sys.stderr)


def exit_with(code) -> None:
    raise SystemExit(code)


def fail(message) -> None:
    raise ValueError(message)


def kill_self(number) -> None:
    os.kill(os.getpid(), number)


def sleep_until_killed(pid_file) -> None:
    with open(pid_file + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(pid_file + ".tmp", pid_file)
    while True:
        time.sleep(1)
