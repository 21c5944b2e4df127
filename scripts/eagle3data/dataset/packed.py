"""The packed shards as the store's second home: where they live, and giving back a dropped file.

Each shard is packed into one Arrow file, `<store>/packed/shard-NNNNN.arrow` (`<store>` is the run's
`states/<key>` directory), beside the per-sample files and like them outside Snakemake's declared
outputs: Snakemake deletes the outputs of a job it re-runs or of a job that died, and a packed shard may
be the only copy of its states. Under the key, a packed shard never serves another model, capture set
or dtype.

With `storage.drop_packed_states` a shard's pack job has the store drop the files of the samples it packed
once the packed file is durable (`Store.drop`), so the run keeps one copy of each state instead of two (a
conversation that a later shard meets again goes too once a packed shard holds the very bytes validate
checked: a shard's validate may have restored it). Any later job that needs such a file (an extract, validate
or pack job of a re-run) first has the store give it back (`Store.ensure`, through `restore` here, which the
settings hand the store): the same tensors, checked afterwards like every stored file (tokens by extract and
validate, checksums by pack). A sample that no packed shard holds stays missing and is computed or reported as
before. Without the setting nothing is restored: a store file gone then is damage, and validate reports it
(the corruption catalogue's `gone`). A row packed as fp8_e4m3 codes (`storage.compression.precision`) holds
no longer the values captured, so it gives back nothing: its sample counts as held by no packed shard, and
extract computes it again.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from eagle3data.utils.logs import get_logger
from eagle3data.contracts.reading import checksum
from eagle3data.storage.store import Store, atomic_path

logger = get_logger(__name__)


def restore(store: Store, sample_ids: list[str], n_captures: int, hidden_size: int, dtype: str) -> list[str]:
    """Write back into the store (`Store.path`: its samples directory), from its packed shards, the
    files of these samples; the ids restored. The store's `restore` under storage.drop_packed_states
    (`Settings.store`), which asks only for the files missing."""
    restored, lossy = [], []
    for sample_id, table, i, arrow in _packed_rows(store, set(sample_ids)):
        if _lossy(table, i):
            lossy.append(sample_id)
            continue
        _restore_file(store.path(sample_id), table.slice(i, 1), n_captures, hidden_size, dtype, f"{arrow}, row {i}")
        restored.append(sample_id)
    if restored:
        logger.info("restored %d dropped states files from the packed shards in %s", len(restored), store.packed)
    if lossy:
        logger.warning("not restored: %d dropped states files whose packed rows in %s hold fp8_e4m3 codes (lossy), "
                       "not the captured values; extract computes them again (a validate or pack job that needs "
                       "them fails: run the shard's extract again, snakemake --forcerun extract)",
                       len(lossy), store.packed)
    return restored


def _lossy(table, i: int) -> bool:
    """Whether a packed row holds lossy codes (storage/compression.py's `precision`); a row that is no frame
    goes on to be verified, and refused, as it is."""
    import pyarrow as pa

    from eagle3data.dataset.format import stored_bytes
    from eagle3data.storage.compression import FrameError, precision

    stored = stored_bytes(table, i)
    try:
        return isinstance(stored, pa.Buffer) and precision(stored) != "exact"
    except FrameError:
        return False


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


def held_elsewhere(store: Store, checksums: dict[str, list[str]], n_captures: int,
                   hidden_size: int) -> list[str]:
    """Of these samples (id -> the checksums validate recorded, in slot order), those a packed shard
    holds bit for bit: a duplicate's file may go only when the copy that stays is the one validated."""
    from eagle3data.dataset.format import stored_states

    held = []
    for sample_id, table, i, _ in _packed_rows(store, set(checksums)):
        states = stored_states(table, i, n_captures, hidden_size)
        if [checksum(states[:, slot, :]) for slot in range(n_captures)] == checksums[sample_id]:
            held.append(sample_id)
    return held


def _packed_rows(store: Store, wanted: set[str]) -> Iterator[tuple[str, object, int, Path]]:
    """Where the packed shards hold these samples, the first found of each: (id, the shard's table, the
    row, the shard's file). The files (Arrow streams, as `datasets` writes them) are memory-mapped, so only the ids and
    those rows' states are read; read with pyarrow alone: every extract job of a run with
    drop_packed_states asks here first, and importing `datasets` cost it ~0.5 s (up to 2 s on a GPU
    node) while the engine waited."""
    wanted = set(wanted)
    if not wanted:
        return
    import pyarrow as pa

    for arrow in sorted(store.packed.glob("shard-*.arrow")):
        table = pa.ipc.open_stream(pa.memory_map(str(arrow))).read_all()  # the rows keep the map open
        for i, sample_id in enumerate(table.column("sample_id").to_pylist()):
            if sample_id in wanted:
                wanted.discard(sample_id)
                yield sample_id, table, i, arrow
        if not wanted:
            return


def remove_orphans(store: Store, current: list[str]) -> list[Path]:
    """Delete packed shards that no shard of the run packs any more (the input shrank); the removed."""
    keep = {Path(p).resolve() for p in current}
    orphans = [p for p in store.packed.glob("shard-*.arrow") if p.resolve() not in keep]
    for path in orphans:
        logger.info("removing %s: no shard of the run packs into it any more", path)
        path.unlink()
    return orphans

