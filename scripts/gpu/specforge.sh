#!/usr/bin/env bash
# Figure 8's arm (e) trained on the lent GPU: SpecForge 0.2, with its GPU defaults (FSDP, flex attention,
# its Triton loss), from this pipeline's SpecForge export; the draft comes back under $OUT and is served
# on the CPU machine (docs/benchmarks.md, figure 8). Carried over several calls in .gpu-sf/call-N
# (ignored; made by hand): the wheels SpecForge needs beyond the image (pydantic, accelerate, datasets,
# ...) and two tars, each whole or as pieces with its sha256 (NAME.part-*, NAME.sha256): export.tar (a
# SpecForge export, top folder `specforge`) and slim.tar (the target's config, tokenizer and
# embedding-only checkpoint, top folder `slim`).
#
#   bash scripts/gpu/specforge.sh collect N        # call N's files to /tmp/sf (call 0 also installs the wheels)
#   bash scripts/gpu/specforge.sh train ARGS...    # join and check the tars, train: ARGS go to acceptance_specforge
set -euo pipefail
mkdir -p /tmp/sf
case "$1" in
  collect)
    cp -r ".gpu-sf/call-$2/." /tmp/sf/
    if [[ "$2" == 0 ]]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/sfsite /tmp/sf/*.whl
    fi ;;
  train)
    ( cd /tmp/sf
      for name in export slim; do
        if compgen -G "$name.part-*" > /dev/null; then
          cat "$name".part-* > "$name.tar" && echo "$(cat "$name.sha256")  $name.tar" | sha256sum -c -
        fi
        tar -xf "$name.tar"
      done )
    export PYTHONPATH="/tmp/sfsite:$PWD/scripts" PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    python3 -c "import torch, transformers, specforge; print(torch.__version__, transformers.__version__)"
    python3 -m eagle3bench.acceptance_specforge /tmp/sf/specforge --model /tmp/sf/slim --out /tmp/sfrun "${@:2}"
    cp -r /tmp/sfrun/draft /tmp/sfrun/trained.json /tmp/sfrun/train.log /tmp/sfrun/run.yaml \
      /tmp/sfrun/draft-config.json "${OUT:-/tmp/out}/" ;;
esac
