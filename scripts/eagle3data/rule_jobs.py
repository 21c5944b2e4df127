"""The jobs of rules validate, pack_shard and pack, from the `snakemake` object their scripts get."""

from __future__ import annotations

import json
from pathlib import Path

from eagle3data.dataset.index import IndexJob, index
from eagle3data.utils.logs import redirect_output_to
from eagle3data.dataset.pack import ShardPackJob
from eagle3data.dataset.pack import pack_shard as pack_one_shard
from eagle3data.config.settings import Settings
from eagle3data.validate.stage import ValidateJob
from eagle3data.validate.stage import run as run_validate


def _started(sm) -> Settings:
    """The job's output to its log, and the run's settings: what every job here begins with."""
    redirect_output_to(sm.log[0])
    return Settings(dict(sm.config))


def validate(sm) -> None:
    """Rule validate: see eagle3data.validate.stage."""
    settings = _started(sm)
    run_validate(
        ValidateJob(
            tokenized=sm.input.tokenized,
            extract_manifest=sm.input.manifest,
            states_out=sm.output.states,
            quarantined_out=sm.output.quarantined,
            quarantine_dir=sm.params.quarantine_dir,
            expected=settings.expected,
            vocab_size=settings.model.vocab_size,
            sequence=dict(sm.params.sequence),
            policy=sm.params.policy,
            threads=sm.threads,
            store=settings.store,
            read_states=sm.params.read_states,
            parity=_parity_job(sm, settings),
            parity_out=sm.output.parity,
        )
    )


def _parity_job(sm, settings: Settings):
    """The validate job's parity gate (validate/parity.py), its samples left to fill; None when off."""
    if not sm.params.parity["enabled"]:
        return None
    from eagle3data.validate.parity import ParityJob, ParitySettings

    stats = json.loads(Path(sm.input.stats).read_text())
    return ParityJob(
        shard=sm.wildcards.shard,
        model_path=sm.params.model["path"],
        trust_remote_code=sm.params.model["trust_remote_code"],
        captures=settings.expected.captures,
        num_hidden_layers=settings.model.num_hidden_layers,
        settings=ParitySettings.from_config(sm.params.parity),
        samples=[],
        log_probs=stats.get("parity_log_probs", {}),
    )


def pack_shard(sm) -> None:
    """Rule pack_shard: see eagle3data.dataset.pack.pack_shard."""
    settings = _started(sm)
    pack_one_shard(
        ShardPackJob(
            tokenized=sm.input.tokenized,
            skipped=sm.input.skipped,
            states=sm.input.states,
            quarantined=sm.input.quarantined,
            duplicates=sm.input.duplicates,
            shard=int(sm.wildcards.shard),
            arrow=str(settings.store.packed_shard(sm.wildcards.shard)),
            summary=sm.output.summary,
            metadata=settings.dataset_metadata(),
            store=settings.store,
            dataset=sm.params.dataset,
            threads=sm.threads,
        )
    )


def pack(sm) -> None:
    """Rule pack, the dataset over the packed shards: see eagle3data.dataset.index."""
    settings = _started(sm)
    index(
        IndexJob(
            summaries=list(sm.input.summaries),
            skipped=list(sm.input.skipped),
            quarantined=list(sm.input.quarantined),
            out_dir=sm.output.dataset,
            counts_out=sm.output.counts,
            conversations_in=sm.params.conversations_in,
            metadata={**settings.dataset_metadata(), "parity": _parity_summary(sm.input.parity)},
            store=settings.store,
        )
    )


def _parity_summary(verdicts: list[str]) -> dict:
    from eagle3data.validate.parity import summarize

    return summarize([json.loads(Path(p).read_text()) for p in verdicts])
