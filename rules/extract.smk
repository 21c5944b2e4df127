# Run the target model (vLLM) over a shard and store each sample's hidden states; reuses finished ones.
from eagle3data.engine import pool as engine_pool
from eagle3data.capture import failed_samples


rule extract:
    input:
        tokenized=rules.tokenize.output.tokenized,
        model=model_source,
        quarantined=quarantine_records,
    output:
        manifest=f"{RUN_DIR}/extract/shard-{{shard}}.parquet",
        stats=f"{RUN_DIR}/extract/shard-{{shard}}.stats.json",
    log:
        f"{RUN_DIR}/logs/extract/shard-{{shard}}.log",
    benchmark:
        f"{RUN_DIR}/benchmarks/extract/shard-{{shard}}.tsv"
    conda:
        "../envs/eagle3data.yaml"
    threads: 2
    resources:
        gpu=GPUS_PER_EXTRACT,
        mem_mb=lambda wildcards, attempt: EXTRACT_MEM_MB * attempt,
    # What determines the data (eagle3data.config.settings.data_params): a change re-runs the job, which
    # recomputes what no longer matches. The engine settings are read at run time: they re-run nothing.
    params:
        **DATA_PARAMS,
        rows=shard_rows,
    message:
        "Extracting hidden states for shard {wildcards.shard} ({resources.gpu} GPUs, "
        "{resources.mem_mb} MB)"
    script:
        "../scripts/extract.py"


# `snakemake retry_failed`: re-run only the extract jobs of the shards whose last run recorded failed
# samples (extract/shard-NNNNN.failed.json, see eagle3data.capture.failed_samples); each computes only those.
FAILED_SHARDS = glob_wildcards(f"{RUN_DIR}/extract/shard-{{shard}}.failed.json").shard


rule retry_failed:
    input:
        expand(
            rules.extract.output.manifest,
            shard=sorted(set(SHARDS) & set(FAILED_SHARDS)),
        ),
