"""The tail stages' Snakemake jobs (validate, pack_shard, pack) run in children of a warm process.

Each of those jobs used to be a fresh Python process that spent ~1.5 s here (2-3 s on the H200's VM)
importing pandas, pandera and `datasets` before well under a second of work, and after the last shard is
extracted three of them run one after another: their imports were half of figure 7's tail. Now a job's
script hands the job to a server on its node that imported those modules once (`PRELOAD`), and the
server forks a child that runs it:

- the child gets the job's stdin, stdout and stderr (passed over the socket), working directory,
  environment and arguments, and runs in a process group of its own; the job's own process waits,
  forwards the signals it gets (SIGTERM from Snakemake or SLURM) and exits with the child's status (or
  dies of the same signal); Snakemake sees the job as before, only its benchmark file's memory and CPU
  columns count the waiting process alone;
- if the job's process dies (kill -9, or its run's process group killed), the child is killed at once,
  so nothing of a killed run goes on writing;
- where no server answers, the job runs in its own process as before and starts one for the jobs that
  follow. Only local runs start one: under SLURM a job's processes end with it.

A server serves one interpreter, one version of this package's code and one environment (its key,
`server_key`), so a changed file or setting never runs in a stale process; it exits after IDLE_S
(`EAGLE3DATA_WARM_IDLE_S`) without a job. `EAGLE3DATA_WARM_JOBS=0` runs every job in its own process.
This module imports only the standard library: it is what a job's process loads.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

IDLE_S = float(os.environ.get("EAGLE3DATA_WARM_IDLE_S", 120))  # a server exits after this long without a job
ROOT = Path(tempfile.gettempdir()) / f"eagle3data-warm-{os.getuid()}"  # each user's own servers
PRELOAD = ("eagle3data.rule_jobs", "snakemake.iocontainers", "snakemake.logging")  # what a job imports
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
RUN_GROUP_ENV = "EAGLE3DATA_RUN_GROUP"  # in a child: the process group of the job's own process
_LENGTH = struct.Struct("!Q")
_NUMBER = struct.Struct("!q")  # the child's pid, then its exit code (negative: the signal that killed it)


def run(target: str, job) -> None:
    """Run `target` ("module:function") on Snakemake's `job` object in a child of this node's warm server
    (this process exits with the child's status), or here when none answers."""
    if os.environ.get("EAGLE3DATA_WARM_JOBS") == "0":
        call(target, job)
        return
    key = server_key()
    connection = _connect(key)
    code = None if connection is None else _run_in_child(connection, target, job)
    if code is None:  # no server, or one that closed before it took the job: nothing ran yet
        if connection is None and not os.environ.get("SLURM_JOB_ID"):
            _start_server(key)
        call(target, job)
        return
    _exit_like(code)


def call(target: str, job) -> None:
    module, _, function = target.partition(":")
    getattr(importlib.import_module(module), function)(job)


def server_key() -> str:
    """The interpreter, the package's code (each file's name, size and modification time) and the
    environment, hashed."""
    digest = hashlib.sha256(sys.executable.encode())
    package = Path(__file__).resolve().parent
    for path in sorted(package.rglob("*.py")):
        stat = path.stat()
        digest.update(f"{path.relative_to(package)} {stat.st_size} {stat.st_mtime_ns}\n".encode())
    digest.update(repr(sorted(os.environ.items())).encode())
    return digest.hexdigest()[:16]


def _paths(key: str) -> tuple[Path, Path, Path]:
    ROOT.mkdir(parents=True, exist_ok=True, mode=0o700)
    return ROOT / f"{key}.sock", ROOT / f"{key}.lock", ROOT / f"{key}.log"


def _short_address(path: Path, use) -> None:
    """`use(address)` with a socket address for `path` that fits AF_UNIX's 108 bytes however long
    TMPDIR is: the path through a descriptor of its directory (Linux's /proc/self/fd)."""
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        use(f"/proc/self/fd/{directory}/{path.name}")
    finally:
        os.close(directory)


def _connect(key: str) -> socket.socket | None:
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        _short_address(_paths(key)[0], connection.connect)
        return connection
    except OSError:
        connection.close()
        return None


def _start_server(key: str) -> None:
    """Start a server for `key` in the background unless one holds its lock (starting or serving)."""
    try:
        _, lock_path, log_path = _paths(key)
        with open(lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held (BlockingIOError), or no room or right to start one: the jobs run as they are
        return
    with open(log_path, "ab") as log:
        subprocess.Popen([sys.executable, "-m", "eagle3data.warm_jobs", key], stdin=subprocess.DEVNULL,
                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd="/")


def _recv_exactly(connection: socket.socket, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _standard_fds() -> list[int]:
    """This process's stdin, stdout and stderr, each replaced by /dev/null where it is closed."""
    fds = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
            fds.append(fd)
        except OSError:
            fds.append(os.open(os.devnull, os.O_RDWR))
    return fds


def _run_in_child(connection: socket.socket, target: str, job) -> int | None:
    """Hand the job to the server's child; its exit code, or None when the server took nothing."""
    request = pickle.dumps({"target": target, "job": job, "cwd": os.getcwd(), "env": dict(os.environ),
                            "argv": sys.argv, "path": sys.path, "group": os.getpgrp()})
    try:
        socket.send_fds(connection, [_LENGTH.pack(len(request))], _standard_fds())
        connection.sendall(request)
        started = _recv_exactly(connection, _NUMBER.size)
    except OSError:
        started = None
    if started is None:
        return None
    for number in FORWARDED:
        signal.signal(number, lambda received, _: connection.send(bytes([received])))
    ended = _recv_exactly(connection, _NUMBER.size)
    if ended is None:
        raise SystemExit(f"the warm job server's child {_NUMBER.unpack(started)[0]} running {target} was "
                         f"lost (its server was killed?); the job did not finish")
    return _NUMBER.unpack(ended)[0]


def _exit_like(code: int) -> None:
    if code < 0:
        if -code in FORWARDED:  # the handler that forwarded it
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    raise SystemExit(code if code >= 0 else 128 - code)


def serve(key: str) -> None:
    """The server: import PRELOAD, then fork a supervisor per job until IDLE_S pass without one."""
    sock_path, lock_path, _ = _paths(key)
    lock = open(lock_path, "a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return  # another server of this key started first
    for module in PRELOAD:
        importlib.import_module(module)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock_path.unlink(missing_ok=True)  # a dead server's (this one holds the key's lock)
    _short_address(sock_path, listener.bind)
    listener.listen(64)
    listener.settimeout(IDLE_S)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # supervisors are reaped by the kernel
    print(f"warm job server {os.getpid()} for key {key} ready: {', '.join(PRELOAD)} imported", flush=True)
    while True:
        try:
            connection, _ = listener.accept()
        except TimeoutError:
            break
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            try:
                connection.settimeout(None)
                _supervise(connection)
            finally:
                os._exit(0)
        connection.close()
    sock_path.unlink(missing_ok=True)
    print(f"warm job server {os.getpid()}: {IDLE_S:.0f} s without a job, exiting", flush=True)


def _supervise(connection: socket.socket) -> None:
    """In a fork of the server: take one job, fork its child, relay signals to it and its status back;
    kill it if the job's process goes away."""
    header, fds, _, _ = socket.recv_fds(connection, _LENGTH.size, 3)
    body = _recv_exactly(connection, _LENGTH.unpack(header)[0]) if len(header) == _LENGTH.size else None
    if body is None or len(fds) != 3:
        return
    request = pickle.loads(body)
    pid = os.fork()
    if pid == 0:
        connection.close()
        _run_job(request, fds)
    os.setpgid(pid, pid)  # as the child does itself: whichever runs first
    for fd in fds:
        os.close(fd)
    connection.sendall(_NUMBER.pack(pid))
    child = os.pidfd_open(pid)
    while True:
        ready, _, _ = select.select([connection, child], [], [])
        if child in ready:
            _, status = os.waitpid(pid, 0)
            connection.sendall(_NUMBER.pack(os.waitstatus_to_exitcode(status)))
            return
        received = connection.recv(1)
        if not received:  # the job's process is gone: so is its job
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return
        os.killpg(pid, received[0])


def _run_job(request: dict, fds: list[int]) -> None:
    """In the job's child: take on the job's descriptors, directory and environment, run it, exit."""
    code = 1
    try:
        os.setpgid(0, 0)
        for number, fd in enumerate(fds):
            os.dup2(fd, number)
        for fd in set(fds) - {0, 1, 2}:
            os.close(fd)
        for number in FORWARDED:
            signal.signal(number, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"], **{RUN_GROUP_ENV: str(request["group"])})
        sys.argv, sys.path[:] = request["argv"], request["path"]
        call(request["target"], request["job"])
        code = 0
    except SystemExit as exit_:
        if isinstance(exit_.code, str):
            print(exit_.code, file=sys.stderr)
        code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
    except KeyboardInterrupt:  # as Python does: the traceback, then dying of the SIGINT
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    serve(sys.argv[1])
