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
