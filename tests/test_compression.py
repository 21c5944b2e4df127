"""storage.compression: the packed states stored compressed, and every reader transparent.

The same store files (the connector's tensors and facts, written as the benchmark writes them) are
validated once and packed three times, compressed (`codec: zstd`), raw (`codec: none`) and as fp8 codes
(`precision: fp8_e4m3`, lossy): every reader then returns the same tensors from the first two, bit for bit:
`open_dataset`, `datasets.load_from_disk` with `decode_states`, speculators' and SpecForge's reader
backends, and a dropped store file restored from the packed shard; from the fp8 one, bf16 tensors of the
same shapes, each value within the bound storage/fp8.py states, and no restored file; a dataset mixing both
kinds of rows reads each as its own. Every reader and the full check refuse a flipped byte in any of the three. A dataset of the format before compression (format 1)
still loads, and check_dataset refuses a frame that is not whole. Real SmolLM2 states:
tests/test_real_model.py.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import datasets
import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import torch
from conftest import demo_config, with_defaults
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import load_file

from eagle3data import decode_states, open_dataset, read_metadata
from eagle3bench.io import write_shards
from eagle3data.contracts.measuring import facts_header, load_stored
from eagle3data.contracts.reading import load_states
from eagle3data.contracts.failures import BoundaryError
from eagle3data.dataset.check import DatasetCheckError, check_dataset
from eagle3data.storage import fp8
from eagle3data.storage.compression import (FP8_META, FP8_SCALES, FRAME_KEY, FRAME_TENSOR, Compression, FrameError,
                                             decode, frame_checksum, frame_tokens, precision)
from eagle3data.dataset.pack import PackJob, run as pack
from eagle3data.dataset.packed import restore
from eagle3data.config.settings import Settings
from eagle3data.storage.store import Store, atomic_path, sample_path
from eagle3data.validate.stage import ValidateJob, run as validate

SAMPLES, TOKENS = 6, 96


def bf16_patterns(*shape: int, seed: int = 0) -> np.ndarray:
    values = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    return values.view(torch.int16).numpy().view(np.uint16)


def test_a_frame_gives_back_every_value_in_any_size_and_dtype(monkeypatch):
    states = bf16_patterns(300, 4, 576)
    frame = Compression("zstd", 1, threads=2).encode(states)
    assert len(frame) < 0.8 * states.nbytes and frame_tokens(frame, 4 * 576) == 300
    assert np.array_equal(decode(frame, 4, 576), states)
    assert decode(Compression("zstd", 1).encode(states[:0]), 4, 576).shape == (0, 4, 576)
    single = np.random.default_rng(0).standard_normal((50, 4, 64)).astype(np.float32)
    assert np.array_equal(decode(Compression("lz4", 1).encode(single), 4, 64), single)
    monkeypatch.setattr("eagle3data.storage.compression.CHUNK_BYTES", 100_000)  # a frame of several chunks
    frame = Compression("zstd", 1).encode(states)
    assert np.array_equal(decode(frame, 4, 576), states)
    with pytest.raises(FrameError, match="is no \\[L, 4, 896\\] uint16"):
        decode(frame, 4, 896)
    with pytest.raises(FrameError, match="not a Blosc2 frame"):
        decode(b"\0" * 64, 4, 576)
    assert frame_tokens(b"\0" * 64, 4 * 576) == -1 and frame_tokens(frame, 7 * 576) == -1


def test_fp8_frames_read_back_within_the_stated_bound_and_say_what_they_hold(monkeypatch):
    """bf16 and float32 states, a token of zeros and one with a value 10^4 times the others' (a massive
    activation) among them: every value read back from the fp8 frame keeps storage/fp8.py's bound, and the
    worst uses most of it (e4m3's rounding, not a looser one); a bound half as wide is broken. The frame
    says it holds fp8 codes, an exact frame of the same states says exact; the codes take one byte a
    value and a scale per token and capture."""
    values = torch.randn(300, 4, 576, generator=torch.Generator().manual_seed(1)) * 3
    values[5, 1], values[7, 2, 3] = 0, 3e4
    lossy = Compression("zstd", 1, precision="fp8_e4m3")
    for states in (values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16), values.numpy()):
        frame = lossy.encode(states)
        read = decode(frame, 4, 576)
        assert read.dtype == states.dtype and read.shape == states.shape and not read[5, 1].any()
        assert 0.8 < fp8.error_to_bound(states, read) <= 1
        assert precision(frame) == "fp8_e4m3" and precision(Compression("zstd", 1).encode(states)) == "exact"
        assert frame_tokens(frame, 4 * 576) == 300 and len(frame) < 300 * 4 * (576 + 4)
    monkeypatch.setattr(fp8, "RELATIVE_ERROR", 2**-5)
    assert fp8.error_to_bound(states, read) > 1
    codes, scales = fp8.quantize(states)
    short = lossy._framed(codes, {FP8_META: {"precision": "fp8_e4m3", "dtype": "float32"}},
                          {FP8_SCALES: scales[:-1].tobytes()})
    with pytest.raises(FrameError, match="an fp8 frame of 300 tokens with 1196 scales, not 1200"):
        decode(short, 4, 576)


def codec_settings(model: Path, codec: str, precision: str = "exact") -> Settings:
    compression = {"codec": codec, "level": 1, "threads": 2, "precision": precision}
    return Settings(with_defaults(demo_config(model={"path": str(model), "build_demo": False},
                                              storage={"compression": compression})))


def write_as_earlier_writers(path: str) -> None:
    """Rewrite a store file as an earlier version's writer threads wrote it under storage.compression:
    the states as one Blosc2 frame, its header stating the frame's CRC beside the raw values' facts."""
    stored = load_stored(path)
    values = stored["hidden_states"].view(torch.uint16).numpy()
    frame = Compression("zstd", 1).encode(values)
    about = {"shape": list(values.shape), "dtype": "bfloat16", "codec": "zstd", "level": 1,
             "checksum": frame_checksum(frame)}
    with atomic_path(path) as tmp:
        save_numpy({FRAME_TENSOR: np.frombuffer(frame, np.uint8), "token_ids": stored["token_ids"].numpy()}, tmp,
                   metadata={**facts_header(stored["hidden_states"]), FRAME_KEY: json.dumps(about)})


def validated_shard(settings: Settings, work: Path, samples: int, read_states: bool = False, framed_every: int = 0):
    """A synthetic shard of raw files as the connector writes them (every `framed_every`-th compressed as
    an earlier version's writers did), validated."""
    shard = write_shards(settings, work, 1, samples, TOKENS)[0]
    for path in shard.files[::framed_every] if framed_every else []:
        write_as_earlier_writers(path)
    validate(ValidateJob(shard.tokenized, shard.extract_manifest, shard.states, shard.quarantined,
                         str(work / "quarantine"), settings.expected, settings.model.vocab_size,
                         {"max_seq_len": 512, "min_seq_len": 8}, read_states=read_states))
    return shard


def pack_shard(shard, settings: Settings, out: Path, samples: int) -> None:
    pack(PackJob([shard.tokenized], [shard.skipped], [shard.states], [shard.quarantined], str(out),
                 str(out) + ".counts.json", samples, settings.dataset_metadata(), threads=2))


@pytest.fixture(scope="module")
def packed(tiny_deepseek, tmp_path_factory) -> dict[str, Path]:
    """The same validated shard of raw files (every third compressed by an earlier version's writers)
    packed compressed, raw and as fp8 codes: {"zstd" | "none" | "fp8": work directory}."""
    work = tmp_path_factory.mktemp("compression")
    settings = {codec: codec_settings(tiny_deepseek, codec) for codec in ("zstd", "none")}
    settings["fp8"] = codec_settings(tiny_deepseek, "zstd", "fp8_e4m3")
    shard = validated_shard(settings["zstd"], work, SAMPLES, framed_every=3)
    for codec, s in settings.items():
        pack_shard(shard, s, work / codec / "dataset", SAMPLES)
    return {codec: work / codec for codec in settings} | {"store": work / "store", "model": tiny_deepseek}


def test_pack_compresses_raw_files_keeps_earlier_frames_and_refuses_one_changed_since_validate(packed, tmp_path):
    """The zstd dataset's rows are the connector's raw files compressed by pack, and the frames of files an
    earlier version's writers compressed, byte for byte (not compressed again); validate measuring every
    byte of such a file finds the facts in its header; a frame changed after validate is refused, naming
    the sample."""
    table = datasets.load_from_disk(str(packed["zstd"] / "dataset")).with_format("arrow")[:]
    kinds = []
    for sid, frame in zip(table["sample_id"].to_pylist(), table["hidden_states"].to_pylist()):
        stored = load_file(str(sample_path(packed["store"], sid)))
        kinds.append(FRAME_TENSOR in stored)
        if FRAME_TENSOR in stored:
            assert stored[FRAME_TENSOR].numpy().tobytes() == frame
        else:
            assert np.array_equal(decode(frame, 4, stored["hidden_states"].shape[2]),
                                  stored["hidden_states"].view(torch.uint16).numpy())
    assert kinds.count(True) == len(kinds) // 3 and kinds.count(False) > 0
    settings = codec_settings(packed["model"], "zstd")
    shard = validated_shard(settings, tmp_path / "measured", 2, framed_every=1)
    written = pd.read_parquet(shard.states)
    validate(ValidateJob(shard.tokenized, shard.extract_manifest, shard.states, shard.quarantined,
                         str(tmp_path / "quarantine"), settings.expected, settings.model.vocab_size,
                         {"max_seq_len": 512, "min_seq_len": 8}, read_states=True))
    pd.testing.assert_frame_equal(pd.read_parquet(shard.states), written)
    assert len(written) == 8
    shard = validated_shard(settings, tmp_path / "changed", 3, framed_every=1)
    files = pd.read_parquet(shard.extract_manifest)
    sid, path = files.iloc[1][["sample_id", "path"]]
    original = Path(path).read_bytes()
    data = bytearray(original)
    for at in range(len(data) - 200, len(data) - 100):  # inside the frame (token_ids come first)
        data[at] ^= 0x5A
    Path(path).write_bytes(data)
    with pytest.raises(BoundaryError) as refused:
        pack_shard(shard, settings, tmp_path / "changed" / "dataset", 3)
    assert f"sample {sid} | check checksums == validated checksums" in str(refused.value)
    assert "a frame whose CRC" in str(refused.value) and not (tmp_path / "changed" / "dataset").exists()
    shutil.copyfile(files.iloc[2]["path"], path)  # another whole file, its header true to its own frame
    with pytest.raises(BoundaryError) as refused:
        pack_shard(shard, settings, tmp_path / "changed" / "dataset", 3)
    assert f"sample {sid} | check checksums == validated checksums" in str(refused.value)
    Path(path).write_bytes(original)
    pack_shard(shard, settings, tmp_path / "changed" / "dataset", 3)


def test_the_metadata_names_the_codec_and_the_bytes_are_fewer(packed):
    zstd, raw = read_metadata(packed["zstd"] / "dataset"), read_metadata(packed["none"] / "dataset")
    assert zstd["format_version"] == raw["format_version"] == 4
    assert zstd["checksums"]["algorithm"].startswith("CRC-32") and "hidden_states_crc32" in zstd["checksums"]
    assert "hidden_states_stored_crc32" in zstd["checksums"] and "tokens_crc32" in zstd["checksums"]
    assert {k: zstd["compression"][k] for k in ("library", "codec", "level", "filter")} == {
        "library": "blosc2", "codec": "zstd", "level": 1, "filter": "shuffle"}
    assert raw["compression"] == {"codec": "none"}
    hf = datasets.load_from_disk(str(packed["zstd"] / "dataset"))
    assert hf.features["hidden_states"] == datasets.Value("large_binary")
    # fp8 says so, with its bound, in the metadata and the card; the exact datasets say nothing of it.
    lossy = read_metadata(packed["fp8"] / "dataset")["compression"]
    assert (lossy["codec"], lossy["precision"], lossy["lossy"]) == ("zstd", "fp8_e4m3", True)
    assert lossy["error_bound"]["relative"] == fp8.RELATIVE_ERROR == 2**-4 + 2**-7
    assert lossy["error_bound"]["absolute_of_token_max"] == fp8.ABSOLUTE_ERROR and "scales" in lossy
    card = (packed["fp8"] / "dataset" / "README.md").read_text()
    assert "stored lossy (`storage.compression.precision: fp8_e4m3`)" in card and "at most 0.07031 x its captured magnitude" in card
    assert "lossy" not in (packed["zstd"] / "dataset" / "README.md").read_text() and "precision" not in zstd["compression"]

    def data_bytes(codec: str) -> int:
        return sum(p.stat().st_size for p in (packed[codec] / "dataset").glob("*.arrow"))

    assert data_bytes("zstd") < 0.8 * data_bytes("none")  # random normal bf16: ~0.68
    assert data_bytes("fp8") < 0.55 * data_bytes("none")  # one byte a value, a scale per token and capture
    counts = json.loads((packed["zstd"] / "dataset.counts.json").read_text())
    assert counts["states_bytes"] == SAMPLES * TOKENS * 4 * 128 * 2 > counts["pack_bytes"]
    for codec in ("zstd", "none", "fp8"):
        assert "OK, 6 samples, 4 captures x 128 bfloat16" in check_dataset(packed[codec] / "dataset")


def test_every_reader_returns_the_same_tensors_with_and_without_compression(packed):
    """open_dataset, load_from_disk + decode_states, and both bit for bit equal to the store's files (the
    connector's compressed files: the zstd dataset holds their frames, the raw one their decoded values)."""
    rows = {codec: list(open_dataset(packed[codec] / "dataset")) for codec in ("zstd", "none")}
    assert [r["sample_id"] for r in rows["zstd"]] == [r["sample_id"] for r in rows["none"]]
    for codec in ("zstd", "none"):
        hf = datasets.load_from_disk(str(packed[codec] / "dataset"))
        meta = read_metadata(packed[codec] / "dataset")
        for i, (row, other) in enumerate(zip(rows[codec], rows["none" if codec == "zstd" else "zstd"])):
            stored = torch.from_numpy(load_states(str(sample_path(packed["store"], row["sample_id"]))).view(np.int16))
            assert row["hidden_states"].dtype == torch.bfloat16 and row["hidden_states"].shape == (TOKENS, 4, 128)
            for tensor in (row["hidden_states"], other["hidden_states"], decode_states(hf[i], meta)):
                assert torch.equal(tensor.view(torch.int16), stored)
            assert torch.equal(row["input_ids"], other["input_ids"]) and torch.equal(row["loss_mask"], other["loss_mask"])
        arrow = hf.with_format("arrow")[0:1]  # zero-copy Arrow scalars
        assert torch.equal(decode_states({k: arrow[k][0] for k in arrow.column_names}, meta),
                           rows[codec][0]["hidden_states"])
        assert torch.equal(decode_states(arrow["hidden_states"][0], meta, verify=False), rows[codec][0]["hidden_states"])
        with pytest.raises(TypeError, match="pass the whole row"):
            decode_states(hf[0]["hidden_states"], meta)


def reader_exports(packed: dict, codec: str):
    """speculators' and SpecForge's readers of the `codec` dataset, its reader exports made once."""
    from eagle3data.exports.specforge import export as export_specforge
    from eagle3data.exports.speculators import export as export_speculators
    from eagle3data.exports.specforge_reader import PackedFeatures
    from eagle3data.exports.speculators_reader import PackedStatesTransfer
    from eagle3data.exports.vocab import write_vocab

    d = packed[codec]
    if not (d / "speculators").exists():
        write_vocab(d / "dataset", packed["model"], 64, d / "token_freq.pt", d / "vocab_mapping.pt")
        export_speculators(d / "dataset", d / "speculators", d / "token_freq.pt", d / "vocab_mapping.pt",
                           states="reader")
        export_specforge(d / "dataset", d / "specforge", packed["model"], d / "vocab_mapping.pt", states="reader")
    return PackedStatesTransfer(d / "speculators"), PackedFeatures(d / "specforge")


def test_the_trainers_readers_return_the_same_tensors_with_and_without_compression(packed):
    found = {}
    for codec in ("zstd", "none"):
        speculators, specforge = reader_exports(packed, codec)
        found[codec] = [(speculators.get_cached(i), specforge(i)) for i in range(SAMPLES)]
        assert speculators.rows_as_decoded == (codec == "zstd")  # the decoded rows go out uncopied
    for (a_spec, a_forge), (b_spec, b_forge) in zip(found["zstd"], found["none"]):
        for a, b in [*zip(a_spec.values(), b_spec.values()), *zip(a_forge.values(), b_forge.values())]:
            assert a.dtype == b.dtype and torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                                                      b.view(torch.int16) if b.dtype == torch.bfloat16 else b)
        assert a_spec["hidden_states"].shape == (TOKENS, 4, 128)


def test_every_reader_returns_fp8_rows_in_bf16_within_the_stated_bound(packed):
    """open_dataset, load_from_disk + decode_states and both trainers' readers give the fp8 dataset's rows
    as the exact dataset's dtype and shapes, the same values from each reader, every value within the bound
    of the captured one (the error is e4m3's: most of the bound)."""
    exact, lossy = open_dataset(packed["none"] / "dataset"), open_dataset(packed["fp8"] / "dataset")
    hf, meta = datasets.load_from_disk(str(packed["fp8"] / "dataset")), read_metadata(packed["fp8"] / "dataset")
    (speculators, specforge), (_, exact_specforge) = reader_exports(packed, "fp8"), reader_exports(packed, "none")
    worst = 0.0
    for i, (x, y) in enumerate(zip(exact, lossy)):
        assert y["sample_id"] == x["sample_id"] and torch.equal(y["input_ids"], x["input_ids"])
        read = y["hidden_states"]
        assert read.dtype == torch.bfloat16 and read.shape == x["hidden_states"].shape == (TOKENS, 4, 128)
        assert torch.equal(decode_states(hf[i], meta).view(torch.int16), read.view(torch.int16))
        assert torch.equal(speculators.get_cached(i)["hidden_states"].view(torch.int16), read.view(torch.int16))
        features, exact_features = specforge(i), exact_specforge(i)
        assert {k: (v.dtype, v.shape) for k, v in features.items()} == \
            {k: (v.dtype, v.shape) for k, v in exact_features.items()}
        worst = max(worst, fp8.error_to_bound(*(t.view(torch.int16).numpy().view(np.uint16)
                                                  for t in (x["hidden_states"], read))))
    assert 0.8 < worst <= 1


def restoring_store(packed: dict, codec: str, work: Path) -> tuple[Store, list[str]]:
    """A store under `work` whose packed shard is the `codec` dataset's file, its files all dropped, and
    the dataset's sample ids."""
    store = work / "store"
    shutil.copytree(packed[codec] / "dataset", store / "packed")
    (store / "packed" / "data-00000-of-00001.arrow").rename(store / "packed" / "shard-00000.arrow")
    ids = [r["sample_id"] for r in open_dataset(packed[codec] / "dataset")]
    return Store(store, store, 0, True, functools.partial(restore, n_captures=4, hidden_size=128,
                                                         dtype="bfloat16")), ids


def test_a_dataset_may_mix_exact_and_fp8_rows(packed, tmp_path):
    """Each frame says what it holds: a copy of the fp8 dataset whose even rows are the zstd dataset's
    (the same samples) reads each row as its own kind, verified, and passes the full check."""
    from eagle3data.dataset.check import full_check

    mixed = tmp_path / "dataset"
    shutil.copytree(packed["fp8"] / "dataset", mixed)
    path = mixed / "data-00000-of-00001.arrow"
    rows = {codec: pa.ipc.open_stream((packed[codec] / "dataset" / path.name).read_bytes()).read_all()
            for codec in ("zstd", "fp8")}
    table = pa.concat_tables([rows["zstd" if i % 2 == 0 else "fp8"].slice(i, 1) for i in range(SAMPLES)])
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    read = {name: [r["hidden_states"].view(torch.int16) for r in open_dataset(d)]
            for name, d in (("mixed", mixed), ("zstd", packed["zstd"] / "dataset"), ("fp8", packed["fp8"] / "dataset"))}
    assert not any(torch.equal(a, b) for a, b in zip(read["zstd"], read["fp8"]))  # the two kinds differ
    assert all(torch.equal(row, read["zstd" if i % 2 == 0 else "fp8"][i]) for i, row in enumerate(read["mixed"]))
    assert full_check(mixed, threads=2)[1] == []


def test_pack_refuses_fp8_values_that_break_the_stated_bound(packed, tmp_path, monkeypatch):
    """Pack checks every fp8 row against the bound before it writes it: with a bound tighter than e4m3's
    rounding (2^-6 relative), the shard is refused, naming the sample and how far it broke the bound."""
    settings = codec_settings(packed["model"], "zstd", "fp8_e4m3")
    shard = validated_shard(settings, tmp_path, 2)
    monkeypatch.setattr(fp8, "RELATIVE_ERROR", 2**-6)
    with pytest.raises(BoundaryError, match=r"check fp8_e4m3 values read back within the stated error bound \| "
                                            r"expected <= 1 x the bound \| found [\d.]+ x the bound") as refused:
        pack_shard(shard, settings, tmp_path / "dataset", 2)
    assert "storage.compression.precision: exact" in str(refused.value) and not (tmp_path / "dataset").exists()


def test_a_dropped_store_file_is_not_restored_from_an_fp8_shard(packed, tmp_path):
    """fp8 codes are not the values captured: a store asked for files that an fp8 shard packs restores
    none, so extract computes them again."""
    store, ids = restoring_store(packed, "fp8", tmp_path)
    assert store.ensure(ids) == [] and not any(store.path(sid).exists() for sid in ids)


def test_a_dropped_store_file_comes_back_from_the_compressed_shard_bit_for_bit(packed, tmp_path):
    store, ids = restoring_store(packed, "zstd", tmp_path)
    assert store.ensure(ids) == ids
    for sid in ids:
        restored, original = store.path(sid), sample_path(packed["store"], sid)
        assert np.array_equal(load_states(str(restored)), load_states(str(original)))
        assert torch.equal(load_file(str(restored))["token_ids"], load_file(str(original))["token_ids"])


def without_checksums(dataset: Path, out: Path, format_version: int) -> dict:
    """A copy of `dataset` as an older eagle3data wrote it: format 3 (per-capture and tokens CRCs, no CRC
    of the states as stored), or no checksum columns, format 1 (raw, no `compression` key) or 2; its
    metadata."""
    shutil.copytree(dataset, out)
    path = out / "data-00000-of-00001.arrow"
    columns = ["hidden_states_stored_crc32"] + (["hidden_states_crc32", "tokens_crc32"] if format_version < 3 else [])
    table = pa.ipc.open_stream(path.read_bytes()).read_all().drop_columns(columns)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    meta = read_metadata(out)
    if format_version < 3:
        del meta["checksums"]
    else:
        del meta["checksums"]["hidden_states_stored_crc32"]
    if format_version == 1:
        del meta["compression"]
    meta["format_version"] = format_version
    (out / "eagle3_metadata.json").write_text(json.dumps(meta))
    info = json.loads((out / "dataset_info.json").read_text())
    for name in columns:
        del info["features"][name]
    (out / "dataset_info.json").write_text(json.dumps(info))
    return meta


def test_a_dataset_written_before_compression_or_checksums_still_loads(packed, tmp_path):
    """Format 1, as every dataset before compression: raw uint16 lists, no `compression` in the metadata;
    format 2, compressed: neither has checksums, and both load, saying their verification is not available."""
    for version, codec in ((1, "none"), (2, "zstd")):
        old = tmp_path / f"dataset-{version}"
        meta = without_checksums(packed[codec] / "dataset", old, version)
        assert "OK, 6 samples" in check_dataset(old)
        assert open_dataset(old).verification == "not available"
        for row, new in zip(open_dataset(old), open_dataset(packed["zstd"] / "dataset")):
            assert torch.equal(row["hidden_states"].view(torch.int16), new["hidden_states"].view(torch.int16))
        assert torch.equal(decode_states(datasets.load_from_disk(str(old))[0]["hidden_states"], meta),
                           open_dataset(old)[0]["hidden_states"])


@pytest.mark.parametrize("codec", ["zstd", "none"])
def test_a_dataset_of_format_3_is_verified_capture_by_capture(packed, tmp_path, codec):
    """Format 3 rows carry their captures' and tokens' CRCs but no CRC of the states as stored: every reader
    still verifies them, from the values, and a flipped byte is refused naming the row and capture."""
    from eagle3data.dataset.check import full_check
    from eagle3data.dataset.format import IntegrityError

    old = tmp_path / "dataset-3"
    meta = without_checksums(packed[codec] / "dataset", old, 3)
    assert "OK, 6 samples" in check_dataset(old)
    ds, hf = open_dataset(old), datasets.load_from_disk(str(old))
    assert ds.verification == "crc32" and "hidden_states_stored_crc32" not in hf.column_names
    for i, (row, new) in enumerate(zip(ds, open_dataset(packed[codec] / "dataset"))):
        assert torch.equal(row["hidden_states"].view(torch.int16), new["hidden_states"].view(torch.int16))
        assert torch.equal(decode_states(hf[i], meta).view(torch.int16), new["hidden_states"].view(torch.int16))
    summary, found = full_check(old, threads=2)
    assert found == [] and "capture by capture (format 3)" in summary
    path = old / "data-00000-of-00001.arrow"
    data, table = path.read_bytes(), hf.with_format("arrow")[:]
    if codec == "none":  # token 3, capture 1
        states = np.array(table["hidden_states"][2].as_py(), dtype=np.uint16).tobytes()
        flipped(path, data.index(states) + ((3 * 4 + 1) * 128 + 5) * 2 + 1)
    else:  # inside the frame's compressed data
        frame = table["hidden_states"][2].as_py()
        flipped(path, data.index(frame) + len(frame) // 2)
    named = "capture 1 " if codec == "none" else "hidden_states"
    hf = datasets.load_from_disk(str(old))
    sid = hf[2]["sample_id"]
    for read in (lambda: open_dataset(old)[2], lambda: decode_states(hf[2], meta)):
        with pytest.raises(IntegrityError, match=f"\\(sample {sid}\\)") as refused:
            read()
        assert named in str(refused.value)
    _, found = full_check(old, threads=2)
    assert {f.check.split(":")[0] for f in found} == {"row 2"} and all(named in f.check for f in found)


@pytest.mark.parametrize("codec", ["zstd", "none", "fp8"])
def test_a_flipped_byte_in_a_rows_checksum_columns_fails_the_readers(packed, tmp_path, codec):
    """The stored CRC covers the captures' CRCs too: a byte flipped in row 0's hidden_states_crc32 (capture
    2's) or in row 3's hidden_states_stored_crc32 is refused by every reader and the full check, the
    first naming the capture whose stated CRC its values no longer have, the second the stored CRC."""
    from eagle3data.dataset.check import full_check
    from eagle3data.dataset.format import IntegrityError

    dataset = tmp_path / "dataset"
    shutil.copytree(packed[codec] / "dataset", dataset)
    path = dataset / "data-00000-of-00001.arrow"
    hf = datasets.load_from_disk(str(dataset))
    data, crcs, stored = path.read_bytes(), hf[0]["hidden_states_crc32"], hf[3]["hidden_states_stored_crc32"]
    flipped(path, data.index(np.array(crcs, dtype="<u4").tobytes()) + 2 * 4 + 1)
    flipped(path, data.index(np.array(stored, dtype="<u4").tobytes()) + 2)
    hf, meta, ds = datasets.load_from_disk(str(dataset)), read_metadata(dataset), open_dataset(dataset)
    damage = {0: "capture 2 (", 3: "hidden_states_stored_crc32 (hidden_states as stored"}
    for i in range(SAMPLES):
        if i not in damage:
            assert torch.equal(ds[i]["hidden_states"], decode_states(hf[i], meta))
            continue
        for read in (lambda: ds[i], lambda: decode_states(hf[i], meta)):
            with pytest.raises(IntegrityError, match=f"\\(sample {hf[i]['sample_id']}\\)") as refused:
                read()
            assert damage[i] in str(refused.value), str(refused.value)
    _, found = full_check(dataset, threads=2)
    assert sorted(f.check.split(":")[0] for f in found) == ["row 0", "row 3"]
    assert all(damage[int(f.check.split(":")[0].split()[1])] in f.check for f in found)


def test_check_dataset_refuses_a_frame_that_is_not_whole(packed, tmp_path):
    dataset = tmp_path / "dataset"
    shutil.copytree(packed["zstd"] / "dataset", dataset)
    path = dataset / "data-00000-of-00001.arrow"
    table = pa.ipc.open_stream(path.read_bytes()).read_all()
    frames = table["hidden_states"].to_pylist()
    frames[1] = frames[1][: len(frames[1]) // 2]  # cut short
    frames[2] = Compression("zstd", 1).encode(bf16_patterns(TOKENS - 1, 4, 128))  # a token short
    table = table.set_column(table.schema.get_field_index("hidden_states"), table.schema.field("hidden_states"),
                             pa.array(frames, pa.large_binary()))
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    with pytest.raises(DatasetCheckError) as refused:
        check_dataset(dataset)
    ids = table["sample_id"].to_pylist()
    assert f"sample {ids[1]} | check state_rows == seq_len | expected {TOKENS} | found -1" in str(refused.value)
    assert f"sample {ids[2]} | check state_rows == seq_len | expected {TOKENS} | found {TOKENS - 1}" in str(refused.value)


def flipped(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x24
    path.write_bytes(bytes(data))


def damaged_copy(packed: dict, codec: str, work: Path) -> tuple[Path, dict[int, str]]:
    """A copy of the `codec` dataset with reader exports made from it, then a byte flipped in the stored
    states of rows 1, 3 and 5 (raw: in captures 2, 0 and 3; zstd, fp8: inside the frame's compressed data)
    and in row 4's token ids: (the copy, {row: the capture named, "" for the tokens})."""
    from eagle3data.exports.specforge import export as export_specforge
    from eagle3data.exports.speculators import export as export_speculators
    from eagle3data.exports.vocab import write_vocab

    dataset = work / "dataset"
    shutil.copytree(packed[codec] / "dataset", dataset)
    write_vocab(dataset, packed["model"], 64, work / "token_freq.pt", work / "vocab_mapping.pt")
    export_speculators(dataset, work / "speculators", work / "token_freq.pt", work / "vocab_mapping.pt", states="reader")
    export_specforge(dataset, work / "specforge", packed["model"], work / "vocab_mapping.pt", states="reader")
    path = dataset / "data-00000-of-00001.arrow"
    data, table = path.read_bytes(), datasets.load_from_disk(str(dataset)).with_format("arrow")[:]
    damage = {}
    for row, capture, token, fraction in ((1, 2, 5, 1 / 2), (3, 0, 0, 1 / 3), (5, 3, TOKENS - 1, 3 / 4)):
        if codec != "none":
            frame = table["hidden_states"][row].as_py()
            flipped(path, data.index(frame) + int(len(frame) * fraction))
            damage[row] = "hidden_states_crc32"  # which captures the decoded values change in
        else:
            states = np.array(table["hidden_states"][row].as_py(), dtype=np.uint16)
            flipped(path, data.index(states.tobytes()) + ((token * 4 + capture) * 128 + 77) * 2 + 1)
            damage[row] = f"capture {capture} "
    ids = np.array(table["input_ids"][4].as_py(), dtype=np.int32)
    flipped(path, data.index(ids.tobytes()) + 4 * 10)
    damage[4] = "tokens_crc32"
    return dataset, damage


@pytest.mark.parametrize("codec", ["zstd", "none", "fp8"])
def test_a_flipped_byte_in_any_row_fails_every_reader_and_the_full_check_naming_row_and_capture(
        packed, tmp_path, codec, monkeypatch):
    from eagle3data.dataset.check import full_check, main as check_main
    from eagle3data.dataset.format import IntegrityError
    from eagle3data.exports.specforge_reader import PackedFeatures
    from eagle3data.exports.speculators_reader import PackedStatesTransfer

    dataset, damage = damaged_copy(packed, codec, tmp_path)
    ds, hf, meta = open_dataset(dataset), datasets.load_from_disk(str(dataset)), read_metadata(dataset)
    assert "hidden_states_stored_crc32" in hf.column_names  # each row checked on its stored bytes first
    speculators, specforge = PackedStatesTransfer(tmp_path / "speculators"), PackedFeatures(tmp_path / "specforge")
    assert ds.verification == "crc32"
    for i in range(SAMPLES):
        sid = hf[i]["sample_id"]
        readers = [lambda: ds[i], lambda: decode_states(hf[i], meta), lambda: speculators.get_cached(i),
                   lambda: specforge(i)]
        if i not in damage:
            for read in readers:
                read()
            continue
        for read in readers:
            with pytest.raises(IntegrityError) as refused:
                read()
            assert f"(sample {sid})" in str(refused.value) and damage[i] in str(refused.value), str(refused.value)
            assert f"row {i} (sample {sid})" in str(refused.value) or read is readers[1]
    with pytest.raises(IntegrityError, match="row 1 "):
        list(ds)
    assert "OK, 6 samples" in check_dataset(dataset)  # the quick check reads no values
    _, found = full_check(dataset, threads=2)
    assert sorted({f.check.split(":")[0] for f in found}) == [f"row {i}" for i in sorted(damage)]
    for f in found:
        assert damage[int(f.check.split(":")[0].split()[1])] in f.check
    assert check_main(["--full", str(dataset)]) == 1 and check_main([str(dataset)]) == 0
    changed = open_dataset(dataset, verify=False)[1]["hidden_states"]  # the documented switch: unverified
    monkeypatch.setenv("EAGLE3DATA_VERIFY", "0")
    assert open_dataset(dataset).verification == "off"
    assert torch.equal(open_dataset(dataset)[1]["hidden_states"].view(torch.int16), changed.view(torch.int16))
    if codec == "none":  # the values did change: only the checksums tell
        intact = open_dataset(packed[codec] / "dataset")[1]["hidden_states"]
        assert not torch.equal(intact.view(torch.int16), changed.view(torch.int16))


def test_a_flipped_byte_in_an_export_file_fails_its_reader_naming_row_and_capture(packed, tmp_path):
    """Files exports: speculators' hs_{i}.safetensors and SpecForge's data_<i>.ckpt state their CRC32s;
    this project's readers of them (the eagle3data backend, the SpecForge loader's wrapper) verify them, and
    the small files against the manifest."""
    from safetensors import safe_open
    from specforge.runtime.data_plane import feature_store

    from eagle3data.dataset.format import IntegrityError
    from eagle3data.exports.specforge import export as export_specforge
    from eagle3data.exports.specforge_reader import resolve
    from eagle3data.exports.speculators import export as export_speculators
    from eagle3data.exports.speculators_reader import transfer

    d, dataset = tmp_path, packed["zstd"] / "dataset"
    write_vocab_args = (dataset, packed["model"], 64, d / "token_freq.pt", d / "vocab_mapping.pt")
    from eagle3data.exports.vocab import write_vocab

    write_vocab(*write_vocab_args)
    export_speculators(dataset, d / "speculators", d / "token_freq.pt", d / "vocab_mapping.pt", states="files")
    export_specforge(dataset, d / "specforge", packed["model"], d / "vocab_mapping.pt", states="files")
    rows = transfer(d / "speculators")
    for i in range(SAMPLES):
        assert torch.equal(rows.get_cached(i)["hidden_states"], open_dataset(dataset)[i]["hidden_states"])
    hs = d / "speculators" / "hidden_states" / "hs_2.safetensors"
    with safe_open(str(hs), framework="pt") as f:
        sid = json.loads(f.metadata()["eagle3data.crc32"])["sample_id"]
    header = 8 + int.from_bytes(hs.read_bytes()[:8], "little")
    begin = json.loads(hs.read_bytes()[8:header])["hidden_states"]["data_offsets"][0]
    flipped(hs, header + begin + ((7 * 4 + 1) * 128 + 3) * 2)  # token 7, capture 1
    with pytest.raises(IntegrityError, match=f"hs_2.safetensors: row 2 \\(sample {sid}\\).*capture 1 "):
        transfer(d / "speculators").get_cached(2)
    ckpt = d / "specforge" / "hidden_states" / "data_00000003.ckpt"
    content = torch.load(ckpt, weights_only=False)
    aux = content["aux_hidden_state"].contiguous().view(torch.int16).numpy().tobytes()
    flipped(ckpt, ckpt.read_bytes().index(aux) + (9 * 3 + 2) * 128 * 2 + 11)  # token 9, capture 2
    assert resolve(str(ckpt.with_name("data_00000002.ckpt")),
                   feature_store.load_feature_file(str(ckpt.with_name("data_00000002.ckpt"))))
    with pytest.raises(IntegrityError, match="row 3 .*aux_hidden_state capture 2"):
        resolve(str(ckpt), feature_store.load_feature_file(str(ckpt)))
    table = next((d / "speculators").glob("data-*.arrow"))
    flipped(table, table.stat().st_size // 2)
    with pytest.raises(IntegrityError, match=f"{table.name}: CRC32"):
        transfer(d / "speculators").get_cached(0)
