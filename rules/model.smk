# Target models built by the workflow itself; a checkpoint given by model.path alone is read in place.
# A builder writes only a directory it built (marked inside): anything else at model.path is refused
# while the run is planned (rules/common.smk; eagle3data.model.builds), since Snakemake deletes a rule's
# output to rebuild it.

# The embedded default: build a tiny random-weight Kimi-shaped model and tokenizer (no download).
if config["model"]["build_demo"]:

    rule demo_model:
        input:
            conversations=config["input"],
        output:
            model=directory(config["model"]["path"]),
        log:
            f"{RUN_DIR}/logs/demo_model.log",
        conda:
            "../envs/eagle3data.yaml"
        message:
            "Building the tiny demo target model at {output.model}"
        script:
            "../scripts/build_demo_model.py"


# A real, trained target from a GGUF file inside an installed package (config/smollm2.yaml): bf16
# safetensors, tokenizer and chat template.
if config["model"]["from_gguf"]:

    rule gguf_model:
        output:
            model=directory(config["model"]["path"]),
        log:
            f"{RUN_DIR}/logs/gguf_model.log",
        benchmark:
            f"{RUN_DIR}/benchmarks/gguf_model.tsv"
        conda:
            "../envs/eagle3data.yaml"
        params:
            package=lookup(within=config, dpath="model/from_gguf/package"),
            file=lookup(within=config, dpath="model/from_gguf/file"),
        message:
            "Converting {params.file} from package {params.package} into the target model at {output.model}"
        script:
            "../scripts/gguf_model.py"
