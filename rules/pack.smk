# Pack all validated shards into one Hugging Face Arrow dataset; counts reconciled, quarantined included.
rule pack:
    input:
        tokenized=expand(rules.tokenize.output.tokenized, shard=SHARDS),
        skipped=expand(rules.tokenize.output.skipped, shard=SHARDS),
        states=expand(rules.validate.output.states, shard=SHARDS),
        quarantined=expand(rules.validate.output.quarantined, shard=SHARDS),
    output:
        dataset=directory(f"{RUN_DIR}/dataset"),
        counts=f"{RUN_DIR}/dataset.counts.json",
    log:
        f"{RUN_DIR}/logs/pack.log",
    benchmark:
        f"{RUN_DIR}/benchmarks/pack.tsv"
    conda:
        "../envs/eagle3data.yaml"
    params:
        conversations_in=N_CONVERSATIONS,
    message:
        "Packing {N_SHARDS} shards into {output.dataset}"
    script:
        "../scripts/pack.py"
