"""The corruption catalogue: structural corruption cannot be packed, and says what is wrong.

Each test corrupts real files of a private copy of the session's demo run (`demo_copy`), re-runs the
workflow with the default policy (fail), and asserts that it stops, that the validate log names every
corrupted sample with the failed check, the expected and the found value, and that nothing was packed.
The variants of one item go to different samples of one shard, so one re-run (one validate job) proves
them all, and proves that one run lists every failing sample. Items 1-10 are the issue's list; 11-13
are further corruptions a capture bug plausibly produces. What the quarantine policy does with such
samples is in test_validation.py.
"""

from __future__ import annotations

import os

import torch
from conftest import run_snakemake
from eagle3data import open_dataset
from corruption import RUN, ONLY_MTIME, assert_refused, failure_line, rerun, samples, table

SHAPE = "shape == [len(input_ids), 4, 128]"
TENSORS = "tensors == ['hidden_states', 'token_ids']"
VOCAB = 950  # the demo model's vocab_size


def test_01_the_original_bug_771_tensors_of_512_instead_of_one_states_tensor(demo_copy):
    sample = next(s for s in samples(demo_copy, "00002") if s.num_tokens == 512)
    flat = {f"hidden_states.{i}": torch.randn(512).to(torch.bfloat16) for i in range(771)}
    sample.write({**flat, "token_ids": sample.states()["token_ids"]})
    assert_refused(rerun(demo_copy, "00002"), demo_copy, "00002",
                   [(sample.sample_id, TENSORS, "[772 items: 'hidden_states.0', 'hidden_states.1'")])


def test_02_states_of_the_wrong_shape(demo_copy):
    short, narrow, transposed, batched = samples(demo_copy, "00001")[:4]
    short.with_states(short.states()["hidden_states"][:-1])
    narrow.with_states(narrow.states()["hidden_states"][..., :-1])
    transposed.with_states(transposed.states()["hidden_states"].permute(2, 1, 0))
    batched.with_states(batched.states()["hidden_states"].unsqueeze(0))
    assert_refused(rerun(demo_copy, "00001"), demo_copy, "00001", [
        (short.sample_id, SHAPE, f"[{short.num_tokens - 1}, 4, 128]"),
        (narrow.sample_id, SHAPE, f"[{narrow.num_tokens}, 4, 127]"),
        (transposed.sample_id, SHAPE, f"[128, 4, {transposed.num_tokens}]"),
        (batched.sample_id, SHAPE, f"[1, {batched.num_tokens}, 4, 128]"),
    ])


def test_03_states_in_the_wrong_dtype(demo_copy):
    half, single = samples(demo_copy, "00000")[:2]
    half.with_states(half.states()["hidden_states"].half())
    single.with_states(single.states()["hidden_states"].float())
    assert_refused(rerun(demo_copy, "00000"), demo_copy, "00000", [
        (half.sample_id, "dtype == 'bfloat16'", "'float16'"),
        (single.sample_id, "dtype == 'bfloat16'", "'float32'"),
    ])


def test_04_a_capture_missing_or_one_too_many(demo_copy):
    missing, extra = samples(demo_copy, "00000")[2:4]
    missing.with_states(missing.states()["hidden_states"][:, :3])
    states = extra.states()["hidden_states"]
    extra.with_states(torch.cat([states, states[:, :1]], dim=1))
    assert_refused(rerun(demo_copy, "00000"), demo_copy, "00000", [
        (missing.sample_id, SHAPE, f"[{missing.num_tokens}, 3, 128]"),
        (extra.sample_id, SHAPE, f"[{extra.num_tokens}, 5, 128]"),
    ])


def test_05_nan_or_inf_anywhere(demo_copy):
    corrupted = []
    for sample, (token, slot, value) in zip(samples(demo_copy, "00001"), [
        (7, 3, float("nan")), (0, 0, float("inf")), (-1, 2, float("-inf")),
    ]):
        states = sample.states()["hidden_states"].clone()
        states[token, slot, 5] = value
        sample.with_states(states)
        corrupted.append((sample.sample_id, "nonfinite == 0", "1"))
    log = assert_refused(rerun(demo_copy, "00001"), demo_copy, "00001", corrupted)
    assert "nonfinite == 0 (capture layer7_output)" in failure_line(log, corrupted[0][0], "nonfinite")


