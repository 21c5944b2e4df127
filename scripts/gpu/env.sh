# On the device, sourced by the run scripts: install the carried wheels once (joined vllm pieces,
# sha256 checked, --no-deps into /tmp/site) and set the environment vLLM and the pipeline need there
# (EXTRA_PYTHONPATH: a diagnostic's directory first, e.g. scripts/gpu/no_facts).
set -euo pipefail
if [[ ! -f /tmp/site/.installed ]]; then
  ( cd /tmp/wheels
    cat vllm.part-* > "$(cut -d' ' -f3 vllm.sha256)"
    sha256sum -c vllm.sha256
    rm vllm.part-* )
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    /tmp/wheels/*.whl
  touch /tmp/site/.installed
fi
export PYTHONPATH="${EXTRA_PYTHONPATH:+$EXTRA_PYTHONPATH:}/tmp/site:$PWD/scripts" PATH="/tmp/site/bin:$PATH" PYTHONUNBUFFERED=1
export VLLM_USE_FLASHINFER_SAMPLER=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
