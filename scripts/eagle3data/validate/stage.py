"""The `validate` stage: every sample of a shard checked against its tokens and the capture contract.

A file whose header holds the facts the connector measured as it wrote it (contracts/states.py) is judged by them
without reading its states (`validation.read_states` reads them anyway); pack compares the checksums as
it reads the bytes.

Lazy throughout: the tokenized shard, the extract manifest, every sample's file and every capture are
checked before anything fails, so one run lists every problem (sample, check, expected, found) under a
header saying how many samples failed and which files to look at. Then `validation.policy` decides:

- fail (the default): raise; no output is written, so nothing from this shard can be packed;
- quarantine: the failing samples are set aside (quarantine.py) and recorded as skipped, the rest is
  written for pack.

Then the parity gate (parity.py) holds a few of the samples left against the checkpoint; when it fails,
nothing is written under either policy.

A broken table (a tokenized sample breaking its contract; an extract manifest missing a sample, listing
one twice or listing a foreign one) fails under either policy: no file can be set aside to repair it.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import pandas as pd
from tqdm import tqdm

from eagle3data.contracts.failures import BoundaryError, summary, validate
from eagle3data.utils.logs import get_logger
from eagle3data.validate.quarantine import quarantine
from eagle3data.contracts.schemas import (
    ExtractCoverage,
    ExtractManifest,
    StatesFile,
    StatesManifest,
    extract_coverage,
    sample_states,
    tokenized_contract,
)
from eagle3data.contracts.states import Expected, file_facts, header_facts
from eagle3data.storage.store import Store, atomic_path, atomic_write_text

if TYPE_CHECKING:
    from eagle3data.validate.parity import ParityJob

logger = get_logger(__name__)


@dataclass
class ValidateJob:
    tokenized: str
    extract_manifest: str
    states_out: str
    quarantined_out: str
    quarantine_dir: str
    expected: Expected
    vocab_size: int
    sequence: dict
    policy: str = "fail"
    threads: int = 1  # files checked at once
    store: Store | None = None  # the run's store, which gives back dropped files first; None: none comes back
    read_states: bool = False  # measure every file's bytes even where its header holds the written facts
    parity: ParityJob | None = None  # the parity gate (parity.py), its samples filled in here; None: off
    parity_out: str = ""  # its verdict


def _tables(job: ValidateJob) -> tuple[pd.DataFrame, pd.DataFrame, list]:
    """The tokenized shard and the extract manifest, checked: (tokenized, extracted, failures)."""
    contract = tokenized_contract(job.vocab_size, job.sequence["min_seq_len"], job.sequence["max_seq_len"])
    tokenized, found = validate(contract, pd.read_parquet(job.tokenized), job.tokenized)
    extracted, bad = validate(ExtractManifest, pd.read_parquet(job.extract_manifest), job.extract_manifest)
    found += bad
    if not any(f.sample_id == "-" for f in found):  # both tables have their columns
        found += validate(ExtractCoverage, extract_coverage(tokenized, extracted), job.extract_manifest)[1]
    return tokenized, extracted, found


def _samples(job: ValidateJob, tokenized: pd.DataFrame, todo: pd.DataFrame) -> tuple[pd.DataFrame, list]:
    """Each sample's file, then each capture of the files holding the right tensors, from the facts the
    connector wrote in its header or else measured from its bytes: (manifest, failures)."""
    expected = job.expected
    ids = dict(zip(tokenized["sample_id"], tokenized["input_ids"]))
    headers = [file_facts(s, p, ids[s]) for s, p in zip(todo["sample_id"], todo["path"])]
    files = pd.DataFrame(headers, columns=list(StatesFile.to_schema().columns))
    found = validate(expected.file_contract(), files, job.extract_manifest)[1]
    failed = {f.sample_id for f in found}
    rows, to_measure, by_facts = [], [], 0
    for header in headers:
        if header["sample_id"] in failed:
            continue
        written = None if job.read_states else header_facts(header["sample_id"], header["path"],
                                                            header["written"], header["shape"], expected)
        if written is None:
            to_measure.append((header["sample_id"], header["path"]))
        else:
            rows += written
            by_facts += 1
    logger.info("%d samples checked by the facts measured as their states were written (pack reads and "
                "checks their bytes), %d measured from their files%s", by_facts, len(to_measure),
                " (validation.read_states)" if job.read_states else "")
    if to_measure:  # torch is imported only then: a job that judges headers alone starts without it
        rows += _measured(to_measure, expected, job.threads)
    manifest, bad = validate(expected.manifest_contract(),
                             pd.DataFrame(rows, columns=list(StatesManifest.to_schema().columns)), job.extract_manifest)
    found += bad
    covered = tokenized[tokenized["sample_id"].isin(set(files["sample_id"]) - failed)]
    found += validate(expected.samples_contract(), sample_states(manifest, covered), job.extract_manifest)[1]
    return manifest, found


def _measured(samples: list[tuple[str, str]], expected: Expected, threads: int) -> list[dict]:
    """StatesManifest rows of these (sample id, path) files, measured from their bytes."""
    from eagle3data.contracts.measuring import capture_facts

    rows = []
    with ThreadPoolExecutor(threads, thread_name_prefix="eagle3data-validate") as pool:
        measured = pool.map(lambda sample: capture_facts(*sample, expected), samples)
        for facts in tqdm(measured, total=len(samples), desc="validate", unit="sample", mininterval=5):
            rows += facts
    return rows


def _parity(job: ValidateJob, tokenized: pd.DataFrame, manifest: pd.DataFrame, paths: dict) -> dict:
    """The parity gate's verdict over the shard's validated samples (raises when it fails)."""
    if job.parity is None:
        return {"status": "off", "ok": None}
    from eagle3data.validate.parity import gate  # torch and the checkpoint's tensors: only for the gate

    validated = set(manifest["sample_id"])
    samples = [(s, paths[s]) for s in tokenized["sample_id"] if s in validated]
    return gate(replace(job.parity, samples=samples))


def run(job: ValidateJob) -> pd.DataFrame:
    tokenized, extracted, table = _tables(job)
    found = []
    manifest = pd.DataFrame(columns=list(StatesManifest.to_schema().columns))
    if not any(f.sample_id == "-" for f in table):
        todo = extracted.drop_duplicates("sample_id")
        todo = todo[todo["sample_id"].isin(tokenized["sample_id"])
                    & ~todo["sample_id"].isin({f.sample_id for f in table})]
        if job.store is not None:
            job.store.ensure(todo["sample_id"])
        manifest, found = _samples(job, tokenized, todo)
    files = [job.tokenized, job.extract_manifest]
    if table or (found and job.policy == "fail"):
        title = (f"validation of {job.tokenized} failed (policy {job.policy}"
                 f"{'; a broken table fails under any policy' if table else ''}); nothing from this "
                 "shard is packed")
        raise BoundaryError(summary(title, table + found, len(tokenized), files))
    failed = {f.sample_id for f in found}
    paths = dict(zip(extracted["sample_id"], extracted["path"]))
    quarantined = quarantine(found, tokenized, paths, job.quarantine_dir)
    if found:
        logger.warning(summary(
            f"validation of {job.tokenized} (policy quarantine): quarantined in {job.quarantine_dir}, "
            "packed as skipped, re-extracted on the next run", found, len(tokenized), files))
    manifest = manifest[~manifest["sample_id"].isin(failed)]
    verdict = _parity(job, tokenized, manifest, paths)
    with atomic_path(job.states_out) as tmp:
        manifest.to_parquet(tmp, index=False)
    with atomic_path(job.quarantined_out) as tmp:
        quarantined.to_parquet(tmp, index=False)
    if job.parity_out:
        atomic_write_text(job.parity_out, json.dumps(verdict, indent=1))
    logger.info("validated %d samples of %s: %d packable, %d quarantined",
                len(tokenized), job.tokenized, manifest["sample_id"].nunique(), len(quarantined))
    return manifest
