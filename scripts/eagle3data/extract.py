"""The `extract` stage: states for every sample of a tokenized shard, reusing finished ones.

Per-sample files live in the store (store.py), outside Snakemake's outputs, so a failed or killed job
loses nothing: a re-run reads the store, reuses each sample whose file is whole and matches its tokens,
and starts the engine only if something is left to compute. A sample that fails (its reply or file does
not match, or `testing.fail_samples` lists it) does not stop the others: its file is removed, and once
the shard is done the job fails naming every failed sample with its reason, also recorded beside the
manifest (failed_samples.py). The shard's manifest is written last, only when every sample succeeded.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from tqdm import tqdm

from eagle3data import disk, failed_samples
from eagle3data import engine as engine_mod
from eagle3data.logs import get_logger
from eagle3data.schemas import BoundaryError, ExtractManifest, TokenizedShard, check
from eagle3data.states import Expected, file_facts, judge_files
from eagle3data.store import atomic_path, atomic_write_text, make_durable, sample_path, start_syncing
from eagle3data.testing import kill_point
from eagle3data.watcher import StatesWatcher

logger = get_logger(__name__)


@dataclass
class ExtractJob:
    tokenized: str
    manifest: str
    stats: str
    store_dir: str
    model_path: str
    trust_remote_code: bool
    expected: Expected
    max_seq_len: int
    engine: dict
    input_shape: disk.InputShape | None = None  # None: this shard is the whole input
    storage: dict = field(default_factory=lambda: dict(disk.STORAGE_DEFAULTS))
    fail_samples: tuple[str, ...] = ()  # testing.fail_samples, a test-only hook (testing.py)


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

    A stored file that does not match (tokens changed with max_seq_len or the template, or the file is
    damaged) is removed first: the watcher must see only the file the engine writes for this run.
    """
    paths = {sample_id: sample_path(job.store_dir, sample_id) for sample_id in shard["sample_id"]}
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
    shard = check(TokenizedShard, pd.read_parquet(job.tokenized), f"tokenized shard {job.tokenized}")
    manifest, todo = reuse_or_clear(job, shard)
    check_disk(job, shard, todo)
    failed: dict[str, str] = {}
    steps = dict.fromkeys(TIMED_STEPS, 0.0)
    began = time.perf_counter()
    make_durable([Path(path) for _, _, path, _ in manifest])  # reused files too: a killed run wrote them
    steps["durable"] += time.perf_counter() - began
    files_after_generate, engine_start = 0, 0.0
    try:
        if todo:
            files_after_generate, engine_start = _compute(job, todo, failed, steps)
    finally:  # what failed is on record even when the job dies after it
        if failed:
            failed_samples.write(job.manifest, job.tokenized, failed, len(shard), len(manifest))
    if failed:
        message = failed_samples.describe(job.manifest, job.tokenized, failed, len(shard))
        raise failed_samples.SampleFailures(message)
    failed_samples.clear(job.manifest)
    manifest += [(r.sample_id, r.num_tokens, str(sample_path(job.store_dir, r.sample_id)), "computed")
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
        "engine_start_seconds": engine_start,
    }
    df = pd.DataFrame(manifest, columns=["sample_id", "num_tokens", "path", "status"])
    df = check(ExtractManifest, df, f"extract manifest for {job.tokenized}")
    with atomic_path(job.manifest) as tmp:
        df.to_parquet(tmp, index=False)
    atomic_write_text(job.stats, json.dumps(stats, indent=2))
    logger.info("shard %s done: %s", job.tokenized, stats)
    if todo:
        report_engine_start(engine_start, seconds, len(todo), job.input_shape)
    return stats


START_SHARE_GOAL = 0.1  # the share of an extract job's engine time that its start may take unremarked


def report_engine_start(start_s: float, compute_s: float, computed: int, shape: disk.InputShape | None) -> None:
    """Each extract job starts its own engine (20+ minutes for Kimi-K2.5): say what share of the job it
    took, and when it is more than START_SHARE_GOAL, the shard size that would bring it there."""
    share = start_s / max(start_s + compute_s, 1e-9)
    message = (f"the engine's start took {start_s:.0f} s, {share:.0%} of this job's engine time "
               f"({compute_s:.1f} s computing {computed} samples)")
    if share <= START_SHARE_GOAL:
        logger.info("%s", message)
        return
    per_sample = max(compute_s / computed, 1e-9)
    needed = int(start_s * (1 - START_SHARE_GOAL) / (START_SHARE_GOAL * per_sample)) + 1
    now = f"now {shape.shard_size}" if shape else "the whole input is one shard now"
    logger.warning("%s: each extract job starts its own engine, so a larger shard_size spreads its start "
                   "over more samples; at this job's pace, shard_size >= %d keeps it under %.0f%% (%s)",
                   message, needed, START_SHARE_GOAL * 100, now)


