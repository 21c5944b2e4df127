# eagle3-datagen: chat conversations in, EAGLE-3 training data (target hidden states) out.
# (regenerate ->) tokenize -> extract -> validate -> pack -> vocab -> report (+ trainer exports); see README.md.


# The demo runs when no config file is given; a user's --configfile is completed with the schema's
# defaults (config/schema.yaml), never with the demo's values.
if not workflow.overwrite_configfiles:

    configfile: "config/demo.yaml"


include: "rules/common.smk"
include: "rules/model.smk"
include: "rules/regenerate.smk"
include: "rules/tokenize.smk"
include: "rules/extract.smk"
include: "rules/validate.smk"
include: "rules/pack.smk"
include: "rules/report.smk"
include: "rules/vocab.smk"
include: "rules/export.smk"
include: "rules/preflight.smk"


rule all:
    default_target: True
    input:
        rules.pack.output.dataset,
        rules.vocab.output,
        rules.report.output,
        EXPORTS,
        REGENERATE_OUTPUTS,


# Before any job starts (not in dry runs): what the first GPU job would find wrong (rules/common.smk).
onstart:
    check_before_jobs()


onsuccess:
    engine_pool.stop_idle_of_run(RUN_DIR)


onerror:
    print(
        f"eagle3-datagen: a job failed. Logs are under {RUN_DIR}/logs/; finished samples are kept in "
        f"{RUN_DIR}/states/ and the same command re-runs only what is missing or failed."
    )
    print(failed_samples.summary(f"{RUN_DIR}/extract"))
