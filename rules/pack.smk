# Pack each validated shard into an Arrow file while later shards are extracted; then the dataset as an
# index over them (hard links, counts reconciled, quarantined included): seconds after the last shard.
# The packed files live in the store (states/<key>/packed/, eagle3data.dataset.packed), outside the declared
# outputs like the per-sample files: under storage.drop_packed_states (the default) they are the only
# copy. Each job compresses its shard's states with storage.compression.threads threads.


rule pack_shard:
    input:
        tokenized=rules.tokenize.output.tokenized,
        skipped=rules.tokenize.output.skipped,
        states=rules.validate.output.states,
        quarantined=rules.validate.output.quarantined,
        duplicates=rules.cross_shard_duplicates.output.index,
    output:
        summary=f"{RUN_DIR}/packed/shard-{{shard}}.json",
    log:
        f"{RUN_DIR}/logs/pack/shard-{{shard}}.log",
    benchmark:
        f"{RUN_DIR}/benchmarks/pack/shard-{{shard}}.tsv"
    conda:
        "../envs/eagle3data.yaml"
    threads: config["storage"]["compression"]["threads"]
    params:
        **PACKING_PARAMS,
        # Rule pack's outputs: the dataset is named when a shard packed again finds no room beside the
        # file the dataset still links; both stay params so that runs packed before keep their params.
        dataset=f"{RUN_DIR}/dataset",
        counts=f"{RUN_DIR}/dataset.counts.json",
    message:
        "Packing shard {wildcards.shard} (summary {output.summary})"
    script:
        "../scripts/pack_shard.py"


rule pack:
    input:
        summaries=expand(rules.pack_shard.output.summary, shard=SHARDS),
        skipped=expand(rules.tokenize.output.skipped, shard=SHARDS),
        quarantined=expand(rules.validate.output.quarantined, shard=SHARDS),
        parity=expand(rules.validate.output.parity, shard=SHARDS),
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
        "Indexing {N_SHARDS} packed shards as {output.dataset}"
    script:
        "../scripts/pack.py"
