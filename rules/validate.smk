# Check every sample's states file against its tokens and the capture contract.
rule validate:
    input:
        tokenized=rules.tokenize.output.tokenized,
        manifest=rules.extract.output.manifest,
    output:
        states=f"{RUN_DIR}/validated/shard-{{shard}}.parquet",
    log:
        f"{RUN_DIR}/logs/validate/shard-{{shard}}.log",
    benchmark:
        f"{RUN_DIR}/benchmarks/validate/shard-{{shard}}.tsv"
    conda:
        "../envs/eagle3data.yaml"
    params:
        model=config["model"],
        captures=config["captures"],
    message:
        "Validating shard {wildcards.shard}"
    script:
        "../scripts/validate.py"
