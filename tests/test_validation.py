"""Validation beyond the catalogue: the policy, the quarantine round trip, pack's re-checks, extract's
reuse check, and `python -m eagle3data.dataset.check` on packed datasets copied or merged by hand.

All on real files of the session's demo run; the workflow is re-run where a stage is under test.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pytest
import torch
from conftest import demo_config, run_snakemake, with_defaults
from corruption import RUN, ONLY_MTIME, failure_line, packed_ids, rerun, samples, table, validate_log

from eagle3data.contracts import measuring
from eagle3data.contracts import states
from eagle3data.validate import stage as validate
from eagle3data.contracts.layers import eagle3_captures, parse_captures
from eagle3data.config.settings import Settings
from eagle3data.contracts.states import Expected, file_facts, judge_files


CAPTURES = ["layer2_input", "layer4_input", "layer5_input", "layer7_output"]


def check_dataset(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eagle3data.dataset.check", str(path)],
                          capture_output=True, text=True, timeout=300)


def test_policy_defaults_to_fail_and_refuses_unknown_values(tmp_path):
    assert with_defaults(demo_config())["validation"] == {"policy": "fail", "threads": 2, "read_states": False}
    proc = run_snakemake(tmp_path, "-n", config=demo_config(validation={"policy": "skip"}), check=False)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "validation.policy is not one of the allowed values" in out and "Allowed: one of: fail, quarantine" in out


def _flip_in_place(sample, token: int, slot: int, value: float) -> None:
    """Overwrite one state value inside the file, its header (and the facts written in it) kept."""
    with open(sample.path, "r+b") as f:
        header_len = int.from_bytes(f.read(8), "little")
        entry = json.loads(f.read(header_len))["hidden_states"]
        hidden = entry["shape"][2]
        f.seek(8 + header_len + entry["data_offsets"][0] + ((token * entry["shape"][1] + slot) * hidden + 5) * 2)
        f.write(torch.tensor([value], dtype=torch.bfloat16).view(torch.int16).numpy().tobytes())


def test_validate_judges_by_the_facts_the_connector_wrote_and_pack_refuses_bytes_changed_since(demo_copy):
    """The facts in each file's header (measured by the connector on vLLM's CPU engine as it wrote the
    file) are the facts measured from its bytes, and validate uses them without reading the states; a
    value changed in place afterwards (header kept) then passes validate but not pack's checksums, and
    with validation.read_states validate measures the bytes and names it."""
    settings = Settings(with_defaults(demo_config()))
    for sample in samples(demo_copy, "00002"):
        header = file_facts(sample.sample_id, str(sample.path), [])
        assert header["written"], f"{sample.path}: no facts in its header"
        written = states.header_facts(sample.sample_id, str(sample.path), header["written"], header["shape"],
                                      settings.expected)
        assert written == measuring.capture_facts(sample.sample_id, str(sample.path), settings.expected)
    n = len(pd.read_parquet(demo_copy / RUN / "tokenized/shard-00002.parquet"))
    assert f"{n} samples checked by the facts measured as their states were written" in validate_log(demo_copy, "00002")
    assert ", 0 measured from their files" in validate_log(demo_copy, "00002")

    sample = samples(demo_copy, "00002")[1]
    _flip_in_place(sample, 3, 1, float("nan"))
    proc = rerun(demo_copy, "00002")
    assert proc.returncode != 0 and "Error in rule pack" in proc.stdout + proc.stderr
    log = (demo_copy / RUN / "logs/pack/shard-00002.log").read_text()
    assert "The file changed after validate" in failure_line(log, sample.sample_id, "checksums == validated checksums") + log
    assert not (demo_copy / RUN / "dataset").exists()

    for suffix in ("parquet", "quarantined.parquet"):
        (demo_copy / RUN / f"validated/shard-00002.{suffix}").unlink(missing_ok=True)
    proc = run_snakemake(demo_copy, *ONLY_MTIME, config=demo_config(validation={"read_states": True}), check=False)
    assert proc.returncode != 0 and "Error in rule validate" in proc.stdout + proc.stderr
    log = validate_log(demo_copy, "00002")
    assert "| found 1" in failure_line(log, sample.sample_id, "nonfinite == 0 (capture layer4_input)")
    assert f"0 samples checked by the facts measured as their states were written (pack reads and checks their " \
           f"bytes), {n} measured from their files (validation.read_states)" in log


def test_one_run_lists_every_failure_then_quarantine_packs_the_rest_and_the_next_run_re_extracts(demo_copy):
    counts_before = json.loads((demo_copy / RUN / "dataset.counts.json").read_text())
    flat, nan, truncated = samples(demo_copy, "00000")[:3]
    wide, tail, gone = samples(demo_copy, "00001")[:3]
    flat.write({f"hidden_states.{i}": torch.randn(flat.num_tokens).to(torch.bfloat16) for i in range(771)})
    states = nan.states()["hidden_states"].clone()
    states[1, 1, 1] = float("nan")
    nan.with_states(states)
    with open(truncated.path, "r+b") as f:
        f.truncate(100)
    wide.with_states(wide.states()["hidden_states"].float())
    states = tail.states()["hidden_states"].clone()
    states[-3:] = 0
    tail.with_states(states)
    gone.path.unlink()
    bad = {"00000": [flat, nan, truncated], "00001": [wide, tail, gone]}
    checks = {flat: "tensors ==", nan: "nonfinite == 0", truncated: "read_error == ''",
              wide: "dtype == 'bfloat16'", tail: "zero_rows == 0", gone: "read_error == ''"}

    # Policy fail: one run names every corrupted sample of both shards, and packs nothing.
    proc = rerun(demo_copy, "00000", "00001")
    assert proc.returncode != 0
    for shard, corrupted in bad.items():
        log = validate_log(demo_copy, shard)
        assert re.search(r"policy fail\); nothing from this shard is packed: 3 of 8 sample\(s\)", log), log
        for sample in corrupted:
            failure_line(log, sample.sample_id, checks[sample])
    assert not (demo_copy / RUN / "dataset").exists()

    # Policy quarantine: the same samples are set aside with their reasons; the rest is packed.
    proc = rerun(demo_copy, "00000", "00001", policy="quarantine")
    assert proc.returncode == 0, proc.stderr[-5000:]
    counts = json.loads((demo_copy / RUN / "dataset.counts.json").read_text())
    assert counts["packed"] == counts_before["packed"] - 6
    assert counts["skip_reasons"] == {**counts_before["skip_reasons"], "quarantined": 6}
    assert counts["packed"] + counts["skipped"] == counts["conversations_in"]
    assert packed_ids(demo_copy).isdisjoint(s.sample_id for s in checks)
    skipped = pd.concat(pd.read_parquet(demo_copy / RUN / f"validated/shard-{shard}.quarantined.parquet")
                        for shard in bad).set_index("sample_id")["reason"]
    for sample, check in checks.items():
        quarantine = demo_copy / RUN / f"quarantine/shard-{sample.shard}"
        assert skipped[sample.sample_id].startswith(f"quarantined: {check}")
        reason = (quarantine / f"{sample.sample_id}.reason.txt").read_text()
        assert f"sample {sample.sample_id} | check {check}" in reason
        assert not sample.path.exists()
        assert (quarantine / f"{sample.sample_id}.safetensors").exists() == (sample is not gone)
        failure_line(validate_log(demo_copy, sample.shard), sample.sample_id, check)
    assert check_dataset(demo_copy / RUN / "dataset").returncode == 0
    plan = run_snakemake(demo_copy, "-n", *ONLY_MTIME).stdout  # reason files: newer inputs of extract
    assert re.search(r"^extract\s+2$", plan, re.M) and re.search(r"^validate\s+2$", plan, re.M), plan

    # The next run recomputes exactly the quarantined samples and packs everything again.
    proc = run_snakemake(demo_copy, *ONLY_MTIME, check=False)
    assert proc.returncode == 0, proc.stderr[-5000:]
    for shard in bad:
        stats = json.loads((demo_copy / RUN / f"extract/shard-{shard}.stats.json").read_text())
        assert (stats["computed"], stats["reused"]) == (3, 5)
    counts = json.loads((demo_copy / RUN / "dataset.counts.json").read_text())
    assert {k: counts[k] for k in ("packed", "skipped", "skip_reasons")} == {
        k: counts_before[k] for k in ("packed", "skipped", "skip_reasons")}
    assert {s.sample_id for s in checks} <= packed_ids(demo_copy)


def test_quarantine_still_stops_on_a_broken_table(demo_copy):
    missing = samples(demo_copy, "00001")[0]
    with table(demo_copy / RUN / "extract/shard-00001.parquet") as manifest:
        manifest.drop(manifest.index[manifest["sample_id"] == missing.sample_id], inplace=True)
    proc = rerun(demo_copy, "00001", policy="quarantine")
    assert proc.returncode != 0
    log = validate_log(demo_copy, "00001")
    assert "policy quarantine; a broken table fails under any policy" in log
    assert "| expected 1 | found 0" in failure_line(log, missing.sample_id, "times_extracted == 1")
    assert not (demo_copy / RUN / "dataset").exists()


def test_quarantine_of_every_sample_of_a_shard_leaves_an_empty_manifest(demo_copy, monkeypatch):
    monkeypatch.chdir(demo_copy)  # the manifests' paths are relative to the run directory
    shard = "00002"
    for sample in pd.read_parquet(f"{RUN}/extract/shard-{shard}.parquet")["path"]:
        Path(sample).write_bytes(b"")
    settings = Settings(with_defaults(demo_config()))
    out = demo_copy / "out"
    manifest = validate.run(validate.ValidateJob(
        f"{RUN}/tokenized/shard-{shard}.parquet", f"{RUN}/extract/shard-{shard}.parquet",
        str(out / "states.parquet"), str(out / "quarantined.parquet"), str(out / "quarantine"),
        settings.expected, settings.model.vocab_size, settings.config["sequence"], "quarantine"))
    assert manifest.empty and pd.read_parquet(out / "states.parquet").empty
    quarantined = pd.read_parquet(out / "quarantined.parquet")
    assert len(quarantined) == 5 and quarantined["reason"].str.startswith("quarantined: read_error").all()


def test_quarantine_takes_a_file_from_a_ram_disk_transport_across_filesystems(demo_copy, monkeypatch):
    """Files under storage.transport_dir (a RAM disk) sit on another filesystem than the quarantine, where
    a rename cannot move them: the file arrives whole (copied under a temporary name), then leaves."""
    ram = Path("/dev/shm")
    if not ram.is_dir() or ram.stat().st_dev == demo_copy.stat().st_dev:
        pytest.skip("needs /dev/shm, a filesystem of its own")
    monkeypatch.chdir(demo_copy)
    shard, out = "00002", demo_copy / "out"
    transport = Path(tempfile.mkdtemp(dir=ram))
    try:
        manifest = pd.read_parquet(f"{RUN}/extract/shard-{shard}.parquet")
        manifest["path"] = [str(shutil.copyfile(p, transport / Path(p).name)) for p in manifest["path"]]
        out.mkdir()
        manifest.to_parquet(out / "extract.parquet")
        victim = Path(manifest["path"].iloc[0])
        victim.write_bytes(victim.read_bytes()[:1000])  # cut short: unreadable
        cut = victim.read_bytes()
        settings = Settings(with_defaults(demo_config()))
        validate.run(validate.ValidateJob(
            f"{RUN}/tokenized/shard-{shard}.parquet", str(out / "extract.parquet"), str(out / "states.parquet"),
            str(out / "quarantined.parquet"), str(out / "quarantine"), settings.expected,
            settings.model.vocab_size, settings.config["sequence"], "quarantine"))
        assert (out / "quarantine" / victim.name).read_bytes() == cut and not victim.exists()
        assert not list((out / "quarantine").glob(".*.tmp-*"))
        assert len(pd.read_parquet(out / "quarantined.parquet")) == 1
    finally:
        shutil.rmtree(transport)


def test_pack_rechecks_the_validated_manifest(demo_copy):
    wrong_bytes, lost_capture = samples(demo_copy, "00000")[:2]
    with table(demo_copy / RUN / "validated/shard-00000.parquet") as manifest:
        manifest.loc[manifest.index[manifest["sample_id"] == wrong_bytes.sample_id][0], "nbytes"] += 2
        manifest.drop(manifest.index[(manifest["sample_id"] == lost_capture.sample_id)
                                     & (manifest["capture"] == "layer7_output")], inplace=True)
    proc = run_snakemake(demo_copy, *ONLY_MTIME, check=False)
    assert proc.returncode != 0 and "Error in rule pack" in proc.stdout + proc.stderr
    log = (demo_copy / RUN / "logs/pack/shard-00000.log").read_text()  # the shard's pack job
    assert re.search(r": 2 of 8 sample\(s\) failed", log), log[-3000:]
    line = failure_line(log, wrong_bytes.sample_id, "nbytes == rows * hidden_size * itemsize(dtype)")
    assert f"| found {wrong_bytes.num_tokens * 128 * 2 + 2} |" in line
    line = failure_line(log, lost_capture.sample_id, f"captures == {CAPTURES}")
    assert f"| found {CAPTURES[:3]} |" in line
    # The earlier dataset stays whole until rule pack replaces it: both samples as packed before.
    assert {wrong_bytes.sample_id, lost_capture.sample_id} <= packed_ids(demo_copy)


def test_pack_refuses_to_start_when_the_disk_lacks_room_for_the_dataset(demo_run, tmp_path):
    from eagle3data.dataset.pack import PackJob, check_room, run
    from eagle3data.storage.room import DiskSpaceError
    from eagle3data.storage.store import Store

    run_dir = demo_run / RUN
    shards = sorted(p.name.removesuffix(".parquet") for p in (run_dir / "tokenized").glob("shard-?????.parquet"))
    validated = [str(run_dir / f"validated/{s}.parquet") for s in shards]
    job = PackJob(tokenized=[str(run_dir / f"tokenized/{s}.parquet") for s in shards],
                  skipped=[str(run_dir / f"tokenized/{s}.skipped.parquet") for s in shards],
                  states=validated, quarantined=[str(run_dir / f"validated/{s}.quarantined.parquet") for s in shards],
                  out_dir=str(tmp_path / "dataset"), counts_out=str(tmp_path / "dataset.counts.json"),
                  conversations_in=0, metadata=Settings(with_defaults(demo_config())).dataset_metadata(),
                  store=Store.at(tmp_path / "store", check_free_space=True, reserve_gib=1e9))
    with pytest.raises(DiskSpaceError) as err:
        run(job)
    states_bytes = sum(int(pd.read_parquet(p)["nbytes"].sum()) for p in validated)
    assert states_bytes > 0
    message = str(err.value)
    assert f"the packed dataset {tmp_path / 'dataset'} (on the filesystem of {tmp_path})" in message, message
    assert f"({states_bytes / 2**30:.2f} GiB still to write + 1000000000.0 GiB reserve)" in message, message
    assert "storage.check_free_space: false" in message
    assert not list(tmp_path.iterdir())  # nothing started: no dataset, no temporary directory, no counts
    # A shard packed again beside an earlier dataset, which keeps the file it replaces: the refusal names it.
    with pytest.raises(DiskSpaceError, match="from an earlier pack, keeps the shards it links") as err:
        check_room(validated[:1], str(tmp_path / "shard.arrow"), job.store, "the packed shard", str(run_dir / "dataset"))
    assert f"The dataset {run_dir / 'dataset'}," in str(err.value)


def test_extract_reuses_a_file_only_if_it_meets_the_same_contract(demo_run, tmp_path):
    sample = samples(demo_run, "00000")[0]
    ids = pd.read_parquet(demo_run / RUN / "tokenized/shard-00000.parquet").set_index("sample_id")
    expected = Expected(parse_captures(eagle3_captures(8), 8), 128, "bfloat16")
    input_ids = ids.loc[sample.sample_id, "input_ids"]
    assert judge_files([file_facts(sample.sample_id, str(sample.path), input_ids)], expected) == {}
    copy = tmp_path / sample.path.name
    shutil.copy(sample.path, copy)
    found = judge_files([file_facts("whole", str(sample.path), input_ids),
                         file_facts(sample.sample_id, str(copy), input_ids[:-1])], expected)
    assert list(found) == [sample.sample_id], found
    problems = found[sample.sample_id]
    assert len(problems) == 2, problems
    assert f"sample {sample.sample_id} | check shape == [len(input_ids), 4, 128] | expected " \
           f"[{sample.num_tokens - 1}, 4, 128] | found [{sample.num_tokens}, 4, 128]" in problems[0]
    assert "check token_ids == input_ids" in problems[1]


def test_check_dataset_accepts_the_demo_dataset(demo_run):
    proc = check_dataset(demo_run / RUN / "dataset")
    assert proc.returncode == 0, proc.stderr
    assert "OK, 20 samples, 4 captures x 128 bfloat16" in proc.stdout


def _merged_by_hand(dataset: Path) -> list[str]:
    """The first data file listed twice, as a careless concatenation of two datasets would."""
    state = json.loads((dataset / "state.json").read_text())
    state["_data_files"].append(state["_data_files"][0])
    (dataset / "state.json").write_text(json.dumps(state))
    return ["check rows == counts.packed | expected 20 | found 28", "check sample_id: field_uniqueness"]


def _metadata_lost(dataset: Path) -> list[str]:
    (dataset / "eagle3_metadata.json").unlink()
    return ["check metadata | expected eagle3_metadata.json as pack writes it | found FileNotFoundError"]


def _metadata_of_another_model(dataset: Path) -> list[str]:
    meta = json.loads((dataset / "eagle3_metadata.json").read_text())
    (dataset / "eagle3_metadata.json").write_text(json.dumps({**meta, "hidden_size": 64}))
    return ["check column hidden_states | expected List(List(Value('uint16'), length=256)) | "
            "found List(List(Value('uint16'), length=512))"]


def _row_length_changed(dataset: Path) -> list[str]:
    path = dataset / "data-00001-of-00003.arrow"
    data = pa.ipc.open_stream(path.read_bytes()).read_all()
    seq_len = data["seq_len"].to_pylist()
    seq_len[2] += 1
    data = data.set_column(data.schema.get_field_index("seq_len"), data.schema.field("seq_len"),
                           pa.array(seq_len, pa.int32()))
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, data.schema) as writer:
        writer.write_table(data)
    sample, n = data["sample_id"][2].as_py(), seq_len[2]
    return [f"sample {sample} | check state_rows == seq_len | expected {n} | found {n - 1}",
            f"sample {sample} | check ids_length == seq_len | expected {n} | found {n - 1}"]


@pytest.mark.parametrize("corrupt", [_merged_by_hand, _metadata_lost, _metadata_of_another_model,
                                     _row_length_changed])
def test_check_dataset_refuses_a_dataset_changed_by_hand(demo_run, tmp_path, corrupt):
    dataset = tmp_path / "dataset"
    shutil.copytree(demo_run / RUN / "dataset", dataset)
    expected = corrupt(dataset)
    proc = check_dataset(dataset)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"dataset {dataset} fails its checks" in proc.stderr
    for text in expected:
        assert text in proc.stderr, proc.stderr
