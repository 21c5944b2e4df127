#!/usr/bin/env bash
# Figure 8's arm (e) trained on the lent GPU: SpecForge 0.2, with its GPU defaults (FSDP, flex attention,
# its Triton loss), from this pipeline's SpecForge export; the draft comes back under $OUT and is served
# on the CPU machine (docs/gpu-run.md, fourteenth session). Carried in three calls, .gpu-sf/call-0..2
# (ignored): the wheels SpecForge needs beyond the image (pydantic, accelerate, datasets, ...) and the
# export as a tar; the target's embedding-only checkpoint as a tar in two pieces, with its sha256.
#
#   bash scripts/gpu/specforge.sh collect N        # call N's files to /tmp/sf (call 0 also installs)
#   bash scripts/gpu/specforge.sh train ARGS...    # join, check, train: ARGS go to acceptance_specforge
set -euo pipefail
mkdir -p /tmp/sf
case "$1" in
  collect)
    cp -r ".gpu-sf/call-$2/." /tmp/sf/
    if [[ "$2" == 0 ]]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/sfsite /tmp/sf/*.whl
      tar -C /tmp/sf -xf /tmp/sf/export.tar
    fi ;;
  train)
    ( cd /tmp/sf && cat slim.part-* > slim.tar && echo "$(cat slim.sha256)  slim.tar" | sha256sum -c - && tar -xf slim.tar )
    export PYTHONPATH="/tmp/sfsite:$PWD/scripts" PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    python3 -c "import torch, transformers, specforge; print(torch.__version__, transformers.__version__)"
    python3 -m eagle3data.bench.acceptance_specforge /tmp/sf/specforge --model /tmp/sf/slim --out /tmp/sfrun "${@:2}"
    cp -r /tmp/sfrun/draft /tmp/sfrun/trained.json /tmp/sfrun/train.log /tmp/sfrun/run.yaml \
      /tmp/sfrun/draft-config.json "${OUT:-/tmp/out}/" ;;
esac
