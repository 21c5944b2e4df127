# Token frequencies over trainable tokens and the draft vocabulary they choose (both trainers read them).
rule vocab:
    input:
        dataset=rules.pack.output.dataset,
        model=model_source,
    output:
        token_freq=f"{RUN_DIR}/token_freq.pt",
        mapping=f"{RUN_DIR}/vocab_mapping.pt",
    log:
        f"{RUN_DIR}/logs/vocab.log",
    conda:
        "../envs/eagle3data.yaml"
    params:
        model_path=config["model"]["path"],
        draft_vocab_size=config["draft_vocab_size"],
    message:
        "Counting trainable tokens for the draft vocabulary (draft_vocab_size: {params.draft_vocab_size})"
    script:
        "../scripts/vocab.py"
