"""The `extract` stage: states for every sample of a tokenized shard, reusing finished ones.

Per-sample files live in the store (the job's `Store`, storage/store.py), outside Snakemake's outputs, so a
failed or killed job loses nothing: a re-run reads the store, reuses each sample whose file is whole and
matches its tokens, and starts the engine only if something is left to compute. A sample that fails (its reply
or file does not match) does not stop the others: its file is removed, and once the shard is done the job
fails naming every failed sample with its reason, also recorded beside the manifest (failed_samples.py).
The shard's manifest is written last, only when every sample succeeded.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from tqdm import tqdm

from eagle3data.plan import disk
from eagle3data.plan.shards import spread
from eagle3data.engine import pool as engine_pool
from eagle3data.capture import failed_samples
from eagle3data.engine import start as engine_mod
from eagle3data.utils.logs import get_logger
from eagle3data.contracts.schemas import BoundaryError, ExtractManifest, TokenizedShard, check
from eagle3data.contracts.states import Expected, file_facts, judge_files
from eagle3data.storage.store import Store, atomic_path, atomic_write_text, start_syncing
from eagle3data.utils import faults
from eagle3data.capture.watcher import StatesWatcher

logger = get_logger(__name__)


@dataclass
class ExtractJob:
    tokenized: str
    manifest: str
    stats: str
    store: Store
    model_path: str
    trust_remote_code: bool
    expected: Expected
    max_seq_len: int
    engine: engine_mod.EngineSettings
    input_shape: disk.InputShape | None = None  # None: this shard is the whole input
    gpus: int = 0  # the job's `gpu` resource: what an engine server it starts claims
    parity_samples: int = 0  # computed samples whose next-token log-probabilities the engine returns

    @property
    def run_dir(self) -> Path:
        return Path(self.manifest).parents[1]

    @property
    def shard_name(self) -> str:
        return Path(self.tokenized).name.split(".")[0]


def check_reply(sample_id: str, reply, expected_path: str) -> None:
    """What comes back from the engine for one request must be the path we asked the worker to write."""
    if not isinstance(reply, dict):
        raise BoundaryError(
            f"sample {sample_id}: engine reply kv_transfer_params: expected a dict with "
            f"'hidden_states_path', found {type(reply).__name__}: {reply!r:.200}"
        )
    found = reply.get("hidden_states_path")
    if found != expected_path:
        raise BoundaryError(
            f"sample {sample_id}: engine wrote states to {found!r}, expected {expected_path!r}"
        )


def reuse_or_clear(job: ExtractJob, shard: pd.DataFrame) -> tuple[list, list]:
    """(manifest rows of the samples whose stored file is whole and holds their tokens, rows to compute).

    Files dropped once packed (storage.drop_packed_states) the store gives back first (`Store.ensure`).
    A stored file that does not match (tokens changed with max_seq_len or the template, or the file is
    damaged) is removed first: the watcher must see only the file the engine writes for this run.
    """
    paths = {sample_id: job.store.path(sample_id) for sample_id in shard["sample_id"]}
    job.store.ensure(shard["sample_id"])
    stored = [row for row in shard.itertuples(index=False) if paths[row.sample_id].exists()]
    problems = judge_files([file_facts(r.sample_id, str(paths[r.sample_id]), r.input_ids) for r in stored], job.expected)
    stored_ids = {row.sample_id for row in stored}
    manifest, todo, stale = [], [], 0
    for row in shard.itertuples(index=False):
        path = paths[row.sample_id]
        if row.sample_id not in stored_ids:
            todo.append(row)
        elif row.sample_id in problems:
            path.unlink(missing_ok=True)
            todo.append(row)
            stale += 1
        else:
            manifest.append((row.sample_id, row.num_tokens, str(path), "reused"))
    logger.info(
        "shard %s: %d samples, %d reused from the store, %d to compute (%d stored files no longer "
        "matched their samples and were removed)", job.tokenized, len(shard), len(manifest), len(todo), stale,
    )
    return manifest, todo


# The steps whose seconds make up a job's `seconds` (its tokens/s), each `<step>_seconds` in its stats.
# The engine's start is recorded beside them (`engine_start_seconds`), not among them.
TIMED_STEPS = ("generate", "replies", "files", "durable")


def run(job: ExtractJob) -> dict:
    preparing = time.perf_counter()
    shard = check(TokenizedShard, pd.read_parquet(job.tokenized), f"tokenized shard {job.tokenized}")
    manifest, todo = reuse_or_clear(job, shard)
    check_disk(job, shard, todo)
    # Before the engine: while a job prepares, the GPUs it holds wait, so its stats say for how long.
    prepare_seconds = time.perf_counter() - preparing
    failed: dict[str, str] = {}
    steps = dict.fromkeys(TIMED_STEPS, 0.0)
    began = time.perf_counter()
    job.store.make_durable([Path(path) for _, _, path, _ in manifest])  # reused files too: a killed run wrote them
    steps["durable"] += time.perf_counter() - began
    files_after_generate, engine = 0, {"engine_start_seconds": 0.0}
    log_probs: dict[str, list[float]] = {}
    try:
        if todo:
            files_after_generate, engine = _compute(job, todo, failed, steps, log_probs)
    finally:  # what failed is on record even when the job dies after it
        if failed:
            failed_samples.write(job.manifest, job.tokenized, failed, len(shard), len(manifest))
    if failed:
        message = failed_samples.describe(job.manifest, job.tokenized, failed, len(shard))
        raise failed_samples.SampleFailures(message)
    failed_samples.clear(job.manifest)
    manifest += [(r.sample_id, r.num_tokens, str(job.store.path(r.sample_id)), "computed")
                 for r in todo]
    seconds = sum(steps.values())
    computed_tokens = int(sum(r.num_tokens for r in todo))
    stats = {
        "samples": len(shard),
        "reused": len(shard) - len(todo),
        "computed": len(todo),
        "computed_tokens": computed_tokens,
        "seconds": seconds,
        "tokens_per_second": computed_tokens / seconds if computed_tokens else None,
        **{f"{step}_seconds": value for step, value in steps.items()},
        "files_to_come_after_generate": files_after_generate,
        "prepare_seconds": prepare_seconds,
        **engine,
        "parity_log_probs": log_probs,
    }
    df = pd.DataFrame(manifest, columns=["sample_id", "num_tokens", "path", "status"])
    df = check(ExtractManifest, df, f"extract manifest for {job.tokenized}")
    with atomic_path(job.manifest) as tmp:
        df.to_parquet(tmp, index=False)
    atomic_write_text(job.stats, json.dumps(stats, indent=2))
    logger.info("shard %s done: %s", job.tokenized, {k: v for k, v in stats.items() if k != "parity_log_probs"})
    return stats


def run_alone(job: ExtractJob) -> dict:
    """`run` outside a Snakemake run (the benchmark and crosscheck tools): no onsuccess stops the engine
    this one job started, which would otherwise idle for keep_alive_s holding memory or GPUs."""
    try:
        return run(job)
    finally:
        engine_pool.stop_idle_of_run(str(job.run_dir))


def check_disk(job: ExtractJob, shard: pd.DataFrame, todo: list) -> None:
    """Print the expected output size; refuse to start when the store's disk lacks room for it (and a
    transport directory, storage.transport_dir, for this shard's files: they leave it once packed)."""
    shape = job.input_shape or disk.InputShape(len(shard), len(shard), ((0, len(shard)),))
    finished = disk.finished_conversations(job.manifest, shape.plan) if job.input_shape else 0
    size = disk.estimate(shard["num_tokens"].tolist(), [r.num_tokens for r in todo], job.expected,
                         job.max_seq_len, shape, finished)
    logger.info("shard %s: %s", job.tokenized, size.describe(shape.input_conversations))
    if todo:
        job.store.check_room_for_samples(size.remaining_bytes, size.todo_bytes)


