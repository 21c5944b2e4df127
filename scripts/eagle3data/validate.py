"""The `validate` stage: every sample of a shard checked against its tokens and the capture contract.

All samples are checked before failing (like pandera's lazy mode), so one run lists every problem. The
output is the states manifest (one row per sample per capture), which `pack` reads; a shard that fails
writes no manifest, so it can never be packed.
"""

from __future__ import annotations

import pandas as pd
from tqdm import tqdm

from eagle3data.logs import get_logger
from eagle3data.schemas import BoundaryError, ExtractManifest, StatesManifest, TokenizedShard, check
from eagle3data.states import Expected, inspect_states
from eagle3data.store import atomic_path

logger = get_logger(__name__)


def membership_problems(tokenized: pd.DataFrame, extracted: pd.DataFrame) -> list[str]:
    """Every tokenized sample extracted exactly once, and nothing else."""
    problems = []
    counts = extracted["sample_id"].value_counts()
    for sid in counts[counts > 1].index:
        problems.append(f"sample {sid}: listed {counts[sid]} times in the extract manifest, expected once")
    missing = set(tokenized["sample_id"]) - set(extracted["sample_id"])
    extra = set(extracted["sample_id"]) - set(tokenized["sample_id"])
    problems += [f"sample {sid}: tokenized but missing from the extraction output" for sid in sorted(missing)]
    problems += [f"sample {sid}: extracted but not in the tokenized shard" for sid in sorted(extra)]
    return problems


def run(tokenized_path: str, extract_manifest_path: str, out_path: str, expected: Expected) -> pd.DataFrame:
    tokenized = check(TokenizedShard, pd.read_parquet(tokenized_path), f"tokenized shard {tokenized_path}")
    extracted = pd.read_parquet(extract_manifest_path)
    problems = membership_problems(tokenized, extracted)
    extracted = check(ExtractManifest, extracted.drop_duplicates("sample_id"), extract_manifest_path)
    ids_by_sample = dict(zip(tokenized["sample_id"], tokenized["input_ids"]))
    rows, failed = [], set()
    for sample in tqdm(extracted.itertuples(index=False), total=len(extracted), desc="validate",
                       unit="sample", mininterval=5):
        if sample.sample_id not in ids_by_sample:
            continue
        sample_rows, sample_problems = inspect_states(
            sample.sample_id, sample.path, ids_by_sample[sample.sample_id], expected
        )
        rows += sample_rows
        if sample_problems:
            failed.add(sample.sample_id)
            problems += sample_problems
    if problems:
        raise BoundaryError(
            f"validation failed for {len(failed) or len(problems)} sample(s) of {len(tokenized)} in "
            f"{tokenized_path} (states from {extract_manifest_path}); nothing from this shard is "
            "packed:\n" + "\n".join(f"  {p}" for p in problems)
        )
    columns = list(StatesManifest.to_schema().columns)
    manifest = check(StatesManifest, pd.DataFrame(rows, columns=columns), f"states manifest for {tokenized_path}")
    with atomic_path(out_path) as tmp:
        manifest.to_parquet(tmp, index=False)
    logger.info("validated %d samples of %s", len(extracted), tokenized_path)
    return manifest
