#!/usr/bin/env bash
# Download the wheel set that runs this pipeline on the lent H200 (Python 3.12, manylinux x86_64, torch
# 2.11 already there) into .whl/, and split the vllm wheel into pieces that each fit one device call.
#
#   scripts/gpu/prepare_wheels.sh            -> .whl/call-0 .. .whl/call-N (carry one per call, in order)
#
# The device carries at most 64 MiB per call (working tree included), so the 290 MiB vllm wheel goes as
# 52 MiB pieces, one per call; the small wheels fill the last call(s). On the device, scripts/gpu/
# collect.sh copies each call's folder to /tmp/wheels and scripts/gpu/install.sh joins the pieces,
# checks the sha256 and installs everything with --no-deps into /tmp/site.
# Versions: the tested vLLM release's own pins (openai 2.x, xgrammar 0.2.7, pydantic
# is not on the image; snakemake, pandera and datasets are the pipeline's own). Wheels are never committed:
# .whl/ is ignored (.gitignore and .git/info/exclude).
set -euo pipefail
cd "$(dirname "$0")/../.."
PIECE_MIB=${PIECE_MIB:-52}
CALL_MIB=${CALL_MIB:-52}   # payload per call; the working tree (~9 MiB) travels too: under 64 MiB together

VLLM=(vllm==0.26.0)
VLLM_DEPS=(
  cbor2==6.3.0 pyzmq==27.3.0 openai-harmony==0.0.8 openai==2.54.0 jiter==0.19.0 sniffio==1.3.1
  distro==1.9.0 msgspec==0.23.0 pybase64==1.5.1 cachetools==8.0.2 llguidance==1.7.6 xgrammar==0.2.7
  apache-tvm-ffi==0.1.10 fastapi==0.136.3 starlette==1.10.0 opentelemetry-api==1.45.2
  importlib-metadata==10.2.0 partial-json-parser==0.2.1.1.post7 pydantic==2.14.4 pydantic-core==2.50.5
  annotated-types==0.8.0 typing-inspection==0.4.5 blake3==1.0.11 setproctitle==1.3.8
  compressed-tensors==0.17.0 loguru==0.7.3 python-json-logger==4.2.0 ijson==3.6.0 depyf==0.20.0
  lark==1.2.2 outlines_core==0.2.14 diskcache==5.6.3 interegular==0.3.3 astor==0.8.1
)
PIPELINE_DEPS=(
  snakemake==9.27.1 snakemake-interface-common==1.23.0 snakemake-interface-executor-plugins==9.4.0
  snakemake-interface-logger-plugins==2.1.0 snakemake-interface-report-plugins==1.3.0
  snakemake-interface-scheduler-plugins==2.0.2 snakemake-interface-storage-plugins==4.4.1
  argparse-dataclass==2.0.0 conda-inject==1.3.2 configargparse==1.9.0
  docutils==0.22.4 dpath==2.2.0 fastjsonschema==2.22.3 gitdb==4.0.12 gitpython==3.2.1
  humanfriendly==10.0 immutables==0.21 jsonschema==4.26.0 jsonschema-specifications==2025.9.1
  jupyter-core==5.9.1 nbformat==5.11.1 platformdirs==4.14.8 pulp==3.3.2 referencing==0.37.0
  rpds-py==2026.9.1 smart-open==7.7.1 smmap==5.0.3 tenacity==9.2.1 throttler==1.2.3 traitlets==5.16.1
  yte==1.9.4 sqlalchemy==2.0.58 greenlet==3.5.6 sqlmodel==0.0.37 pandera==0.35.0 typeguard==4.6.1 datasets==5.1.0 dill==0.4.1 multiprocess==0.70.19
  isal==1.9.1
  blosc2==4.14.1 msgpack==1.2.4 ndindex==1.10.1 numexpr==2.14.2 threadpoolctl==3.8.0  # storage.compression
)
SDIST_ONLY=(connection-pool==0.0.3)  # pure Python, published as a source archive only: built here

# Ignored twice over: .gitignore has /.whl/, and the device README asks for .git/info/exclude.
mkdir -p .git/info
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude

download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 --platform manylinux1_x86_64 \
    --platform any -d "$1" "${@:2}"
}

rm -rf .whl && mkdir -p .whl/dl
download .whl/dl "${VLLM[@]}"
download .whl/dl "${VLLM_DEPS[@]}" "${PIPELINE_DEPS[@]}"
python3 -m pip wheel -q --no-deps -w .whl/dl "${SDIST_ONLY[@]}"

vllm_whl=$(ls .whl/dl/vllm-*.whl)
( cd .whl/dl && sha256sum "$(basename "$vllm_whl")" > vllm.sha256 )
split -b "${PIECE_MIB}M" -d -a 2 "$vllm_whl" .whl/dl/vllm.part-
rm "$vllm_whl"

# Pack pieces and small wheels into per-call folders of at most CALL_MIB, vllm pieces first.
call=0; used=0; limit=$((CALL_MIB * 1024 * 1024))
mkdir -p .whl/call-0
for f in .whl/dl/vllm.part-* .whl/dl/vllm.sha256 $(ls -S .whl/dl/*.whl); do
  size=$(stat -c %s "$f")
  if (( used + size > limit )); then call=$((call + 1)); used=0; mkdir -p ".whl/call-$call"; fi
  mv "$f" ".whl/call-$call/"; used=$((used + size))
done
rmdir .whl/dl
for d in .whl/call-*; do echo "$d $(du -sm "$d" | cut -f1) MiB $(ls "$d" | wc -l) files"; done
echo "carry .whl/call-0 .. .whl/call-$call, one per device call, in order"
