# Check every sample's states file against its tokens and the capture contract; quarantine or fail;
# then hold a few samples against the checkpoint (the parity gate, eagle3data.validate.parity).
rule validate:
    input:
        tokenized=rules.tokenize.output.tokenized,
        manifest=rules.extract.output.manifest,
        stats=rules.extract.output.stats,
    output:
        states=f"{RUN_DIR}/validated/shard-{{shard}}.parquet",
        quarantined=f"{RUN_DIR}/validated/shard-{{shard}}.quarantined.parquet",
        parity=f"{RUN_DIR}/validated/shard-{{shard}}.parity.json",
    log:
        f"{RUN_DIR}/logs/validate/shard-{{shard}}.log",
    benchmark:
        f"{RUN_DIR}/benchmarks/validate/shard-{{shard}}.tsv"
    conda:
        "../envs/eagle3data.yaml"
    threads: config["validation"]["threads"]
    resources:
        mem_mb=validate_mem_mb,
    params:
        **CHECKED_PARAMS,
        policy=config["validation"]["policy"],
        read_states=config["validation"]["read_states"],
        parity=config["parity"],
        quarantine_dir=f"{RUN_DIR}/quarantine/shard-{{shard}}",
    message:
        "Validating shard {wildcards.shard} (policy {params.policy})"
    script:
        "../scripts/validate.py"
