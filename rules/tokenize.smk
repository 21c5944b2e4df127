# Render each shard's conversations with the chat template; assistant-only loss mask; skips recorded.
rule tokenize:
    input:
        unpack(tokenize_conversations),
        model=model_source,
    output:
        tokenized=f"{RUN_DIR}/tokenized/shard-{{shard}}.parquet",
        skipped=f"{RUN_DIR}/tokenized/shard-{{shard}}.skipped.parquet",
    log:
        f"{RUN_DIR}/logs/tokenize/shard-{{shard}}.log",
    benchmark:
        f"{RUN_DIR}/benchmarks/tokenize/shard-{{shard}}.tsv"
    conda:
        "../envs/eagle3data.yaml"
    params:
        rows=shard_rows,
        model_path=config["model"]["path"],
        trust_remote_code=config["model"]["trust_remote_code"],
        chat_template_kwargs=config["model"]["chat_template_kwargs"],
        sequence=config["sequence"],
    message:
        "Tokenizing shard {wildcards.shard}"
    script:
        "../scripts/tokenize_shard.py"


rule cross_shard_duplicates:
    input:
        tokenized=expand(rules.tokenize.output.tokenized, shard=SHARDS),
    output:
        index=f"{RUN_DIR}/tokenized/duplicates.parquet",
    log:
        f"{RUN_DIR}/logs/tokenize/duplicates.log",
    benchmark:
        f"{RUN_DIR}/benchmarks/tokenize/duplicates.tsv"
    conda:
        "../envs/eagle3data.yaml"
    message:
        "Listing conversations that several of the {N_SHARDS} shards hold"
    script:
        "../scripts/duplicates.py"