def check_disk(job: ExtractJob, shard: pd.DataFrame, todo: list) -> None:
    """Print the expected output size; refuse to start when the store's disk lacks room for it."""
    shape = job.input_shape or disk.InputShape(len(shard), len(shard), max(len(shard), 1))
    finished = disk.finished_conversations(job.manifest, shape.shard_size) if job.input_shape else 0
    size = disk.estimate(shard["num_tokens"].tolist(), [r.num_tokens for r in todo], job.expected,
                         job.max_seq_len, shape, finished)
    logger.info("shard %s: %s", job.tokenized, size.describe(shape.input_conversations))
    if todo:
        disk.check_free_space(job.store_dir, size.remaining_bytes, job.storage["reserve_gib"],
                              job.storage["check_free_space"])


def _compute(job: ExtractJob, todo: list, failed: dict[str, str], steps: dict[str, float]) -> int:
    """Compute `todo` in batches; each sample that fails goes to `failed` (id -> reason), file removed.
    Each batch's generate() starts as soon as the last one returned: the watcher (watcher.py) checks the
    files meanwhile. Adds to `steps` the seconds of generate() and of checking its replies, of waiting
    for the shard's last files and checking them (the files found whole before start syncing then:
    `store.start_syncing`), and of making every computed file durable. That last step runs before the
    engine stops, so that its clock holds the whole wait for the disk: during a shutdown (5 s on the
    H200) the disk would flush the shard's last gigabyte unseen. Returns how many files were still to
    come when the last generate() returned (how far the writes trailed the GPU), and the seconds the
    engine took to start (kept out of `steps`: tokens/s is the running engine's)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    starting = time.perf_counter()
    llm = engine_mod.start_engine(
        engine_mod.engine_kwargs(
            job.model_path, job.expected.captures, job.expected.dtype, job.max_seq_len, job.engine,
            job.trust_remote_code, job.store_dir,
        ),
        job.engine["cpu_kv_cache_gib"],
    )
    engine_mod.verify_engine(
        llm, job.expected.captures, job.expected.dtype, job.engine["tensor_parallel_size"]
    )
    engine_mod.check_prompt_fits(llm, max(r.num_tokens for r in todo))
    engine_start = time.perf_counter() - starting
    kill_point("extract:engine_ready")
    batch = job.engine["batch_samples"]
    progress = tqdm(total=len(todo), desc="extract", unit="sample", mininterval=5)
    with StatesWatcher(job.expected, job.fail_samples) as watcher:
        for start in range(0, len(todo), batch):
            rows = todo[start : start + batch]
            paths = [sample_path(job.store_dir, r.sample_id) for r in rows]
            prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in r.input_ids]) for r in rows]
            params = [
                SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {"hidden_states_path": str(p)}})
                for p in paths
            ]
            watcher.expect(rows, paths)
            began = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            generated = time.perf_counter()
            if len(outputs) != len(rows):
                raise BoundaryError(f"engine returned {len(outputs)} outputs for {len(rows)} prompts")
            for row, path, output in zip(rows, paths, outputs):
                try:
                    check_reply(row.sample_id, output.kv_transfer_params, str(path))
                except BoundaryError as exc:
                    watcher.drop(row.sample_id)
                    _fail(row.sample_id, str(exc), path, failed)
            kill_point("extract:batch_done")
            steps["generate"] += generated - began
            steps["replies"] += time.perf_counter() - generated
            progress.update(len(rows))
        began = time.perf_counter()
        syncing, to_come = start_syncing(watcher.whole()), watcher.pending()
        problems = watcher.finish(job.engine["file_timeout_s"])
    steps["files"] += time.perf_counter() - began
    logger.info("%d of %d files were still to come when the last generate() returned; they took %.2f s",
                to_come, len(todo), steps["files"])
    for sample_id, reasons in problems.items():
        _fail(sample_id, "\n".join(reasons), sample_path(job.store_dir, sample_id), failed)
    progress.close()
    began = time.perf_counter()
    make_durable(watcher.whole(), syncing.result())
    steps["durable"] += time.perf_counter() - began
    return to_come, engine_start


def _fail(sample_id: str, reason: str, path: Path, failed: dict[str, str]) -> None:
    """Record a failed sample and remove its file: never reused, the next run computes it again."""
    failed[sample_id] = reason
    path.unlink(missing_ok=True)
    logger.error("%s", reason)
