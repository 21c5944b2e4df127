"""The store's write contract: renamed only when whole, durable before a shard is declared done."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3data.storage import store


def test_a_failed_write_leaves_neither_the_file_nor_its_temporary(tmp_path):
    target = tmp_path / "ab" / "sample.safetensors"
    with pytest.raises(RuntimeError), store.atomic_path(target, durable=False) as tmp:
        Path(tmp).write_bytes(b"half a file")
        raise RuntimeError("the writer died")
    assert list(tmp_path.rglob("*")) == [tmp_path / "ab"]


def record_fsyncs(monkeypatch) -> list[str]:
    """The path of every file or directory fsynced from now on (the real fsync still runs)."""
    synced: list[str] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    return synced


def test_deferred_writes_are_renamed_at_once_and_synced_by_make_durable(tmp_path, monkeypatch):
    synced = record_fsyncs(monkeypatch)
    paths = [store.sample_path(tmp_path, f"{prefix}{i:06d}") for prefix in ("aa", "bb") for i in range(3)]
    for path in paths:
        with store.atomic_path(path, durable=False) as tmp:
            Path(tmp).write_bytes(path.name.encode())
    assert synced == []  # nothing waited for while the engine runs
    assert [p.read_bytes() for p in paths] == [p.name.encode() for p in paths]
    store.make_durable(paths)
    assert sorted(synced) == sorted([str(p) for p in paths] + [str(tmp_path / "aa"), str(tmp_path / "bb")])


def test_files_synced_early_are_not_synced_again_and_their_directories_are_synced_last(tmp_path, monkeypatch):
    synced = record_fsyncs(monkeypatch)
    paths = [store.sample_path(tmp_path, f"aa{i:06d}") for i in range(4)]
    for path in paths[:3]:
        with store.atomic_path(path, durable=False) as tmp:
            Path(tmp).write_bytes(b"states")
    paths[2].unlink()  # a failed sample, removed while its sync was coming
    early = store.start_syncing(paths[:3]).result()
    assert early == set(paths[:2]) and sorted(synced) == sorted(str(p) for p in paths[:2])
    with store.atomic_path(paths[3], durable=False) as tmp:  # the last file, landed meanwhile
        Path(tmp).write_bytes(b"states")
    synced.clear()
    store.make_durable([paths[0], paths[1], paths[3]], early)
    assert synced == [str(paths[3]), str(tmp_path / "aa")]


def test_durable_writes_sync_the_file_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    synced = record_fsyncs(monkeypatch)
    store.atomic_write_text(tmp_path / "manifest.json", "{}")
    assert synced == [str(tmp_path / f".manifest.json.tmp-{os.getpid()}"), str(tmp_path)]


def test_writeback_starts_on_linux():
    assert store._sync_file_range is not None  # otherwise make_durable does all the work, at the end


def test_pack_reads_a_file_and_its_crcs_as_torch_wrote_them_without_importing_torch(tmp_path):
    """In a process that never imports torch (as pack_shard's job starts), reading.load_states returns the
    bf16 bit patterns that safetensors wrote from torch, and each capture's CRC, taken in place on the
    strided slice, equals zlib's CRC of that capture's bytes copied out by torch."""
    import zlib

    import torch
    from safetensors.torch import save_file

    states = torch.randn(5, 3, 8).to(torch.bfloat16)
    path = tmp_path / "sample.safetensors"
    save_file({"hidden_states": states, "token_ids": torch.arange(5)}, str(path))
    expected = [f"{zlib.crc32(states[:, slot].contiguous().view(torch.uint8).numpy()):08x}" for slot in range(3)]
    code = (
        "import sys; from eagle3data.dataset import pack, index; from eagle3data.validate import stage; from eagle3data.contracts.reading import checksum, load_states; "
        f"x = load_states({str(path)!r}); print(x.dtype, list(x.shape), [checksum(x[:, s, :]) for s in range(3)], "
        "'torch' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.split(" ", 1) == ["uint16", f"[5, 3, 8] {expected} False\n"]
