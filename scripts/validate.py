"""Snakemake script for rule validate: see eagle3data.validate."""

from eagle3data.logs import redirect_output_to
from eagle3data.packed import restoring
from eagle3data.settings import Settings
from eagle3data.validate import ValidateJob, run

sm = snakemake  # noqa: F821
redirect_output_to(sm.log[0])
settings = Settings(dict(sm.config))
run(
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
        restore_from=restoring(settings.store_dir, sm.config["storage"]),
        samples_dir=str(settings.samples_dir),
        read_states=sm.params.read_states,
    )
)