def _compute(job: ExtractJob, todo: list, failed: dict[str, str], steps: dict[str, float],
             log_probs: dict[str, list[float]]) -> tuple[int, dict]:
    """Compute `todo` on an engine of the node (engine/pool.py: a free one with these settings, else one
    this job starts); each sample that fails goes to `failed` (id -> reason), file removed. Adds to
    `steps` the seconds of generate() and of checking its replies, of waiting for the shard's last files
    and checking them, and of making every computed file durable; the engine is handed back when the
    last generate() returns, so the next shard's prefill overlaps this one's last files and fsyncs.
    Returns how many files were still to come when the last generate() returned (how far the writes
    trailed the engine) and the engine's stats (engine_stats; the wait for the engine is kept out of
    `steps`: tokens/s is the running engine's). The engine's next-token log-probabilities of
    `job.parity_samples` samples spread over `todo` go to `log_probs` (the parity gate's witness)."""
    starting = time.perf_counter()
    engine = engine_pool.acquire(
        engine_mod.engine_kwargs(
            job.model_path, job.expected.captures, job.expected.dtype, job.max_seq_len, job.engine,
            job.trust_remote_code, os.path.abspath(job.store.samples),
        ),
        job.engine.cpu_kv_cache_gib, [c.__dict__ for c in job.expected.captures], job.engine.keep_alive_s,
        job.gpus, str(job.run_dir), job.shard_name,
    )
    try:
        engine.check_prompt_fits(max(r.num_tokens for r in todo))
        shards_served = engine.begin_shard(job.shard_name)
        waited, ready_at = time.perf_counter() - starting, time.time()
        to_come, whole, syncing = _run_batches(job, engine, todo, failed, steps, log_probs)
    finally:
        engine.close()  # its files have landed (or the job failed): nothing of this job is in flight
    stats = engine_stats(engine, waited, ready_at, shards_served)
    logger.info("engine %s on %s: %s", engine.entry.id, engine.entry.node, stats)
    began = time.perf_counter()
    job.store.make_durable(whole, syncing)
    steps["durable"] += time.perf_counter() - began
    return to_come, stats


