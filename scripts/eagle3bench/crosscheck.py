r"""Do the pipeline's captured states equal the model's? vLLM (the extract stage) against transformers.

transformers' `output_hidden_states[k]` is the stream entering decoder layer k; the last layer's output
before the final norm comes from a forward hook (transformers' last entry is after the norm). The
reference runs in fp32 on the same device first, then the extract stage runs on the same prompts, and
each capture is compared by relative error ||vllm - ref|| / ||ref|| (and max absolute difference).

    python -m eagle3bench.crosscheck --model DIR --captures 2:input,4:input,5:input,7:output \
        --dtype float32 --engine attention_backend=CPU_MLA --tolerance 1e-4

Prints one JSON object; exits 1 when a capture's relative error exceeds the tolerance.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch
import yaml

from eagle3data.contracts.layers import Capture, parse_captures


def reference_states(model, ids: list[int], captures: list[Capture]) -> torch.Tensor:
    """transformers states [T, n_captures, H] (fp32, on CPU) of `model` for one prompt."""
    n_layers = model.config.num_hidden_layers
    last = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda mod, inp, out: last.__setitem__("out", out[0] if isinstance(out, tuple) else out)
    )
    try:
        with torch.no_grad():
            device = next(model.parameters()).device
            hidden = model(torch.tensor([ids], device=device), output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    wanted = []
    for c in captures:
        index = c.hf_hidden_states_index(n_layers)
        wanted.append((last["out"] if index is None else hidden[index])[0].float().cpu())
    return torch.stack(wanted, dim=1)


def load_reference_model(model_dir: str, device: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()


def compare(sample_id: str, got: torch.Tensor, want: torch.Tensor, captures: list[Capture]) -> list[dict]:
    """One row per capture: relative error and max absolute difference of `got` against `want`."""
    if tuple(got.shape) != tuple(want.shape):
        raise ValueError(f"sample {sample_id}: states shape: expected {tuple(want.shape)}, found "
                         f"{tuple(got.shape)}")
    rows = []
    for slot, c in enumerate(captures):
        a, b = got[:, slot].float(), want[:, slot]
        rows.append({"sample_id": sample_id, "capture": c.name,
                     "rel_error": float((a - b).norm() / b.norm()),
                     "max_abs": float((a - b).abs().max())})
    return rows


def parse_capture_arg(text: str) -> list[dict]:
    """'2:input,7:output' -> config capture entries."""
    entries = []
    for item in text.split(","):
        layer, point = item.split(":")
        entries.append({"layer": int(layer), "point": point})
    return entries


def parse_engine_args(items: list[str]) -> dict:
    """['attention_backend=CPU_MLA', 'max_num_seqs=8'] -> {...}, values read as YAML scalars."""
    return {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in items)}


def main() -> None:
    from eagle3data.capture.extract import ExtractJob, run_alone
    from eagle3data.model.info import read_model_info
    from eagle3data.engine.start import EngineSettings
    from eagle3data.contracts.states import Expected
    from eagle3data.storage.store import Store
    from eagle3bench.synthetic import random_prompts, write_token_shard
    from eagle3data.contracts.measuring import load_stored

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="checkpoint directory with real weights")
    parser.add_argument("--captures", required=True, type=parse_capture_arg, help="e.g. 2:input,7:output")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--samples", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=300, help="longest prompt (lengths vary from 1/4)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--engine", nargs="*", default=[], help="engine settings KEY=VALUE (config/schema.yaml)")
    parser.add_argument("--tolerance", type=float, default=3e-2, help="max relative error per capture")
    parser.add_argument("--work", default="results/crosscheck", help="shard, store and manifest go here")
    args = parser.parse_args()

    info = read_model_info(args.model)
    captures = parse_captures(args.captures, info.num_hidden_layers)
    prompts = random_prompts(args.samples, args.tokens, min(info.vocab_size, 30000), seed=1, vary=True)
    model = load_reference_model(args.model, args.device)
    reference = {sid: reference_states(model, ids, captures) for sid, ids in prompts.items()}
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    work = Path(args.work)
    write_token_shard(str(work / "shard.parquet"), prompts)
    engine = EngineSettings.with_defaults({"device": args.device, **parse_engine_args(args.engine)})
    job = ExtractJob(str(work / "shard.parquet"), str(work / "manifest.parquet"), str(work / "stats.json"),
                     Store.at(work / "store"), args.model, False, Expected(captures, info.hidden_size, args.dtype),
                     args.tokens, engine)
    run_alone(job)
    rows = []
    for sid in prompts:
        got = load_stored(str(job.store.path(sid)))["hidden_states"]  # compressed or raw
        rows += compare(sid, got, reference[sid], captures)
    worst = max(rows, key=lambda r: r["rel_error"])
    result = {"model": args.model, "dtype": args.dtype, "device": args.device, "samples": len(prompts),
              "tolerance": args.tolerance, "worst": worst, "rows": rows}
    print(json.dumps(result))
    sys.exit(0 if worst["rel_error"] <= args.tolerance else 1)


if __name__ == "__main__":
    main()
