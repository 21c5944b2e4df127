"""Conversations that several shards hold: packed once, by the first shard that holds them.

Sample ids hash the conversation, so a conversation met again in a later shard has the same id (tokenize
records duplicates within one shard itself). One job reads the id column of every tokenized shard and
writes the ids that more than one shard holds, each with the first of them; every pack job reads that
one table. A shard's pack job thus depends on one file, not on every shard before it: pairwise inputs
made `snakemake -n` on 1,000 shards take 81 s, and each pack job re-read all earlier tables.
"""

from __future__ import annotations

import pandas as pd
import pyarrow.parquet as pq

from eagle3data.storage.store import atomic_path

COLUMNS = ["sample_id", "first_shard"]


def write_index(tokenized: list[str], out: str) -> pd.DataFrame:
    """The ids held by several of these shards (in shard order), with the first shard's position."""
    ids = pd.concat([pd.DataFrame({"sample_id": pq.read_table(p, columns=["sample_id"]).column(0).to_pylist(),
                                   "first_shard": i}) for i, p in enumerate(tokenized)], ignore_index=True)
    ids = ids.astype({"sample_id": "string", "first_shard": "int64"})
    index = ids[ids.duplicated("sample_id", keep=False)].drop_duplicates("sample_id")[COLUMNS]
    with atomic_path(out) as tmp:
        index.to_parquet(tmp, index=False)
    return index


def packed_earlier(index: str, shard: int) -> set[str]:
    """The ids that a shard before position `shard` packs: this shard records them as duplicates."""
    table = pd.read_parquet(index, columns=COLUMNS)
    return set(table.loc[table["first_shard"] < shard, "sample_id"])