def test_06_a_tensor_that_is_all_zeros(demo_copy):
    one, whole = samples(demo_copy, "00000")[4:6]
    states = one.states()["hidden_states"].clone()
    states[:, 2] = 0
    one.with_states(states)
    whole.with_states(torch.zeros_like(whole.states()["hidden_states"]))
    assert_refused(rerun(demo_copy, "00000"), demo_copy, "00000", [
        (one.sample_id, "zero_fraction < 1 (capture layer5_input)", "1.0"),
        (whole.sample_id, "zero_fraction < 1 (capture layer2_input)", "1.0"),
        (whole.sample_id, "zero_fraction < 1 (capture layer7_output)", "1.0"),
    ])


def test_07_a_truncated_or_unreadable_file(demo_copy):
    truncated, garbage, empty = samples(demo_copy, "00001")[:3]
    with open(truncated.path, "r+b") as f:
        f.truncate(truncated.path.stat().st_size // 2)
    garbage.path.write_bytes(os.urandom(4096))
    empty.path.write_bytes(b"")
    unreadable = "'SafetensorError: Error while deserializing header"
    assert_refused(rerun(demo_copy, "00001"), demo_copy, "00001", [
        (truncated.sample_id, "read_error == ''", unreadable),
        (garbage.sample_id, "read_error == ''", unreadable),
        (empty.sample_id, "read_error == ''", f"{unreadable}: header too small"),
    ])


def test_08_token_ids_that_differ_from_the_tokenized_sample(demo_copy):
    changed, shifted = samples(demo_copy, "00000")[:2]
    ids = changed.states()["token_ids"].clone()
    ids[10] += 1
    changed.write({**changed.states(), "token_ids": ids})
    shifted.write({**shifted.states(), "token_ids": torch.roll(shifted.states()["token_ids"], 1)})
    log = assert_refused(rerun(demo_copy, "00000"), demo_copy, "00000", [
        (changed.sample_id, "token_ids == input_ids", f"[{changed.num_tokens} items:"),
        (shifted.sample_id, "token_ids == input_ids", f"[{shifted.num_tokens} items:"),
    ])
    assert "first difference at position 10" in failure_line(log, changed.sample_id, "token_ids")


def test_09_a_sample_missing_from_the_extraction_output_twice_or_foreign(demo_copy):
    missing, twice = samples(demo_copy, "00001")[:2]
    foreign = samples(demo_copy, "00000")[0]
    with table(demo_copy / RUN / "extract/shard-00001.parquet") as manifest:
        row = manifest[manifest["sample_id"] == twice.sample_id]
        other = manifest.iloc[:1].assign(sample_id=foreign.sample_id, path=str(foreign.path))
        manifest.drop(manifest.index[manifest["sample_id"] == missing.sample_id], inplace=True)
        manifest.loc[len(manifest) + 1] = row.iloc[0]
        manifest.loc[len(manifest) + 2] = other.iloc[0]
    assert_refused(rerun(demo_copy, "00001"), demo_copy, "00001", [
        (missing.sample_id, "times_extracted == 1", "0"),
        (twice.sample_id, "times_extracted == 1", "2"),
        (twice.sample_id, "sample_id: field_uniqueness", "'" + twice.sample_id),
        (foreign.sample_id, "times_tokenized == 1", "0"),
    ])


def test_10_a_tokenized_shard_with_a_long_mask_a_foreign_id_an_empty_or_an_overlong_sample(demo_copy):
    long_mask, foreign_id, empty, overlong = samples(demo_copy, "00001")[:4]
    with table(demo_copy / RUN / "tokenized/shard-00001.parquet", keep_mtime=True) as shard:
        at = {sid: i for i, sid in enumerate(shard["sample_id"])}
        shard.at[at[long_mask.sample_id], "loss_mask"] = [*shard.at[at[long_mask.sample_id], "loss_mask"], 0]
        ids = list(shard.at[at[foreign_id.sample_id], "input_ids"])
        ids[5] = VOCAB
        shard.at[at[foreign_id.sample_id], "input_ids"] = ids
        shard.loc[at[empty.sample_id], ["num_tokens", "num_trainable"]] = 0
        shard.at[at[empty.sample_id], "input_ids"] = []
        shard.at[at[empty.sample_id], "loss_mask"] = []
        i = at[overlong.sample_id]
        shard.at[i, "input_ids"] = [*shard.at[i, "input_ids"], *[5] * (520 - overlong.num_tokens)]
        shard.at[i, "loss_mask"] = [*shard.at[i, "loss_mask"], *[0] * (520 - overlong.num_tokens)]
        shard.at[i, "num_tokens"] = 520
    assert_refused(rerun(demo_copy, "00001"), demo_copy, "00001", [
        (long_mask.sample_id, "len(loss_mask) == len(input_ids)", str(long_mask.num_tokens + 1)),
        (foreign_id.sample_id, f"max(input_ids) < {VOCAB}", str(VOCAB)),
        (empty.sample_id, "num_tokens: in_range(8, 512)", "0"),
        (empty.sample_id, "num_trainable: greater_than_or_equal_to(1)", "0"),
        (overlong.sample_id, "num_tokens: in_range(8, 512)", "520"),
    ])


def test_11_capture_bugs_in_the_values_a_slot_written_twice_a_zero_tail_one_state_for_all(demo_copy):
    twice, tail, broadcast = samples(demo_copy, "00000")[:3]
    states = twice.states()["hidden_states"].clone()
    states[:, 1] = states[:, 0]  # the same layer captured into two slots
    twice.with_states(states)
    states = tail.states()["hidden_states"].clone()
    states[-16:] = 0  # the writer copied fewer tokens than the shape says (block padding)
    tail.with_states(states)
    states = broadcast.states()["hidden_states"]
    broadcast.with_states(states[-1:].expand_as(states))  # one position's state for every token
    assert_refused(rerun(demo_copy, "00000"), demo_copy, "00000", [
        (twice.sample_id, "duplicate_captures == []", "['layer4_input']"),
        (tail.sample_id, "zero_rows == 0 (capture layer2_input)", "16"),
        (broadcast.sample_id, "identical_rows == False (capture layer2_input)", "True"),
    ])


def test_12_capture_bugs_in_the_file_swapped_stray_tensor_batched_ids_missing(demo_copy):
    first, second, stray, batched, gone = samples(demo_copy, "00001")[:5]
    a, b = first.path.read_bytes(), second.path.read_bytes()  # written to each other's path
    first.path.write_bytes(b)
    second.path.write_bytes(a)
    stray.write({**stray.states(), "aux_hidden_states": stray.states()["hidden_states"][:, 0]})
    batched.write({**batched.states(), "token_ids": batched.states()["token_ids"][None]})
    gone.path.unlink()
    assert_refused(rerun(demo_copy, "00001"), demo_copy, "00001", [
        (first.sample_id, SHAPE, f"[{second.num_tokens}, 4, 128]"),
        (first.sample_id, "token_ids == input_ids", f"[{second.num_tokens} items:"),
        (second.sample_id, SHAPE, f"[{first.num_tokens}, 4, 128]"),
        (stray.sample_id, TENSORS, "['aux_hidden_states', 'hidden_states', 'token_ids']"),
        (batched.sample_id, "token_ids == input_ids", f"[[{batched.num_tokens} items:"),
        (gone.sample_id, "read_error == ''", "'FileNotFoundError: No such file or directory"),
    ])


def test_13_a_file_changed_after_validation_is_refused_by_pack(demo_copy):
    sample = samples(demo_copy, "00002")[0]
    states = sample.states()["hidden_states"].clone()
    states[3, 1, 4] = float("nan")
    sample.with_states(states)
    proc = run_snakemake(demo_copy, "--forcerun", "pack_shard", *ONLY_MTIME, check=False)
    assert proc.returncode != 0 and "Error in rule pack" in proc.stdout + proc.stderr
    log = (demo_copy / RUN / "logs/pack/shard-00002.log").read_text()  # the shard's pack job
    line = failure_line(log, sample.sample_id, "checksums == validated checksums")
    assert "| expected [" in line and "| found [" in line and "The file changed after validate" in log
    # The earlier dataset stays whole until rule pack replaces it: it holds the states packed before.
    row = next(r for r in open_dataset(demo_copy / RUN / "dataset") if r["sample_id"] == sample.sample_id)
    assert torch.isfinite(row["hidden_states"][3, 1, 4]), row["hidden_states"][3, 1, 4]
