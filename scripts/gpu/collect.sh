#!/usr/bin/env bash
# On the device: keep one call's wheel folder (.whl/call-N, carried) in /tmp/wheels for later calls.
#   bash scripts/gpu/collect.sh N
set -euo pipefail
mkdir -p /tmp/wheels
cp ".whl/call-$1/"* /tmp/wheels/
echo "call $1: $(ls /tmp/wheels | wc -l) files, $(du -sm /tmp/wheels | cut -f1) MiB in /tmp/wheels"
