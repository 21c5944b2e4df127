# Summaries and plots for `snakemake --report`: counts, lengths, norms per capture, throughput.
rule report:
    input:
        counts=rules.pack.output.counts,
        tokenized=expand(rules.tokenize.output.tokenized, shard=SHARDS),
        states=expand(rules.validate.output.states, shard=SHARDS),
        stats=expand(rules.extract.output.stats, shard=SHARDS),
    output:
        summary=report(
            f"{RUN_DIR}/report/summary.html",
            category="Summary",
            caption="../report/summary.rst",
        ),
        lengths=report(
            f"{RUN_DIR}/report/token_lengths.svg",
            category="Tokens",
            caption="../report/lengths.rst",
        ),
        norms=report(
            f"{RUN_DIR}/report/capture_norms.svg",
            category="Hidden states",
            caption="../report/norms.rst",
        ),
        throughput=report(
            f"{RUN_DIR}/report/throughput.svg",
            category="Extraction",
            caption="../report/throughput.rst",
        ),
    log:
        f"{RUN_DIR}/logs/report.log",
    conda:
        "../envs/eagle3data.yaml"
    message:
        "Writing the report"
    script:
        "../scripts/report.py"
