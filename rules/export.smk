# Trainer exports of the packed dataset (speculators 0.9, SpecForge), built when config `export` asks; by
# default they hold no states (the trainers read the packed dataset in place), with `states: files` a copy.
rule export_speculators:
    input:
        dataset=rules.pack.output.dataset,
        token_freq=rules.vocab.output.token_freq,
        mapping=rules.vocab.output.mapping,
    output:
        export=directory(f"{RUN_DIR}/export/speculators"),
    log:
        f"{RUN_DIR}/logs/export_speculators.log",
    benchmark:
        f"{RUN_DIR}/benchmarks/export_speculators.tsv"
    conda:
        "../envs/eagle3data.yaml"
    params:
        layer_ids=config["export"]["speculators"]["layer_ids"],
        states=config["export"]["speculators"]["states"],
    message:
        "Exporting {input.dataset} for speculators to {output.export}"
    script:
        "../scripts/export_speculators.py"


rule export_specforge:
    input:
        dataset=rules.pack.output.dataset,
        mapping=rules.vocab.output.mapping,
        model=model_source,
    output:
        export=directory(f"{RUN_DIR}/export/specforge"),
    log:
        f"{RUN_DIR}/logs/export_specforge.log",
    benchmark:
        f"{RUN_DIR}/benchmarks/export_specforge.tsv"
    conda:
        "../envs/eagle3data.yaml"
    params:
        model_path=config["model"]["path"],
        layer_ids=config["export"]["specforge"]["layer_ids"],
        states=config["export"]["specforge"]["states"],
    message:
        "Exporting {input.dataset} for SpecForge to {output.export}"
    script:
        "../scripts/export_specforge.py"


EXPORTS = [
    export
    for name, export in (
        ("speculators", rules.export_speculators.output.export),
        ("specforge", rules.export_specforge.output.export),
    )
    if config["export"][name]["enabled"]
]
