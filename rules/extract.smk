# Run the target model (vLLM) over a shard and store each sample's hidden states; reuses finished ones.
rule extract:
    input:
        tokenized=rules.tokenize.output.tokenized,
        model=model_input,
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
    params:
        model=config["model"],
        captures=config["captures"],
        sequence=config["sequence"],
        engine=config["engine"],
        rows=shard_rows,
    message:
        "Extracting hidden states for shard {wildcards.shard} ({resources.gpu} GPUs)"
    script:
        "../scripts/extract.py"
