# `snakemake preflight`: what the run will do, before any GPU time: the model and the captures chosen
# for it, the chat template, conversations, shards, tokens, bytes against the free disk, and every
# setting that differs from the schema's defaults. Runs whenever asked for (no output to keep).
rule preflight:
    input:
        conversations=config["input"],
        model=model_source,
    log:
        f"{RUN_DIR}/logs/preflight.log",
    localrule: True
    conda:
        "../envs/eagle3data.yaml"
    params:
        schema=workflow.source_path("../config/schema.yaml"),
    message:
        "Preflight of run {RUN}: what it will compute and write"
    script:
        "../scripts/preflight.py"
