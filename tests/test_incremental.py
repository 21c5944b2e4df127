"""Re-runs after crashes, failed samples and changed inputs: nothing finished is computed twice.

Real workflow runs on the first 8 (or 12) demo conversations, one sample per engine call so that a kill
point counted in batches is a count of samples. Runs are killed with a test-only fault
(`EAGLE3DATA_FAULTS=kill@<point>`, eagle3data.utils.faults): at a named point the process group of the
whole run (snakemake, the job, vLLM's processes) gets SIGKILL, as in a node crash. A file's inode and
mtime change whenever it is written again (every write is a rename of a new file), so an unchanged
(inode, mtime) proves a finished sample was never computed again. Every resumed or retried run's dataset
must equal the uninterrupted run's under the reproducibility contract (eagle3data.validate.reproducibility).
Each engine start costs ~30 s here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import datasets
import pandas as pd
import pytest
import yaml
from conftest import DEMO_CONVERSATIONS, REPO, SNAKEMAKE, demo_config, run_snakemake, with_defaults
from safetensors import safe_open

from eagle3data.contracts.layers import eagle3_captures
from eagle3data import open_dataset
from eagle3data.validate.reproducibility import dataset_differences
from eagle3data.config.settings import Settings
from eagle3data.utils import faults

pytestmark = pytest.mark.slow

RUN = "results/t"
COUNTS = re.compile(r"(\d+) samples, (\d+) reused from the store, (\d+) to compute")


def small_config(model_path: Path, **overrides) -> dict:
    """The demo config on `conversations.jsonl` of the run directory, one sample per engine call;
    `overrides` replace top-level values and update sections."""
    config = demo_config(run="t", input="conversations.jsonl", shard_size=8,
                         model={"path": str(model_path), "build_demo": False}, engine={"batch_samples": 1})
    for key, value in overrides.items():
        config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
    return config


def new_run(workdir: Path, conversations: int) -> Path:
    """A run directory holding the first `conversations` demo conversations as its input."""
    workdir.mkdir(parents=True)
    lines = [line for line in DEMO_CONVERSATIONS.read_text().splitlines() if line.strip()]
    (workdir / "conversations.jsonl").write_text("\n".join(lines[:conversations]) + "\n")
    return workdir


def run_killed_at(workdir: Path, point: str) -> None:
    """The workflow as run_snakemake runs it, but in a session of its own (the hook kills the whole
    process group: run_snakemake's would include pytest), SIGKILLed at `point`; then --unlock, which a
    killed snakemake needs before the next run."""
    cmd = [*SNAKEMAKE, "-s", str(REPO / "Snakefile"), "--directory", str(workdir), "--cores", "2",
           "--configfile", str(workdir / "test-config.yaml")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", faults.ENV: f"kill@{point}"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=workdir, env=env,
                          start_new_session=True)
    log = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == -signal.SIGKILL, f"not killed at {point} (returncode {proc.returncode}):\n{log}"
    run_snakemake(workdir, "--unlock")


def stored(workdir: Path) -> dict[str, tuple[int, int]]:
    """Every finished states file of the store: its (inode, mtime)."""
    return {p.stem: (p.stat().st_ino, p.stat().st_mtime_ns)
            for p in (workdir / RUN / "states").rglob("*.safetensors")}


def temporary_files(workdir: Path) -> list[Path]:
    return [p for p in (workdir / RUN / "states").rglob(".*.tmp-*")]


def extract_log(workdir: Path, shard: str = "00000") -> str:
    return (workdir / RUN / f"logs/extract/shard-{shard}.log").read_text()


def extract_counts(workdir: Path, shard: str = "00000") -> tuple[int, int, int]:
    """(samples, reused, to compute) as the shard's last extract job logged them."""
    return tuple(int(n) for n in COUNTS.search(extract_log(workdir, shard)).groups())


def stats(workdir: Path, shard: str = "00000") -> dict:
    return json.loads((workdir / RUN / f"extract/shard-{shard}.stats.json").read_text())


def tokenized(workdir: Path, shard: str = "00000") -> pd.DataFrame:
    return pd.read_parquet(workdir / RUN / f"tokenized/shard-{shard}.parquet").set_index("sample_id")


def statuses(workdir: Path, shard: str = "00000") -> dict[str, str]:
    manifest = pd.read_parquet(workdir / RUN / f"extract/shard-{shard}.parquet")
    return dict(zip(manifest["sample_id"], manifest["status"]))


def dataset(workdir: Path):
    return datasets.load_from_disk(str(workdir / RUN / "dataset")).data.table


def assert_same_dataset(workdir: Path, reference: Path) -> None:
    """The same samples in the same order, with the same tokens and states (the contract: bitwise)."""
    problems = dataset_differences(open_dataset(workdir / RUN / "dataset"), open_dataset(reference / RUN / "dataset"))
    assert not problems, "differs from the uninterrupted run:\n" + "\n".join(problems)


def assert_unchanged(before: dict, after: dict) -> None:
    rewritten = sorted(s for s, stamp in before.items() if after.get(s) != stamp)
    assert not rewritten, f"finished samples written again: {rewritten}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_deepseek) -> Path:
    """An uninterrupted run over 8 conversations (one shard): what every other run must reproduce."""
    workdir = new_run(tmp_path_factory.mktemp("reference") / "run", 8)
    run_snakemake(workdir, config=small_config(tiny_deepseek))
    return workdir


@pytest.fixture
def reference_copy(reference, tmp_path) -> Path:
    """A private copy of the reference run, .snakemake included: Snakemake's params triggers read it."""
    return Path(shutil.copytree(reference, tmp_path / "run", symlinks=True))


# (kill point, finished samples in the store after the kill, given those before it). Each run starts
# where the last one died.
KILLS = [
    # Mid-shard: the third batch's (one sample's) generate() returned. The engine writes a request's file
    # at its next step, which the next batch's generate() runs: the second file is there, the third may be.
    ("extract:batch_done#3", lambda before: {2, 3}),
    # The worker writing this run's second file, under its temporary name.
    ("write:*.safetensors#2", lambda before: {before + 1}),
    ("write:*/extract/shard-00000.parquet", lambda before: {8}),  # every sample stored, manifest not renamed
    ("write:*/eagle3_metadata.json", lambda before: {8}),  # pack: data written, dataset not renamed into place
]


def test_runs_killed_anywhere_resume_to_the_uninterrupted_dataset(reference, tiny_deepseek, tmp_path):
    workdir = new_run(tmp_path / "run", 8)
    # keep_alive_s 0: the engine a killed run leaves stops at once instead of serving the next run (which
    # it would, loaded with the killed run's kill point), so each run loads an engine of its own.
    config = small_config(tiny_deepseek, engine={"batch_samples": 1, "keep_alive_s": 0})
    (workdir / "test-config.yaml").write_text(yaml.safe_dump(config))
    finished: dict = {}
    for point, finished_after in KILLS:
        run_killed_at(workdir, point)
        samples, reused, to_compute = extract_counts(workdir)
        # Every sample finished before this run was reused; only the rest was computed.
        assert (samples, reused, to_compute) == (8, len(finished), 8 - len(finished)), point
        assert ("starting vllm" in extract_log(workdir)) == (to_compute > 0), point
        now = stored(workdir)
        assert len(now) in finished_after(len(finished)), point
        assert_unchanged(finished, now)
        finished = now
        if point.startswith("write:*.safetensors"):
            assert len(temporary_files(workdir)) == 1  # the file being written: never taken as a result
        if point.startswith("write:*/extract"):
            assert not (workdir / RUN / "extract/shard-00000.parquet").exists()
    assert not (workdir / RUN / "dataset").exists()  # killed in pack: nothing looks complete
    proc = run_snakemake(workdir)
    assert "Extracting hidden states" not in proc.stdout + proc.stderr
    assert_unchanged(finished, stored(workdir))
    assert set(statuses(workdir).values()) == {"reused"}
    assert_same_dataset(workdir, reference)


def test_one_engine_serves_the_shards_and_its_crash_fails_only_the_shard_in_flight(reference, tiny_deepseek,
                                                                                 tmp_path):
    """Four shards of two samples, shard 00001's first (--prioritize). Its engine is killed while it
    computes (test fault `kill-engine`: the engine alone dies): only that shard fails,
    loudly; the next job starts another engine, which serves the three other shards one after another.
    A re-run soon after uses that engine (kept loaded for keep_alive_s after a failed run; taken over by
    the re-run, it forgets the first run's faults) and finishes the failed shard from the store; the
    run's success stops it."""
    from eagle3data.engine import pool as engine_pool

    workdir = new_run(tmp_path / "run", 8)
    config = small_config(tiny_deepseek, shard_size=2, engine={"batch_samples": 2, "keep_alive_s": 600})
    (workdir / "test-config.yaml").write_text(yaml.safe_dump(config))
    shards = [f"{i:05d}" for i in range(4)]
    env = {**os.environ, faults.ENV: "kill-engine@engine:generate:shard-00001"}
    cmd = [*SNAKEMAKE, "-s", str(REPO / "Snakefile"), "--directory", str(workdir), "--cores", "2",
           "--configfile", str(workdir / "test-config.yaml"), "--prioritize", f"{RUN}/extract/shard-00001.parquet"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=workdir, env=env)
    assert first.returncode != 0, first.stdout[-3000:] + first.stderr[-3000:]
    crashed = [s for s in shards if "went away while serving this job" in extract_log(workdir, s)]
    assert crashed == ["00001"], [extract_log(workdir, s)[-2000:] for s in shards]
    assert not (workdir / RUN / "extract/shard-00001.parquet").exists()
    done = {s: stats(workdir, s) for s in shards if s not in crashed}
    assert len(done) == 3  # --keep-going: the other shards finished
    # Two engine loads in all: the one that crashed, loaded by shard 00001's job, and the one the next
    # job loaded, which served the three other shards.
    started = {s: re.findall(r"starting engine (\S+) on", extract_log(workdir, s)) for s in shards}
    crashed_engine, = started.pop("00001")
    survivor, = [e for ids in started.values() for e in ids]
    assert {s["engine_id"] for s in done.values()} == {survivor} != {crashed_engine}
    assert sorted(s["engine_shards_served"] for s in done.values()) == [1, 2, 3]
    assert sum(s["engine_loaded_here"] for s in done.values()) == 1
    assert len(list((workdir / RUN / "logs/engine").glob("*.log"))) == 2

    second = run_snakemake(workdir)
    redone = re.findall(r"Extracting hidden states for shard (\d+)", second.stdout + second.stderr)
    assert redone == ["00001"]
    again = stats(workdir, "00001")
    assert not again["engine_loaded_here"] and again["engine_id"] == survivor  # no load: it was still up
    assert again["reused"] + again["computed"] == again["samples"] and again["computed"] > 0
    assert not [e for e in engine_pool.entries() if e.id == survivor]  # the run succeeded: stopped
    counts = json.loads((workdir / RUN / "dataset.counts.json").read_text())
    assert counts["packed"] + counts["skipped"] == counts["conversations_in"] == 8, counts
    assert_same_dataset(workdir, reference)


def test_other_batches_and_dropped_store_files_give_the_same_dataset(reference, tiny_deepseek, tmp_path):
    """What a resumed or retried run does to the samples it computes: puts them in other batches. Here
    all 8 go to the engine in one call, up to 16 requests a step asked for (the reference: one by one);
    vLLM-CPU's own batching changed their bits (docs/resume.md), the pipeline's engine must not.

    The same run drops the per-sample files once packed (storage.drop_packed_states), which live outside
    the store, in a transport directory (storage.transport_dir: a RAM disk in production), and losing
    them costs no GPU work: killed right after its pack job dropped them (the job not yet done: Snakemake
    packs the shard again), and then with extract forced, a run restores them from the packed shard."""
    workdir, transport = new_run(tmp_path / "run", 8), tmp_path / "transport"
    config = small_config(tiny_deepseek, engine={"batch_samples": 8, "max_num_seqs": 16},
                          storage={"drop_packed_states": True, "transport_dir": str(transport)})
    (workdir / "test-config.yaml").write_text(yaml.safe_dump(config))
    run_killed_at(workdir, "dropped:*/packed/shard-00000.arrow")
    assert stats(workdir)["computed"] == 8
    paths = pd.read_parquet(workdir / RUN / "extract/shard-00000.parquet")["path"]
    assert all(Path(p).is_relative_to(transport / Path(RUN).name) for p in paths), list(paths)  # written there
    assert list((workdir / RUN / "states").rglob("*.arrow"))  # the packed shard: in the store
    assert stored(workdir) == {} and not (workdir / RUN / "dataset").exists()
    assert not list(transport.rglob("*.safetensors"))  # dropped once packed
    resumed = run_snakemake(workdir)
    assert "(Rule: extract)" not in resumed.stderr and "(Rule: pack_shard)" in resumed.stderr
    pack_log = (workdir / RUN / "logs/pack/shard-00000.log").read_text()
    assert "restored 8 dropped states files" in pack_log and f"from {transport / Path(RUN).name}" in pack_log
    assert stored(workdir) == {} and temporary_files(workdir) == []
    assert not list(transport.rglob("*.safetensors")) and not list(transport.rglob(".*.tmp-*"))
    assert_same_dataset(workdir, reference)
    run_snakemake(workdir, "--forcerun", "extract")
    assert extract_counts(workdir) == (8, 8, 0) and "starting engine" not in extract_log(workdir)
    assert "restored 8 dropped states files" in extract_log(workdir)
    assert stored(workdir) == {} and not list(transport.rglob("*.safetensors"))
    assert_same_dataset(workdir, reference)


def test_a_failing_sample_is_named_recorded_and_retried_alone(reference, tiny_deepseek, tmp_path):
    workdir = new_run(tmp_path / "run", 8)
    first_shard = list(tokenized(reference).index[:4])  # shard 00000 at 4 conversations per shard
    victim = first_shard[1]
    config = small_config(tiny_deepseek, shard_size=4)
    proc = run_snakemake(workdir, "--retries", "1", config=config, check=False,
                         env={faults.ENV: f"fail@landed:{victim}"})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert f"sample {victim}: failed on purpose" in out  # printed by the Snakefile's onerror
    record = json.loads((workdir / RUN / "extract/shard-00000.failed.json").read_text())
    assert [f["sample_id"] for f in record["failed"]] == [victim]
    assert f"{faults.ENV}=fail@landed:{victim}" in record["failed"][0]["reason"]
    # Snakemake retried the job with twice the memory; the retry computed only the failed sample.
    assert "shard 00000 (0 GPUs, 4000 MB)" in out and "shard 00000 (0 GPUs, 8000 MB)" in out
    assert extract_counts(workdir) == (4, 3, 1)
    kept = stored(workdir)
    assert set(kept) == set(first_shard) - {victim} | set(tokenized(reference).index[4:])
    assert stats(workdir, "00001")["computed"] == 4  # --keep-going (profiles/default): shard 1 finished
    assert not (workdir / RUN / "extract/shard-00000.parquet").exists()

    proc = run_snakemake(workdir, "--", "retry_failed")  # the fault gone: retry only what failed
    out = proc.stdout + proc.stderr
    assert "Extracting hidden states for shard 00000" in out and "shard 00001" not in out
    assert (stats(workdir)["reused"], stats(workdir)["computed"]) == (3, 1)
    assert statuses(workdir)[victim] == "computed"
    assert not (workdir / RUN / "extract/shard-00000.failed.json").exists()
    assert_unchanged(kept, stored(workdir))

    proc = run_snakemake(workdir)
    assert "Extracting hidden states" not in proc.stdout + proc.stderr
    assert_same_dataset(workdir, reference)


def test_appended_conversations_compute_only_the_new_samples(reference_copy, tiny_deepseek):
    workdir = reference_copy
    before, old_shard = stored(workdir), list(tokenized(workdir).index)
    lines = [line for line in DEMO_CONVERSATIONS.read_text().splitlines() if line.strip()]
    with open(workdir / "conversations.jsonl", "a") as f:
        f.write("\n".join(lines[8:12]) + "\n")
    run_snakemake(workdir)
    assert list(tokenized(workdir).index) == old_shard  # shard 00000 keeps its samples
    assert (stats(workdir)["reused"], stats(workdir)["computed"]) == (8, 0)
    assert "starting vllm" not in extract_log(workdir)
    assert "this job uses it" not in extract_log(workdir)
    new = set(tokenized(workdir, "00001").index)
    assert len(new) == 4 and not new & set(old_shard)
    assert (stats(workdir, "00001")["reused"], stats(workdir, "00001")["computed"]) == (0, 4)
    assert_unchanged(before, stored(workdir))
    assert len(dataset(workdir)) == 12


def test_a_shorter_max_seq_len_recomputes_exactly_the_samples_it_changes(reference_copy, tiny_deepseek):
    workdir = reference_copy
    before, lengths = stored(workdir), tokenized(workdir)["num_tokens"]
    proc = run_snakemake(workdir, config=small_config(tiny_deepseek, sequence={"max_seq_len": 128}))
    assert "Params have changed since last execution" in proc.stdout + proc.stderr
    longer = set(lengths[lengths > 128].index)
    assert 0 < len(longer) < len(lengths)
    assert {s for s, status in statuses(workdir).items() if status == "computed"} == longer
    assert f"({len(longer)} stored files no longer matched their samples" in extract_log(workdir)
    after = stored(workdir)
    assert_unchanged({s: v for s, v in before.items() if s not in longer}, after)
    for sample_id in longer:
        assert after[sample_id] != before[sample_id]
        path = workdir / pd.read_parquet(workdir / RUN / "extract/shard-00000.parquet").set_index(
            "sample_id").loc[sample_id, "path"]
        with safe_open(str(path), framework="pt") as f:
            assert f.get_slice("token_ids").get_shape() == [128]
    assert max(dataset(workdir)["seq_len"].to_pylist()) == 128


def test_engine_settings_rerun_nothing_captures_rerun_extract_and_storage_packs_again(reference_copy, tiny_deepseek):
    workdir = reference_copy
    engine = {"batch_samples": 4, "max_num_seqs": 4, "max_num_batched_tokens": 2048, "cpu_kv_cache_gib": 2}
    proc = run_snakemake(workdir, "-n", config=small_config(tiny_deepseek, engine=engine))
    assert "Nothing to be done" in proc.stdout + proc.stderr
    captures = eagle3_captures(8)[:3]
    proc = run_snakemake(workdir, "-n", config=small_config(tiny_deepseek, captures=captures))
    out = proc.stdout + proc.stderr
    assert re.search(r"extract\s+1", out) and "Params have changed since last execution" in out
    # How the rows store the states packs the shards again, nothing before; compression threads, nothing.
    storage = {"compression": {"codec": "none", "threads": 1}}  # the demo's codec
    proc = run_snakemake(workdir, "-n", config=small_config(tiny_deepseek, storage=storage))
    assert "Nothing to be done" in proc.stdout + proc.stderr
    storage = {"compression": {"codec": "zstd", "precision": "fp8_e4m3"}}
    proc = run_snakemake(workdir, "-n", config=small_config(tiny_deepseek, storage=storage))
    out = proc.stdout + proc.stderr
    assert re.search(r"pack_shard\s+\d", out) and not re.search(r"\bextract\s+\d", out), out


def test_the_store_key_follows_what_determines_the_data(tiny_deepseek):
    def key(**overrides) -> Path:
        return Settings(with_defaults(small_config(tiny_deepseek, **overrides))).store.root

    base = key()
    assert key(engine={"batch_samples": 64, "max_num_seqs": 2, "tensor_parallel_size": 2}) == base
    assert key(sequence={"max_seq_len": 128}) == base  # tokens are compared file by file instead
    assert key(engine={"load_format": "safetensors"}) == base
    assert key(engine={"load_format": "dummy"}) != base
    assert key(model={"dtype": "float32"}) != base
    assert key(captures=eagle3_captures(8)[:3]) != base
