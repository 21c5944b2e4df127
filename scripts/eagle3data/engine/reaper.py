"""Every process a job starts dies with it: a small watchdog beside each process that owns vLLM engines.

vLLM starts its engine core and workers as child processes. When their parent dies they are re-parented
to init and keep running, holding memory and GPUs: a regenerate job stopped with SIGTERM left them busy,
and SIGTERM to the whole process group left the engine core alive. They cannot be made to follow their
parent from inside: vLLM starts them itself (spawned interpreters, out of our reach for
`prctl(PR_SET_PDEATHSIG)`), and a parent-death signal fires when the *thread* that forked exits, not the
process. So the watching is done from outside, by a process nobody else signals:

`guard()` starts `python -m eagle3data.engine.reaper PID` in a session of its own (a signal to the job's
process group does not reach it) that ignores SIGINT, SIGTERM and SIGHUP. Every POLL_S it adds to its
list the watched process's descendants that share the watched process's session (pid and start time,
so a reused pid is never mistaken for one of them); once the watched process is gone, whatever ended it
(SIGTERM, SIGINT, SIGKILL, a crash, or a normal exit that left a straggler), it sends SIGTERM to those of
its list still alive and still in the job's session (vLLM's engine core then shuts its workers down),
SIGKILLs what is left after GRACE_S, logs each step to the job's log (it inherits the job's stderr) and
exits. Descendants in a session of their own are not its business: the engine server (engine/server.py) starts its own session because
it outlives the job that started it by design, and guards its own engine.

`guard()` also logs SIGINT, SIGTERM and SIGHUP in the job itself before letting the signal end it, so the
job's log says how it ended.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

POLL_S = 0.2  # how often the reaper looks at the watched process and its descendants
GRACE_S = 3.0  # between the SIGTERM to the processes left behind and the SIGKILL of those still alive
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def guard(label: str) -> subprocess.Popen:
    """Start the reaper for this process; log the stop signals it receives. `label` names it in logs."""
    reaper = subprocess.Popen(
        [sys.executable, "-m", "eagle3data.engine.reaper", str(os.getpid()), label],
        stdin=subprocess.DEVNULL, start_new_session=True,
    )
    for sig in STOP_SIGNALS:
        signal.signal(sig, _log_and_die)
    return reaper


def _log_and_die(signum: int, frame) -> None:
    """Say which signal stopped this process, then let it end the process as it would have."""
    _say(f"process {os.getpid()} received {signal.Signals(signum).name}: exiting; its reaper stops the "
         f"processes it started")
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _say(message: str) -> None:
    sys.stderr.write(f"{time.strftime('%H:%M:%S')} [eagle3data.engine.reaper] {message}\n")
    sys.stderr.flush()


def _running(process) -> bool:
    import psutil

    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _in_session(process, session: int) -> bool:
    try:
        return os.getsid(process.pid) == session
    except ProcessLookupError:
        return False


def _describe(process) -> str:
    try:
        return f"{process.pid} ({process.name()})"
    except Exception:
        return str(process.pid)


def watch(pid: int, label: str) -> None:
    """Watch `pid` until it is gone, then stop the descendants it left (module docstring)."""
    import psutil

    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    try:
        watched = psutil.Process(pid)
        session = os.getsid(pid)
    except (psutil.NoSuchProcess, ProcessLookupError):
        return
    seen: dict[tuple[int, float], psutil.Process] = {}
    while True:
        try:
            children = watched.children(recursive=True)
            alive = watched.is_running() and watched.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            children, alive = [], False
        for child in children:
            try:
                if os.getsid(child.pid) == session:
                    seen.setdefault((child.pid, child.create_time()), child)
            except (psutil.NoSuchProcess, ProcessLookupError):
                continue
        if not alive:
            break
        time.sleep(POLL_S)
    # The session is asked again: a child seen between its fork and its own setsid() (the engine server,
    # on a loaded machine) carried the job's session then and not now.
    left = {p: _describe(p) for p in seen.values() if _running(p) and _in_session(p, session)}
    if not left:
        return
    _say(f"{label} (pid {pid}) is gone; stopping the {len(left)} processes it left: "
         f"{', '.join(left.values())}")
    for process in left:
        try:
            process.terminate()
        except psutil.NoSuchProcess:
            pass
    _, survivors = psutil.wait_procs(list(left), timeout=GRACE_S)
    for process in survivors:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    if survivors:
        psutil.wait_procs(survivors, timeout=GRACE_S)
        _say(f"killed {', '.join(left[p] for p in survivors)}: still alive {GRACE_S:.0f} s after SIGTERM")
    _say(f"every process {label} (pid {pid}) left is gone")


if __name__ == "__main__":
    watch(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "process")