def engine_stats(engine: engine_pool.RemoteEngine, waited: float, ready_at: float, shards_served: int) -> dict:
    """What the report sums per node: which engine served the job, whether this job loaded it (and so
    waited for its load), and how many shards it had served; when (epoch seconds) the engine was ready
    for this job, from which a run is timed from its engine ready."""
    return {
        "engine_start_seconds": waited,
        "engine_ready_at": ready_at,
        "engine_id": engine.entry.id,
        "engine_node": engine.entry.node,
        "engine_loaded_here": engine.loaded_here,
        "engine_load_seconds": engine.entry.start_seconds,
        "engine_shards_served": shards_served,
    }


def _run_batches(job: ExtractJob, engine: engine_pool.RemoteEngine, todo: list, failed: dict[str, str],
                 steps: dict[str, float], log_probs: dict[str, list[float]]) -> tuple[int, list, object]:
    """generate() batch after batch, each as soon as the last returned, replies checked; the watcher
    (watcher.py) checks the files as they land. Returns the files still to come after the last
    generate(), and for make_durable the whole files and the sync of those found whole early
    (`store.start_syncing`)."""
    batch = job.engine.batch_samples
    witnessed = {r.sample_id for r in spread(todo, job.parity_samples)}
    progress = tqdm(total=len(todo), desc="extract", unit="sample", mininterval=5)
    with StatesWatcher(job.expected) as watcher:
        for start in range(0, len(todo), batch):
            rows = todo[start : start + batch]
            paths = [job.store.path(r.sample_id) for r in rows]
            prompts = [[int(t) for t in r.input_ids] for r in rows]
            watcher.expect(rows, paths)
            began = time.perf_counter()
            # Absolute: the engine may have been started from another job's directory (the paths
            # recorded stay relative to the run's, which can move); the key above holds the directory.
            asked = [os.path.abspath(p) for p in paths]
            replies, next_token = engine.generate(prompts, asked, [r.sample_id in witnessed for r in rows])
            generated = time.perf_counter()
            if len(replies) != len(rows):
                raise BoundaryError(f"engine returned {len(replies)} outputs for {len(rows)} prompts")
            log_probs.update({r.sample_id: lp for r, lp in zip(rows, next_token) if lp is not None})
            for row, path, absolute, reply in zip(rows, paths, asked, replies):
                try:
                    check_reply(row.sample_id, reply, absolute)
                except BoundaryError as exc:
                    watcher.drop(row.sample_id)
                    _fail(row.sample_id, str(exc), path, failed)
            faults.point("extract:batch_done")
            steps["generate"] += generated - began
            steps["replies"] += time.perf_counter() - generated
            progress.update(len(rows))
        engine.hand_back()  # the next shard's job may start its prefill while this one's last files land
        began = time.perf_counter()
        syncing, to_come = start_syncing(watcher.whole()), watcher.pending()
        problems = watcher.finish(job.engine.file_timeout_s)
    steps["files"] += time.perf_counter() - began
    logger.info("%d of %d files were still to come when the last generate() returned; they took %.2f s",
                to_come, len(todo), steps["files"])
    for sample_id, reasons in problems.items():
        _fail(sample_id, "\n".join(reasons), job.store.path(sample_id), failed)
    progress.close()
    return to_come, watcher.whole(), syncing.result()


def _fail(sample_id: str, reason: str, path: Path, failed: dict[str, str]) -> None:
    """Record a failed sample and remove its file: never reused, the next run computes it again."""
    failed[sample_id] = reason
    path.unlink(missing_ok=True)
    logger.error("%s", reason)
