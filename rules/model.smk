# Target models built by the workflow itself; a checkpoint given by model.path alone is read in place.


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


# engine.load_format sharded_state: the target's weights as each tensor-parallel rank holds them, saved
# once by an engine loaded the default way (eagle3data.checkpoint); every later engine start reads them.
if config["engine"]["load_format"] == "sharded_state":

    rule sharded_checkpoint:
        input:
            model=model_source,
        output:
            checkpoint=directory(SHARDED_CHECKPOINT),
        log:
            f"{RUN_DIR}/logs/sharded_checkpoint.log",
        benchmark:
            f"{RUN_DIR}/benchmarks/sharded_checkpoint.tsv"
        conda:
            "../envs/eagle3data.yaml"
        threads: 2
        resources:
            gpu=GPUS_PER_EXTRACT,
            mem_mb=EXTRACT_MEM_MB,
        params:
            model=config["model"],
        message:
            "Writing the per-rank (sharded_state) checkpoint of {params.model[path]} at {output.checkpoint}"
        script:
            "../scripts/sharded_checkpoint.py"
