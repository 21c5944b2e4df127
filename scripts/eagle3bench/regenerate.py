r"""The regenerate stage's generation throughput against vLLM's bare `generate()`, one engine, one run.

Both sides get the same requests: the stage's own prompts (chat template with the generation prompt)
and sampling parameters (per-request seeds), planned by `eagle3data.regenerate.stage` from the input rows.
  bare   `llm.generate(prompts, params)`: all requests at once, nothing stored;
  stage  `eagle3data.regenerate.stage.run` on the same engine: its engine loop, each response journaled
         (fsync) as it finishes, replies parsed, the shard's files written, from a fresh journal.
Generated tokens per second of each (the stage's seconds are the whole job after the engine start:
tokenizer, planning, generation, files), their ratio per run, worst first, and the ratio of the stage's
engine loop alone (requests queued, responses journaled and parsed) to bare `generate()`. One warm-up
`generate()` first; the two sides alternate in order from run to run.

    python -m eagle3bench.regenerate --model resources/smollm2-135m --device cpu \
        --conversations data/smollm2/conversations.jsonl --max-new-tokens 64 --runs 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

import pandas as pd

from eagle3bench.crosscheck import parse_engine_args
from eagle3data.inputs.conversations import count_conversations, read_shard
from eagle3data.engine.start import EngineSettings, start_engine
from eagle3data.regenerate.journal import Journal
from eagle3data.regenerate.stage import RegenerateJob, RegenerateSettings, Regenerator, engine_settings, plan, run


def bare_requests(job: RegenerateJob, max_model_len: int) -> tuple[list, list]:
    """The prompts and sampling parameters the stage will send, planned as the stage plans them."""
    from transformers import AutoTokenizer
    from vllm.inputs import TokensPrompt

    tokenizer = AutoTokenizer.from_pretrained(job.model_path, trust_remote_code=job.trust_remote_code)
    with tempfile.TemporaryDirectory() as empty:
        regen = Regenerator(job, tokenizer, Journal(Path(empty) / "journal.jsonl"), max_model_len)
        rows = read_shard(job.conversations, *job.rows)
        requests = [regen.next_request(plan(r["source_row"], json.loads(r["record"]), "last", tokenizer))
                    for r in rows]
    requests = [r for r in requests if r is not None]
    return ([TokensPrompt(prompt_token_ids=r.prompt_ids) for r in requests],
            [regen.sampling_params(r) for r in requests])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--conversations", default="data/smollm2/conversations.jsonl")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--engine", nargs="*", default=[], help="engine settings as key=value (config `engine`)")
    parser.add_argument("--out", help="write the measurements here as JSON")
    args = parser.parse_args(argv)

    engine = EngineSettings.with_defaults({"device": args.device, **parse_engine_args(args.engine)})
    work = Path(tempfile.mkdtemp(prefix="bench-regenerate-"))
    job = RegenerateJob(
        conversations=args.conversations, rows=(0, count_conversations(args.conversations)),
        out="", responses="", stats="", journal="", model_path=args.model, trust_remote_code=False,
        dtype=args.dtype, max_seq_len=args.max_seq_len, engine=engine,
        settings=RegenerateSettings.with_defaults({"enabled": True, "max_new_tokens": args.max_new_tokens,
                                                   "temperature": args.temperature, "truncated": "keep"}),
    )
    kwargs = engine_settings(job)
    prompts, params = bare_requests(job, kwargs["max_model_len"])
    llm = start_engine(kwargs, engine.cpu_kv_cache_gib)
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    runs = []
    for i in range(args.runs):
        measured = {}
        for side in (("bare", "stage") if i % 2 == 0 else ("stage", "bare")):
            if side == "bare":
                began = time.perf_counter()
                outputs = llm.generate(prompts, params, use_tqdm=False)
                seconds = time.perf_counter() - began
                tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            else:
                d = work / f"run-{i}"
                fresh = dataclasses.replace(job, out=str(d / "out.jsonl"), responses=str(d / "responses.parquet"),
                                            stats=str(d / "stats.json"), journal=str(d / "journal.jsonl"))
                stats = run(fresh, llm=llm)
                seconds = stats["seconds"]
                tokens = int(pd.read_parquet(fresh.responses)["tokens_after"].sum())
                measured["stage_loop_seconds"] = stats["generate_seconds"]  # the engine loop alone
            measured[side] = {"tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds}
        measured["ratio"] = measured["stage"]["tokens_per_second"] / measured["bare"]["tokens_per_second"]
        measured["loop_ratio"] = measured["bare"]["seconds"] / measured["stage_loop_seconds"]
        runs.append(measured)
    runs.sort(key=lambda r: r["ratio"])
    result = {"model": args.model, "device": args.device, "dtype": args.dtype, "requests": len(prompts),
              "max_new_tokens": args.max_new_tokens, "engine": engine, "runs": runs}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    for r in runs:
        print(f"regenerate / bare generate(): {r['ratio']:.3f}, its engine loop alone {r['loop_ratio']:.3f} "
              f"(stage {r['stage']['tokens_per_second']:.1f} tok/s, {r['stage']['tokens']} tokens; "
              f"bare {r['bare']['tokens_per_second']:.1f} tok/s, {r['bare']['tokens']} tokens)")
    return result


if __name__ == "__main__":
    main()
