"""Checks on a pipeline run's outputs, for the GPU runs (CONTRIBUTING.md, "The GPU kit"). Prints one JSON object.

    python scripts/gpu/check_states.py shapes RUN --hidden 7168 --captures 4 --seq 512   # its packed dataset
    python scripts/gpu/check_states.py compare RUN_A RUN_B     # same samples, per-capture rel. error
    python scripts/gpu/check_states.py ranks LOG               # which TP ranks' connectors write
    python scripts/gpu/check_states.py stores STORE_A STORE_B  # same bits? (the reproducibility contract)
"""

import argparse
import json
import re
from pathlib import Path

from eagle3data.contracts.measuring import load_stored


def states_files(run: str) -> dict:
    return {p.stem: p for p in (run_dir(run) / "states").rglob("*.safetensors")}


def run_dir(run: str) -> Path:
    """A run's directory: RUN itself, or results/RUN."""
    return Path(run) if Path(run).is_dir() else Path("results", run)


def shapes(args) -> dict:
    """The packed dataset's rows, each read as a trainer reads it (open_dataset: decompressed, its checksums
    verified): every row `[L <= seq, captures, hidden]` bf16, counted against the run's counts."""
    from eagle3data import open_dataset

    run = run_dir(args.run)
    bad, full, rows, tokens = [], 0, 0, 0
    for row in open_dataset(run / "dataset"):
        shape, dtype = list(row["hidden_states"].shape), str(row["hidden_states"].dtype).removeprefix("torch.")
        if shape[1:] != [args.captures, args.hidden] or dtype != "bfloat16" or shape[0] > args.seq:
            bad.append({"sample": row["sample_id"], "shape": shape, "dtype": dtype})
        rows, tokens, full = rows + 1, tokens + shape[0], full + (shape[0] == args.seq)
    stats = [json.loads(p.read_text()) for p in (run / "extract").glob("*.stats.json")]
    counts = json.loads((run / "dataset.counts.json").read_text())
    seconds = sum(s["seconds"] for s in stats)
    return {"run": str(run), "rows": rows, f"rows_with_{args.seq}_tokens": full, "bad": bad,
            "rows_match_counts": rows == counts["packed"], "tokens": tokens, "extract_seconds": seconds,
            "extract_tokens_per_second": sum(s["computed_tokens"] for s in stats) / seconds if seconds else None,
            "dataset_bytes": sum(p.stat().st_size for p in (run / "dataset").glob("*.arrow")),
            "store_files_left": len(states_files(args.run)), "dataset_counts": counts}


def compare(args) -> dict:
    a, b = states_files(args.run_a), states_files(args.run_b)
    if set(a) != set(b):
        return {"error": f"sample sets differ: {len(a)} vs {len(b)}, {len(set(a) ^ set(b))} unmatched"}
    worst = {}
    for sid in sorted(a):
        x, y = load_stored(str(a[sid])), load_stored(str(b[sid]))
        assert x["token_ids"].tolist() == y["token_ids"].tolist(), sid
        for slot in range(x["hidden_states"].shape[1]):
            u, v = x["hidden_states"][:, slot].float(), y["hidden_states"][:, slot].float()
            rel = float((u - v).norm() / v.norm())
            worst[slot] = max(worst.get(slot, 0.0), rel)
    return {"samples": len(a), "worst_rel_error_per_capture": worst}


def stores(args) -> dict:
    """Two stores of the same prompts computed in other batches: how many samples differ in any bit, and
    the first differences as eagle3data.validate.reproducibility words them (units in the last place)."""
    from eagle3data.validate.reproducibility import states_difference

    a = {p.stem: p for p in Path(args.store_a).rglob("*.safetensors")}
    b = {p.stem: p for p in Path(args.store_b).rglob("*.safetensors")}
    if set(a) != set(b) or not a:
        return {"error": f"sample sets differ or are empty: {len(a)} vs {len(b)}"}
    differing = {}
    for sid in sorted(a):
        difference = states_difference(load_stored(str(a[sid]))["hidden_states"],
                                       load_stored(str(b[sid]))["hidden_states"])
        if difference:
            differing[sid] = difference
    return {"samples": len(a), "differing": len(differing), "first": dict(list(differing.items())[:3])}


def ranks(args) -> dict:
    text = Path(args.log).read_text(errors="replace")
    found = re.findall(r"hidden-states connector ready \(tp_rank0=(True|False)", text)
    return {"log": args.log, "connectors": len(found), "writing_ranks": found.count("True")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("shapes")
    p.add_argument("run")
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--captures", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p = sub.add_parser("compare")
    p.add_argument("run_a")
    p.add_argument("run_b")
    p = sub.add_parser("stores")
    p.add_argument("store_a")
    p.add_argument("store_b")
    p = sub.add_parser("ranks")
    p.add_argument("log")
    args = parser.parse_args()
    print(json.dumps({"shapes": shapes, "compare": compare, "stores": stores, "ranks": ranks}[args.cmd](args)))


if __name__ == "__main__":
    main()
