"""The packed shards as the store's second home: where they live, and giving back a dropped file.

Each shard is packed into one Arrow file, `<store>/packed/shard-NNNNN.arrow` (`<store>` is the run's
`states/<key>` directory), beside the per-sample files and like them outside Snakemake's declared
outputs: Snakemake deletes the outputs of a job it re-runs or of a job that died, and a packed shard may
be the only copy of its states. Under the key, a packed shard never serves another model, capture set
or dtype.

With `storage.drop_packed_states` a shard's pack job deletes the store files of the samples it packed
once the packed file is durable, so the run keeps one copy of each state instead of two (a conversation
that a later shard meets again goes too once a packed shard holds the very bytes validate checked: a
shard's validate may have restored it). Any later job
that needs such a file (an extract, validate or pack job of a re-run) first restores it from the packed
shards (`restore_missing`): the same tensors, checked afterwards like every stored file (tokens by
extract and validate, checksums by pack). A sample that no packed shard holds stays missing and is
computed or reported as before. Without the setting nothing is restored: a store file gone then is
damage, and validate reports it (the corruption catalogue's `gone`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from eagle3data.utils.logs import get_logger
from eagle3data.contracts.reading import checksum
from eagle3data.storage.store import atomic_path, sample_path

logger = get_logger(__name__)
UNLINK_THREADS = 16


def packed_dir(store_dir: str | os.PathLike) -> Path:
    return Path(store_dir) / "packed"


def packed_shard_path(store_dir: str | os.PathLike, shard: str) -> Path:
    """Where shard `shard` (its five digits) is packed."""
    return packed_dir(store_dir) / f"shard-{shard}.arrow"


def restoring(store_dir: str | os.PathLike, storage: dict) -> str:
    """The store whose dropped files a job restores before reading: only under
    storage.drop_packed_states ("" otherwise, where a gone file is damage to report)."""
    return str(store_dir) if storage.get("drop_packed_states") else ""


def restore_missing(store_dir: str | os.PathLike, samples_dir: str | os.PathLike, sample_ids, n_captures: int,
                    hidden_size: int, dtype: str) -> list[str]:
    """Write back under `samples_dir` (the store, or its directory under storage.transport_dir), from the
    store's packed shards, the files of these samples that are missing there; the ids restored."""
    missing = {s for s in sample_ids if not sample_path(samples_dir, s).exists()}
    restored = []
    for sample_id, table, i, arrow in _packed_rows(store_dir, missing):
        _restore_file(sample_path(samples_dir, sample_id), table.slice(i, 1), n_captures, hidden_size, dtype,
                      f"{arrow}, row {i}")
        restored.append(sample_id)
    if restored:
        logger.info("restored %d dropped states files from the packed shards in %s", len(restored),
                    packed_dir(store_dir))
    return restored


def _restore_file(path: Path, table, n_captures: int, hidden_size: int, dtype: str, where: str) -> None:
    """A packed row (a table of one), verified against its checksums where the shard carries them, as the
    per-sample file it was, facts measured into its header. Torch and the tensor code are imported only
    here: the jobs that import this module rarely restore anything."""
    from safetensors.torch import save_file

    from eagle3data.dataset.format import read_rows, table_checker, torch_dtype
    from eagle3data.contracts.measuring import facts_header

    row = next(read_rows(table, n_captures, hidden_size, torch_dtype(dtype), table_checker(table, where, n_captures)))
    with atomic_path(path) as tmp:
        states = row["hidden_states"].contiguous()
        save_file({"hidden_states": states, "token_ids": row["input_ids"]}, tmp, metadata=facts_header(states))


def drop_packed(samples_dir: str | os.PathLike, sample_ids) -> int:
    """Delete the files of samples that a durable packed shard now holds; how many there were.
    Several at once: on the H200's disk one unlink of a just-written 16 MB file took ~10 ms, 7 s a shard."""
    def drop(sample_id: str) -> bool:
        try:
            sample_path(samples_dir, sample_id).unlink()
        except FileNotFoundError:
            return False
        return True

    with ThreadPoolExecutor(UNLINK_THREADS, thread_name_prefix="eagle3data-drop") as pool:
        return sum(pool.map(drop, sample_ids))


def held_elsewhere(store_dir: str | os.PathLike, checksums: dict[str, list[str]], n_captures: int,
                   hidden_size: int) -> list[str]:
    """Of these samples (id -> the checksums validate recorded, in slot order), those a packed shard
    holds bit for bit: a duplicate's file may go only when the copy that stays is the one validated."""
    from eagle3data.dataset.format import stored_states

    held = []
    for sample_id, table, i, _ in _packed_rows(store_dir, set(checksums)):
        states = stored_states(table, i, n_captures, hidden_size)
        if [checksum(states[:, slot, :]) for slot in range(n_captures)] == checksums[sample_id]:
            held.append(sample_id)
    return held


def _packed_rows(store_dir, wanted: set[str]) -> Iterator[tuple[str, object, int, Path]]:
    """Where the packed shards hold these samples, the first found of each: (id, the shard's table, the
    row, the shard's file). The files (Arrow streams, as `datasets` writes them) are memory-mapped, so only the ids and
    those rows' states are read; read with pyarrow alone: every extract job of a run with
    drop_packed_states asks here first, and importing `datasets` cost it ~0.5 s (up to 2 s on the H200's
    VM) while the engine waited."""
    wanted = set(wanted)
    if not wanted:
        return
    import pyarrow as pa

    for arrow in sorted(packed_dir(store_dir).glob("shard-*.arrow")):
        table = pa.ipc.open_stream(pa.memory_map(str(arrow))).read_all()  # the rows keep the map open
        for i, sample_id in enumerate(table.column("sample_id").to_pylist()):
            if sample_id in wanted:
                wanted.discard(sample_id)
                yield sample_id, table, i, arrow
        if not wanted:
            return


def remove_orphans(store_dir: str | os.PathLike, current: list[str]) -> list[Path]:
    """Delete packed shards that no shard of the run packs any more (the input shrank); the removed."""
    keep = {Path(p).resolve() for p in current}
    orphans = [p for p in packed_dir(store_dir).glob("shard-*.arrow") if p.resolve() not in keep]
    for path in orphans:
        logger.info("removing %s: no shard of the run packs into it any more", path)
        path.unlink()
    return orphans

