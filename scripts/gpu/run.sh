#!/usr/bin/env bash
# The GPU runs (CONTRIBUTING.md, "The GPU kit"), one step per device call (each ends well inside 10 minutes):
#   bash scripts/gpu/run.sh kimi       Kimi-K2.5-shaped model (dummy weights) through the workflow, TP1
#   bash scripts/gpu/run.sh bench      figure 1 on an 8B Llama shape (dummy weights), TP1; BENCH_ENGINE adds
#                                      engine settings (e.g. writer_threads=16)
#   bash scripts/gpu/run.sh figures    figures 1 and 7 of the benchmark command, same shape and engine; with
#                                      FIGURE_MODEL=/tmp/llama-8b-weights (after load-prepare) on states of
#                                      real entropy
#   bash scripts/gpu/run.sh deepseek   small DeepSeek-V3 vs transformers; TP1 vs TP2 (needs 2 GPUs)
#   bash scripts/gpu/run.sh invariance figure 1 with and without VLLM_BATCH_INVARIANT=1 (8B shape, TP1)
#   bash scripts/gpu/run.sh batches    the same 256 prompts extracted in batches of 256 and of 24, with and
#                                      without VLLM_BATCH_INVARIANT=1: same bits? (docs/resume.md)
#   bash scripts/gpu/run.sh regenerate the regenerate stage against bare generate() (8B shape, dummy weights)
#   bash scripts/gpu/run.sh load-prepare  a random 8B checkpoint (16 GB of safetensors, weights normal(0, 0.02)),
#                                      SHAPE=smollm2-135m a small one: figure 9, and realistic states
#   bash scripts/gpu/run.sh load       figure 9 (after load-prepare): engine start (vLLM's default loader)
#                                      against reading the checkpoint, three runs
#   bash scripts/gpu/run.sh kimi bench several steps in one call
# Needs the wheels in /tmp/wheels (scripts/gpu/collect.sh); results and logs go to $OUT.
source "$(dirname "$0")/env.sh"
set +e
step() { echo "== $(date -u +%H:%M:%S) $*"; }
workflow() {  # run config, GPUs: tokenize -> extract -> validate -> pack through the real Snakefile
  timeout 270 python3 -m snakemake "results/gpu-${3}/dataset" --cores 16 --resources "gpu=$2" --nolock \
    --configfile "scripts/gpu/$1.yaml" > "/tmp/snakemake-$1.log" 2>&1
  local rc=$?
  echo "snakemake $1: exit $rc"; tail -n 5 "/tmp/snakemake-$1.log"
  cat "/tmp/snakemake-$1.log" results/gpu-"$3"/logs/*/*.log > "$OUT/log-$1.txt" 2>/dev/null
  return $rc
}

for what in "$@"; do
case "$what" in
  kimi)
    step versions
    python3 -c "import torch, vllm, transformers; print('torch', torch.__version__, 'vllm', vllm.__version__, \
'transformers', transformers.__version__, torch.cuda.device_count(), 'GPUs', torch.cuda.get_device_name(0))"
    python3 scripts/gpu/make_conversations.py data/demo/conversations.jsonl results/gpu-conversations.jsonl 48
    python3 -m eagle3data.model.shapes kimi-k2.5 /tmp/kimi-shape --tokenizer-from resources/demo-tokenizer
    step workflow kimi-shape
    workflow kimi-shape 1 kimi-shape
    python3 scripts/gpu/check_states.py shapes gpu-kimi-shape --hidden 7168 | tee "$OUT/kimi-shape.json"
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
    ;;
  bench)
    step bench llama-8b
    timeout 540 python3 -m eagle3bench.extract --shape llama-8b --model /tmp/llama-8b \
      --captures 2:input,16:input,29:input,31:output --prompts 2048 --tokens 512 \
      --engine load_format=dummy max_num_batched_tokens=16384 max_num_seqs=128 batch_samples=512 ${BENCH_ENGINE:-} \
      --work /tmp/bench --out "$OUT/bench-llama8b.json" > /tmp/bench.log 2>&1
    echo "bench: exit $?"; tail -n 6 /tmp/bench.log; cp /tmp/bench.log "$OUT/log-bench.txt"
    rm -rf /tmp/bench
    ;;
  invariance)  # what vLLM's batch-invariant mode costs in figure 1 (both engines run in the mode)
    python3 -m eagle3data.model.shapes llama-8b /tmp/llama-8b --tokenizer-from resources/demo-tokenizer
    for mode in ${BI_MODES:-1 0}; do
      step "figure 1, VLLM_BATCH_INVARIANT=$mode"
      VLLM_BATCH_INVARIANT=$mode timeout 570 python3 -m eagle3bench.extract --model /tmp/llama-8b \
        --captures 2:input,16:input,29:input,31:output --prompts 2048 --tokens 512 \
        --engine load_format=dummy max_num_batched_tokens=16384 max_num_seqs=128 batch_samples=512 \
        --work /tmp/bench-bi --out "$OUT/bench-llama8b-bi$mode.json" > "/tmp/bench-bi$mode.log" 2>&1
      echo "bench (batch invariant $mode): exit $?"; tail -n 3 "/tmp/bench-bi$mode.log"
      cp "/tmp/bench-bi$mode.log" "$OUT/log-bench-bi$mode.txt"; rm -rf /tmp/bench-bi
    done
    ;;
  batches)  # are a sample's states a function of its tokens on the H200, with or without the mode?
    python3 -m eagle3data.model.shapes llama-8b /tmp/llama-8b --tokenizer-from resources/demo-tokenizer
    for mode in 0 1; do
      for batch in 256 24; do
        step "extract 256 prompts in batches of $batch, VLLM_BATCH_INVARIANT=$mode"
        VLLM_BATCH_INVARIANT=$mode timeout 200 python3 -m eagle3bench.extract --phase extract \
          --model /tmp/llama-8b --captures 2:input,16:input,29:input,31:output --prompts 256 --tokens 512 \
          --engine load_format=dummy max_num_batched_tokens=16384 "max_num_seqs=$batch" "batch_samples=$batch" \
          --work "/tmp/batches-$mode-$batch" > "/tmp/batches-$mode-$batch.log" 2>&1
        echo "extract: exit $?"; grep -o 'tokens_per_second": [0-9.]*' "/tmp/batches-$mode-$batch.log" | head -1
      done
      python3 scripts/gpu/check_states.py stores "/tmp/batches-$mode-256/store" "/tmp/batches-$mode-24/store" \
        | tee "$OUT/batches-bi$mode.json" | cut -c1-600
      rm -rf "/tmp/batches-$mode-256" "/tmp/batches-$mode-24"
    done
    ;;
  regenerate)  # generation throughput of the stage against vLLM's bare generate(), same engine
    python3 -m eagle3data.model.shapes llama-8b /tmp/llama-8b --tokenizer-from resources/demo-tokenizer
    python3 scripts/gpu/make_conversations.py data/demo/conversations.jsonl /tmp/regen-conversations.jsonl 1024
    step "regenerate 1024 conversations, 256 new tokens"
    VLLM_WORKER_MULTIPROC_METHOD=spawn timeout 430 python3 -m eagle3bench.regenerate --model /tmp/llama-8b \
      --device cuda --conversations /tmp/regen-conversations.jsonl --max-seq-len 2048 --max-new-tokens 256 \
      --runs 3 --engine load_format=dummy max_num_seqs=256 max_num_batched_tokens=16384 \
      --out "$OUT/regenerate-llama8b.json" > /tmp/regen.log 2>&1
    echo "regenerate bench: exit $?"; grep "regenerate / bare" /tmp/regen.log; cp /tmp/regen.log "$OUT/log-regenerate.txt"
    ;;
  load-prepare)  # a random checkpoint as real safetensors files, weights normal(0, 0.02): figure 9's, and
                 # states of realistic entropy for figures 1 and 7 (SHAPE: llama-8b, or smollm2-135m)
    step "write a random ${SHAPE:-llama-8b} checkpoint"
    python3 -m eagle3data.model.shapes "${SHAPE:-llama-8b}" "/tmp/${SHAPE:-llama-8b}-weights" --tokenizer-from resources/demo-tokenizer
    timeout 240 python3 -m eagle3bench.load --write-checkpoint "${SHAPE:-llama-8b}" "/tmp/${SHAPE:-llama-8b}-weights"
    du -sh "/tmp/${SHAPE:-llama-8b}-weights"; df -h /tmp | tail -1
    ;;
  load)  # figure 9 (after load-prepare): engine start (vLLM's default loader) - the dummy loader's start,
    # over the cold read of the weights; LOAD_RUNS runs (3)
    export VLLM_WORKER_MULTIPROC_METHOD=spawn
    step "figure 9, ${LOAD_RUNS:-3} runs"
    timeout 580 python3 -m eagle3bench.load --model /tmp/llama-8b-weights --runs "${LOAD_RUNS:-3}" \
      --json "$OUT/load-llama8b.json" > /tmp/load.log 2>&1
    echo "load bench: exit $?"; grep "^figure 9" /tmp/load.log; cp /tmp/load.log "$OUT/log-load.txt"
    ;;
  figures)  # figures 1 and 7 through the benchmark command, TP1: on an 8B Llama shape with vLLM's dummy weights,
            # or on the checkpoint load-prepare wrote (FIGURE_MODEL=/tmp/llama-8b-weights: states of real entropy;
            # CAPTURES for another shape); figure 1's prompts (FIGURE1_PROMPTS, 2048), figure 7's shards
            # (FIGURE7_SHARDS, 8) and its extract jobs side by side (JOBS_PER_ENGINE, 2), the states' codecs
            # (CODEC, zstd,none: figure 1 for each side by side, figure 7 with the first), TAG names the JSON;
            # FIGURES a subset (7,7d,7w,7t: figure 7, which runs figure 1 too: its bare prefill is the reference)
    step "figures 1,7 (${FIGURE_MODEL:-dummy weights}, ${CODEC:-zstd,none})"
    model=${FIGURE_MODEL:-/tmp/llama-8b} engine=(max_num_batched_tokens=16384 max_num_seqs=128 batch_samples=512)
    if [[ -z ${FIGURE_MODEL:-} ]]; then
      python3 -m eagle3data.model.shapes llama-8b /tmp/llama-8b --tokenizer-from resources/demo-tokenizer
      engine+=(load_format=dummy) weights="dummy weights"
    else
      weights="random normal(0, 0.02) weights"
    fi
    # The machine each second (CPU busy/idle/iowait, blocks written, dirty memory) for where the tail goes.
    cat /proc/sys/vm/dirty_ratio /proc/sys/vm/dirty_background_ratio > "$OUT/vmstat-figures.txt"
    (while :; do echo "$(date -u +%T) $(vmstat 1 2 | tail -1) $(grep -E '^(Dirty|Writeback):' /proc/meminfo | tr -s ' ' | tr '\n' ' ')"; done >> "$OUT/vmstat-figures.txt") &
    vmstat_pid=$!
    timeout "${FIGURES_TIMEOUT:-570}" python3 -m eagle3bench --figures "${FIGURES:-1,7,7d,7w,7t}" --device cuda --model "$model" \
      --captures "${CAPTURES:-2:input,16:input,29:input,31:output}" --prompts "${FIGURE1_PROMPTS:-2048}" --tokens 512 \
      --conversations 6144 --shards "${FIGURE7_SHARDS:-8}" --weights "$weights" \
      --jobs-per-engine "${JOBS_PER_ENGINE:-2}" --transport-dir "${TRANSPORT_DIR:-}" --codec "${CODEC:-zstd,none}" \
      --engine "${engine[@]}" --work /tmp/benchmark --out "$OUT/figures-gpu${TAG:+-$TAG}.json" > /tmp/figures.log 2>&1
    echo "benchmark: exit $?"; kill $vmstat_pid; grep -E "^figure|^          " /tmp/figures.log | cut -c1-900; tail -n 3 /tmp/figures.log
    python3 scripts/gpu/check_states.py shapes /tmp/benchmark/e2e/results/bench-e2e \
      --captures 4 --hidden "$(python3 -c "import json; print(json.load(open('$model/config.json'))['hidden_size'])")"
    grep -h "files written" /tmp/benchmark/e2e/results/bench-e2e/logs/engine/*.log 2>/dev/null | tail -n 2
    cat /tmp/figures.log /tmp/benchmark/*.log /tmp/benchmark/logs/engine/*.log /tmp/benchmark/e2e/snakemake.log \
      /tmp/benchmark/e2e/results/bench-e2e/logs/*/*.log > "$OUT/log-figures${TAG:+-$TAG}.txt" 2>/dev/null
    df -h /tmp | tail -1; rm -rf /tmp/benchmark
    ;;
  deepseek)
    step build small deepseek
    python3 scripts/gpu/make_conversations.py data/demo/conversations.jsonl results/gpu-conversations.jsonl 48
    python3 scripts/gpu/build_small_deepseek.py /tmp/ds-small resources/demo-tokenizer
    step crosscheck
    timeout 200 python3 -m eagle3bench.crosscheck --model /tmp/ds-small --captures 2:input,4:input,6:input,7:output \
      --dtype bfloat16 --device cuda --tolerance 5e-2 --work /tmp/cc > /tmp/cc.log 2>&1
    echo "crosscheck: exit $?"; grep '^{"model"' /tmp/cc.log > "$OUT/crosscheck-deepseek.json"; tail -n 2 /tmp/cc.log | cut -c1-600
    step workflow ds-small-tp1
    workflow ds-small-tp1 1 ds-tp1
    if [[ $(python3 -c "import torch; print(torch.cuda.device_count())") -ge 2 ]]; then
      step workflow ds-small-tp2
      workflow ds-small-tp2 2 ds-tp2
      python3 scripts/gpu/check_states.py compare gpu-ds-tp1 gpu-ds-tp2 | tee "$OUT/tp1-vs-tp2.json"
      python3 scripts/gpu/check_states.py ranks results/gpu-ds-tp2/logs/extract/shard-00000.log | tee "$OUT/tp2-ranks.json"
    fi
    python3 scripts/gpu/check_states.py shapes gpu-ds-tp1 --hidden 1024 | tee "$OUT/ds-tp1.json"
    ;;
  dense)  # the small DeepSeek-V3 with every layer dense (no expert routing) against transformers
    python3 scripts/gpu/build_small_deepseek.py /tmp/ds-dense resources/demo-tokenizer --dense
    timeout 150 python3 -m eagle3bench.crosscheck --model /tmp/ds-dense --captures 2:input,4:input,6:input,7:output \
      --dtype bfloat16 --device cuda --tolerance 5e-2 --work /tmp/cc-dense > /tmp/cc-dense.log 2>&1
    echo "crosscheck dense: exit $?"; grep '^{"model"' /tmp/cc-dense.log > "$OUT/crosscheck-dense.json"
    grep '^{"model"' /tmp/cc-dense.log | cut -c1-400
    ;;
esac
done
step done
