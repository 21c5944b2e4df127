# Optional (regenerate.enabled): the target model writes the assistant turns anew before tokenize.
rule regenerate:
    input:
        conversations=config["input"],
        model=model_source,
    output:
        conversations=f"{RUN_DIR}/regenerated/shard-{{shard}}.jsonl",
        responses=f"{RUN_DIR}/regenerated/shard-{{shard}}.responses.parquet",
        stats=f"{RUN_DIR}/regenerated/shard-{{shard}}.stats.json",
    log:
        f"{RUN_DIR}/logs/regenerate/shard-{{shard}}.log",
    benchmark:
        f"{RUN_DIR}/benchmarks/regenerate/shard-{{shard}}.tsv"
    conda:
        "../envs/eagle3data.yaml"
    threads: 2
    resources:
        gpu=GPUS_PER_EXTRACT,
        mem_mb=lambda wildcards, attempt: EXTRACT_MEM_MB * attempt,  # the same engine as extract
    # What shapes the responses (eagle3data.config.settings.regeneration_params); engine settings are read
    # at run time. The journal (responses stored as they finish, not an output: a failed or killed job
    # keeps it) makes a re-run generate only what is missing.
    params:
        **REGENERATION_PARAMS,
        rows=shard_rows,
        journal=f"{RUN_DIR}/regenerated/journal/shard-{{shard}}.jsonl",
    message:
        "Regenerating the responses of shard {wildcards.shard} with the target model"
    script:
        "../scripts/regenerate.py"


# Response lengths before and after, and finish reasons, for `snakemake --report`.
rule regenerate_report:
    input:
        responses=expand(rules.regenerate.output.responses, shard=SHARDS),
        stats=expand(rules.regenerate.output.stats, shard=SHARDS),
    output:
        summary=report(
            f"{RUN_DIR}/report/regenerate.html",
            category="Regeneration",
            caption="../report/regenerate.rst",
        ),
        lengths=report(
            f"{RUN_DIR}/report/regenerate_lengths.svg",
            category="Regeneration",
            caption="../report/regenerate.rst",
        ),
    log:
        f"{RUN_DIR}/logs/regenerate_report.log",
    conda:
        "../envs/eagle3data.yaml"
    message:
        "Writing the regeneration report"
    script:
        "../scripts/regenerate_report.py"


# Asked for by rule all when regeneration is on.
REGENERATE_OUTPUTS = (
    rules.regenerate_report.output if config["regenerate"]["enabled"] else []
)
