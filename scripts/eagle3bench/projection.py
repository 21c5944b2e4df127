"""Projection for a node: each stage's wall time and the GPU-busy share for N conversations.

Why: on an 8-GPU Kimi-K2.5 node the GPUs are what costs, and whether they stay busy depends on terms
that no benchmark measures together: engine starts (20-24 minutes each), one disk shared by extract,
validate and pack (each shard packed while later shards are extracted). This command combines rates measured
elsewhere (docs/benchmarks.md, docs/measurements/*.json) into one estimate, says which term bounds the
share (goal >= 0.85 at Kimi scale) and takes any rate given instead. Nothing here ran at Kimi scale.

    python -m eagle3bench.projection                  # Kimi-K2.5, 8 x H200, 300,000 conversations
    python -m eagle3bench.projection --disk-gbps 10 --engine-starts per-shard --json
    python -m eagle3bench.projection --measured docs/measurements/2026-11-30-h200-figures-1-7.json

The model (assumed, not measured, unless a rate says so):
- N conversations of one mean length in equal shards; states are captures x hidden x 2 bytes a token
  (bf16; token ids and tokenize's tables, ~0.01 % of that, are left out).
- GPU-busy seconds = tokens / the node's bare prefill rate. By default that rate is derived: one H200's
  measured bare prefill of an 8B Llama shape (TP1) x 8.03e9 / active parameters x GPUs, i.e. prefill
  compute-bound at the 8B's efficiency and scaling perfectly over GPUs and TP (MoE routing, TP
  all-reduces and MLA are not in it; the field reports ~2,280 tok/s for Kimi-K2.5 on 8 GPUs:
  `--prefill-tps 2280`). Extraction runs at `extract_over_bare` of it (figure 1).
- `--engine-starts` starts per engine, GPUs idle; the node's gpus / tp engines start side by side;
  `per-shard` is the pipeline before engines served many shards (each extract job started its own). A start takes the stated
  20-24 minutes (22), or checkpoint / read rate + a fixed cost; its checkpoint reads are listed as
  bytes but not charged to R beyond that.
- One disk of R GB/s shared by every read and write at once. Extract writes every state byte while
  pack reads and writes the shard before (rule pack_shard); validate judges the facts written in each
  file's header and reads no states (`--validate-reads-states`: as under `validation.read_states`, it
  reads every byte too): extraction takes max(tokens / extract rate, (written + validated + packed
  bytes) / R). `--transport` (storage.transport_dir): the per-sample files are on a RAM disk, so the
  disk takes only pack's writes (each state byte once); validate and pack read from memory.
- Between two extract jobs on an engine its GPUs idle `--job-overhead-s`: 0.5 s measured on the H200
  with jobs queued beyond the GPUs (`--resources gpu=` above them: the next job prepared while the one
  before computes); 10 s with one job at a time.
- On the critical path, GPUs idle: the first shard's tokenize (the first extract needs it; the other
  tokenize jobs run beside it or beside extraction), the engine starts, the last shard's validate
  (its bytes / min(validate rate, R)), the last shard's pack after it (reads and writes its state bytes:
  max(bytes / pack rate, 2 x bytes / R); the dataset is then an index of hard links, seconds) and the
  trainer exports. An export at its default (`states: reader`, `--reader-exports speculators,specforge`)
  holds no states: its bytes are plan.disk.export_bytes's (speculators' table, 5 bytes a token; SpecForge's
  pointer files, a 4 KiB block a row), written at R (the demo's two measured 0.05x its packed dataset).
  An export with `states: files` (`--exports N`) is another copy of every state byte, at pack's rate
  (not measured).
- Enough CPU cores for tokenize, validate and pack jobs of several shards to run side by side.
Wall = the critical path; share = GPU-busy seconds / wall; the bound is the largest of the losses
(wall = GPU-busy seconds + losses).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from eagle3data.plan.disk import ExportShape, export_bytes

# docs/measurements/2026-12-01-h200-figure1-default.json: one H200, 8B Llama shape, bf16, TP1.
H200_RUN = "docs/measurements/2026-12-01-h200-figure1-default.json"
H200_BARE_PREFILL_TPS = 42_309.4
H200_ACTIVE_PARAMS = 8.03e9
EXTRACT_OVER_BARE = 0.946
H200_STORE_GBPS = 1.717  # 8 threads writing states files and making them durable
# Figures 2 and 3 on the 2-core CPU machine, Kimi-sized files (docs/benchmarks.md):
# validate 1.67-1.73 GB/s, pack 0.82-1.07 GB/s.
VALIDATE_GBPS = 1.70
PACK_GBPS = 0.95
# Figure 7's tokenize rule on the H200: 358,230 tokens in 13.98 s, imports included, demo tokenizer.
TOKENIZE_TPS = 25_600
# Figure 7 on the H200 at 1M tokens (docs/measurements/2026-12-02-h200-a-figures-1-7-run1.json): with 3
# extract jobs side by side the engine passed from one job to the next within ~0.2-0.5 s (one job at a
# time: ~10 s).
JOB_OVERHEAD_SECONDS = 0.5
ENGINE_START_SECONDS = 22 * 60  # Kimi-K2.5 on 8 GPUs: 20-24 minutes (stated, config/kimi-k2.5.yaml)
GOAL = 0.85


@dataclass(frozen=True)
class Node:
    """What the projection needs: the work, the node and the rates (bytes/s as GB/s, 1e9)."""

    conversations: int
    tokens_per_conversation: float
    shard_size: int
    hidden_size: int
    captures: int
    gpus: int
    tensor_parallel: int
    prefill_tps: float  # the whole node's bare prefill
    extract_over_bare: float
    disk_gbps: float
    engine_start_seconds: float
    engine_starts: int | None  # per engine; None: one per shard
    job_overhead_seconds: float  # per extract job, GPUs held but idle
    checkpoint_gb: float
    tokenize_tps: float
    validate_gbps: float
    validate_reads_states: bool  # validation.read_states: validate reads every byte too
    pack_gbps: float
    exports: int  # exports with states: files, each a copy of every state byte
    transport: bool = False
    reader_exports: tuple[str, ...] = ()  # trainers whose export is at its default, states: reader  # storage.transport_dir: the per-sample files on a RAM disk, not the disk


def slower(own_seconds: float, own: str, disk_seconds: float, disk_work: str, disk_gbps: float) -> str:
    """What sets a stage's time: its own rate, or the disk when moving its bytes takes longer."""
    return f"disk: {disk_work} at {disk_gbps:.2f} GB/s" if disk_seconds > own_seconds else own


def project(node: Node) -> dict:
    """Each stage's seconds, the wall time, the GPU-busy share and the losses that make up the rest."""
    tokens = node.conversations * node.tokens_per_conversation
    shards = math.ceil(node.conversations / node.shard_size)
    states = tokens * node.captures * node.hidden_size * 2
    disk = node.disk_gbps * 1e9
    engines = node.gpus // node.tensor_parallel
    starts = node.engine_starts if node.engine_starts is not None else math.ceil(shards / engines)

    busy = tokens / node.prefill_tps
    extraction = busy / node.extract_over_bare
    behind = states * (shards - 1) / shards  # the bytes of every shard but the last
    validated = states if node.validate_reads_states else 0.0  # else the facts in the headers only
    files_on_disk = 0.0 if node.transport else 1.0  # each sample's file: on the disk, or on a RAM disk
    # written; validated, packed (read, written) behind
    extraction_disk_bytes = files_on_disk * (states + validated * (shards - 1) / shards + behind) + behind
    extraction_phase = max(extraction, extraction_disk_bytes / disk)
    read_from = disk if files_on_disk else math.inf
    start_seconds = starts * node.engine_start_seconds
    jobs_idle = math.ceil(shards / engines) * node.job_overhead_seconds
    first_tokenize = tokens / shards / node.tokenize_tps
    validate = validated / min(node.validate_gbps * 1e9, read_from)
    packed_disk_bytes = (1 + files_on_disk) * states
    pack = max(states / (node.pack_gbps * 1e9), packed_disk_bytes / disk)
    shape = ExportShape(samples=node.conversations, tokens=round(tokens), states_per_token=node.captures,
                        hidden_size=node.hidden_size, itemsize=2)
    reader_bytes = sum(export_bytes(trainer, "reader", shape) for trainer in node.reader_exports)
    exports = node.exports * pack + reader_bytes / disk

    set_by = {
        "tokenize": f"CPU: {node.tokenize_tps:,.0f} tok/s a job",
        "engine start": f"{starts} x {node.engine_start_seconds:,.0f} s, each reading the checkpoint",
        "extract jobs": f"{math.ceil(shards / engines)} jobs an engine x {node.job_overhead_seconds:.1f} s each",
        "extract": slower(extraction, f"GPU: {node.extract_over_bare:.3f} of bare prefill",
                          extraction_disk_bytes / disk, f"{extraction_disk_bytes / 1e12:.2f} TB "
                          f"{'packed' if node.transport else 'written, validated and packed'}", node.disk_gbps),
        "validate": slower(validated / (node.validate_gbps * 1e9), f"CPU: {node.validate_gbps:.2f} GB/s a job",
                           validated / read_from, "reads", node.disk_gbps) if validated
        else "the facts written with the states (headers only)",
        "pack": slower(states / (node.pack_gbps * 1e9), f"CPU: pack's {node.pack_gbps:.2f} GB/s",
                       packed_disk_bytes / disk, f"{packed_disk_bytes / 1e12:.2f} TB "
                       f"{'written' if node.transport else 'read and written'}", node.disk_gbps),
        "exports": (f"{node.exports} files export(s) x pack's time (assumed); "
                    f"{', '.join(node.reader_exports) or 'no'} reader export(s) {reader_bytes / 1e9:,.1f} GB "
                    f"({reader_bytes / states:.4f}x the states) at the disk's rate"),
    }
    stages = [  # name, seconds of all its jobs, seconds on the critical path, overlap, disk bytes
        ("tokenize", tokens / node.tokenize_tps, first_tokenize, "yes, except the first shard's", 0.0),
        ("engine start", start_seconds, start_seconds, "no: GPUs idle", starts * node.checkpoint_gb * 1e9),
        ("extract", extraction_phase, extraction_phase, "is the GPU work", files_on_disk * states),
        ("validate", validate, validate / shards, "yes, except the last shard's", files_on_disk * validated),
        ("pack", pack, pack / shards, "yes, except the last shard's", packed_disk_bytes),
        ("exports", exports, exports, "no: after pack", node.exports * 2 * states + reader_bytes),
    ]
    losses = {  # wall = busy + these
        "tokenize of the first shard": (first_tokenize, set_by["tokenize"]),
        "engine starts": (start_seconds, set_by["engine start"]),
        "extract jobs' own start and end": (jobs_idle, set_by["extract jobs"]),
        "extraction below bare prefill": (extraction - busy, f"{node.extract_over_bare:.3f} of bare prefill"),
        "disk during extraction": (extraction_phase - extraction, set_by["extract"]),
        "validate of the last shard": (validate / shards, set_by["validate"]),
        "pack of the last shard": (pack / shards, set_by["pack"]),
        "exports": (exports, set_by["exports"]),
    }
    wall = busy + sum(seconds for seconds, _ in losses.values())
    bound = max(losses, key=lambda name: losses[name][0])
    return {
        "tokens": tokens, "shards": shards, "state_bytes": states, "engines": engines, "engine_starts": starts,
        "stages": [{"stage": name, "seconds": seconds, "critical_seconds": critical, "overlaps_gpu": overlaps,
                    "disk_bytes": nbytes, "set_by": set_by[name]}
                   for name, seconds, critical, overlaps, nbytes in stages],
        "gpu_busy_seconds": busy, "wall_seconds": wall, "gpu_busy_share": busy / wall, "goal": GOAL,
        "losses": [{"term": name, "seconds": seconds, "set_by": why,
                    "share_with_only_this_loss": busy / (busy + seconds)}
                   for name, (seconds, why) in sorted(losses.items(), key=lambda kv: -kv[1][0])],
        "goal_allows_loss_seconds": busy * (1 / GOAL - 1),
        "disk_gbps_for_gpu_bound_extraction": extraction_disk_bytes / extraction / 1e9,
        "bound": f"{bound} ({losses[bound][1]})",
    }


def measured_rates(path: Path) -> dict:
    """The rates a benchmark JSON holds: `eagle3bench.extract`'s, or the benchmark command's
    (`measurements.extract`, `measurements.io`)."""
    data = json.loads(path.read_text())
    groups = data.get("measurements", {"extract": data})
    extract, io = groups.get("extract", {}), groups.get("io", {})
    store = extract.get("write", {}).get("store_bytes_per_second")
    found = {
        "measured_prefill_tps": extract.get("bare", {}).get("tokens_per_second"),
        "extract_over_bare": extract.get("figures", {}).get("extract_over_bare"),
        "disk_gbps": store and store / 1e9,
        # Measuring every byte: newer JSON files time it apart; older ones had nothing else.
        "validate_gbps": (measuring := io.get("validate_measuring_bytes_per_second",
                                              io.get("validate_bytes_per_second"))) and measuring / 1e9,
        "pack_gbps": io.get("pack_bytes_per_second") and io["pack_bytes_per_second"] / 1e9,
    }
    found = {k: v for k, v in found.items() if v}
    if not found:
        raise SystemExit(f"{path} holds none of the rates this command reads (bare prefill, figure 1, "
                         "store writes, validate, pack): pass a benchmark JSON from docs/measurements/")
    return found


def node_from_args(args: argparse.Namespace) -> tuple[Node, dict]:
    """The node and, per rate, where its value came from: given, measured (--measured) or built in."""
    measured = measured_rates(args.measured) if args.measured else {}
    sources = {}

    def rate(name: str, built_in: float, built_in_source: str) -> float:
        if getattr(args, name) is not None:
            sources[name] = "given"
            return getattr(args, name)
        if name in measured:
            sources[name] = f"measured: {args.measured}"
            return measured[name]
        sources[name] = built_in_source
        return built_in

    extract_over_bare = rate("extract_over_bare", EXTRACT_OVER_BARE, f"measured, figure 1: {H200_RUN}")
    disk_gbps = rate("disk_gbps", H200_STORE_GBPS, f"measured, the store's durable writes: {H200_RUN}")
    if args.prefill_tps is not None:
        prefill, sources["prefill_tps"] = args.prefill_tps, "given"
    else:
        one_gpu = measured.get("measured_prefill_tps", H200_BARE_PREFILL_TPS)
        prefill = one_gpu * args.measured_active_params / args.active_params * args.gpus
        sources["prefill_tps"] = (
            f"derived, assumed: {one_gpu:,.0f} tok/s measured on one GPU ({args.measured or H200_RUN}) x "
            f"{args.measured_active_params / 1e9:g}B / {args.active_params / 1e9:g}B active parameters x {args.gpus} "
            "GPUs (compute-bound, perfect scaling)")
    if args.engine_start_seconds is not None:
        start, sources["engine_start_seconds"] = args.engine_start_seconds, "given"
    elif args.engine_fixed_seconds is not None:
        read_gbps = args.checkpoint_gbps or disk_gbps
        start = args.checkpoint_gb / read_gbps + args.engine_fixed_seconds
        sources["engine_start_seconds"] = (f"{args.checkpoint_gb:,.0f} GB checkpoint at {read_gbps:.2f} GB/s "
                                           f"+ {args.engine_fixed_seconds:,.0f} s")
    else:
        start = ENGINE_START_SECONDS
        sources["engine_start_seconds"] = "stated: Kimi-K2.5 loads in 20-24 minutes on 8 GPUs"
    node = Node(
        conversations=args.conversations, tokens_per_conversation=args.tokens_per_conversation,
        shard_size=args.shard_size, hidden_size=args.hidden_size, captures=args.captures, gpus=args.gpus,
        tensor_parallel=args.tp, prefill_tps=prefill, extract_over_bare=extract_over_bare,
        disk_gbps=disk_gbps, engine_start_seconds=start,
        engine_starts=None if args.engine_starts == "per-shard" else int(args.engine_starts),
        job_overhead_seconds=rate("job_overhead_s", JOB_OVERHEAD_SECONDS,
                                  "measured, figure 7 on the H200 with 3 extract jobs side by side"),
        checkpoint_gb=args.checkpoint_gb,
        tokenize_tps=rate("tokenize_tps", TOKENIZE_TPS, "measured, figure 7's tokenize rule on the H200"),
        validate_gbps=rate("validate_gbps", VALIDATE_GBPS, "measured, figure 2 on the CPU machine"),
        validate_reads_states=args.validate_reads_states, transport=args.transport,
        pack_gbps=rate("pack_gbps", PACK_GBPS, "measured, figure 3 on the CPU machine"),
        exports=args.exports, reader_exports=tuple(filter(None, args.reader_exports.split(","))),
    )
    return node, sources


def print_projection(node: Node, sources: dict, result: dict, compared: dict) -> None:
    print(f"{node.conversations:,} conversations x {node.tokens_per_conversation:,.0f} tokens = "
          f"{result['tokens']:,.0f} tokens in {result['shards']} shards of {node.shard_size:,}; "
          f"{node.captures} x {node.hidden_size:,} x 2 bytes a token = {result['state_bytes'] / 1e12:.2f} TB of states")
    print(f"node: {node.gpus} GPUs, TP {node.tensor_parallel} = {result['engines']} engine(s), "
          f"{result['engine_starts']} engine start(s) each")
    print(f"prefill {node.prefill_tps:,.0f} tok/s on the node: {sources['prefill_tps']}")
    print(f"extract {node.extract_over_bare:.3f} of it: {sources['extract_over_bare']}")
    print(f"disk {node.disk_gbps:.2f} GB/s, reads and writes together: {sources['disk_gbps']}")
    print(f"engine start {node.engine_start_seconds:,.0f} s: {sources['engine_start_seconds']}")
    print(f"extract job {node.job_overhead_seconds:.1f} s beyond its engine work: {sources['job_overhead_s']}")
    print(f"tokenize {node.tokenize_tps:,.0f} tok/s a job: {sources['tokenize_tps']}")
    print(f"validate {node.validate_gbps:.2f} GB/s a job reading the states (only with --validate-reads-states): "
          f"{sources['validate_gbps']}")
    print(f"pack {node.pack_gbps:.2f} GB/s: {sources['pack_gbps']}")
    print(f"{'stage':<13}{'seconds':>10}{'critical':>10}  {'overlaps the GPU work':<31}{'disk':>10}  set by")
    for s in result["stages"]:
        print(f"{s['stage']:<13}{s['seconds']:>10,.0f}{s['critical_seconds']:>10,.0f}  {s['overlaps_gpu']:<31}"
              f"{s['disk_bytes'] / 1e12:>7.2f} TB  {s['set_by']}")
    print(f"wall {result['wall_seconds']:,.0f} s ({result['wall_seconds'] / 3600:.2f} h), GPU-busy "
          f"{result['gpu_busy_seconds']:,.0f} s: GPU-busy share {result['gpu_busy_share']:.3f} (goal >= {GOAL}: "
          f"losses of at most {result['goal_allows_loss_seconds']:,.0f} s)")
    print(f"bound: {result['bound']}; with only this loss the share would be "
          f"{result['losses'][0]['share_with_only_this_loss']:.3f}")
    print("losses: " + ", ".join(f"{loss['term']} {loss['seconds']:,.0f} s" for loss in result["losses"]
                                 if loss["seconds"] > 0))
    print(f"disk for extraction to keep pace with the GPUs: {result['disk_gbps_for_gpu_bound_extraction']:.2f} GB/s")
    starts = ("one engine start per shard (the pipeline before engine_server)" if node.engine_starts is not None
              else "one engine start per engine")
    print(f"with {starts}, {compared['engine_starts']} per engine: wall {compared['wall_seconds']:,.0f} s, "
          f"GPU-busy share {compared['gpu_busy_share']:.3f}, bound: {compared['bound']}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m eagle3bench.projection", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=300_000, help="default: %(default)s")
    p.add_argument("--tokens-per-conversation", type=float, default=400,
                   help="mean, after truncation (default: %(default)s)")
    p.add_argument("--shard-size", type=int, default=1_000, help="default: %(default)s")
    p.add_argument("--hidden-size", type=int, default=7168, help="default: %(default)s")
    p.add_argument("--captures", type=int, default=4, help="default: %(default)s")
    p.add_argument("--active-params", type=float, default=32e9, help="per token (default: %(default)s)")
    p.add_argument("--gpus", type=int, default=8, help="default: %(default)s")
    p.add_argument("--tp", type=int, default=8, help="tensor parallel size; gpus / tp engines (default: %(default)s)")
    p.add_argument("--prefill-tps", type=float, help="the node's bare prefill tokens/s (default: derived)")
    p.add_argument("--measured", type=Path, help="a benchmark JSON (docs/measurements/) to read rates from")
    p.add_argument("--measured-active-params", type=float, default=H200_ACTIVE_PARAMS,
                   help="active parameters of the model whose one-GPU prefill was measured (default: %(default)s)")
    p.add_argument("--extract-over-bare", type=float, help=f"figure 1 (default: {EXTRACT_OVER_BARE})")
    p.add_argument("--disk-gbps", type=float, help=f"the disk's rate R, GB/s (default: {H200_STORE_GBPS})")
    p.add_argument("--engine-starts", default="1", help="per engine, or per-shard (default: %(default)s)")
    p.add_argument("--engine-start-seconds", type=float, help=f"default: {ENGINE_START_SECONDS}")
    p.add_argument("--job-overhead-s", type=float,
                   help=f"an extract job's seconds with the GPUs idle (default: {JOB_OVERHEAD_SECONDS})")
    p.add_argument("--checkpoint-gb", type=float, default=540, help="default: %(default)s")
    p.add_argument("--engine-fixed-seconds", type=float,
                   help="instead of --engine-start-seconds: a start is checkpoint / read rate + this")
    p.add_argument("--checkpoint-gbps", type=float, help="the checkpoint's read rate (default: --disk-gbps)")
    p.add_argument("--tokenize-tps", type=float, help=f"one tokenize job (default: {TOKENIZE_TPS})")
    p.add_argument("--validate-gbps", type=float, help=f"one validate job (default: {VALIDATE_GBPS})")
    p.add_argument("--validate-reads-states", action="store_true",
                   help="validation.read_states: validate reads every state byte (default: headers only)")
    p.add_argument("--transport", action="store_true",
                   help="storage.transport_dir: the per-sample files on a RAM disk (the disk takes each byte once)")
    p.add_argument("--pack-gbps", type=float, help=f"default: {PACK_GBPS}")
    p.add_argument("--exports", type=int, default=0,
                   help="trainer exports with states: files, each another copy of every state byte "
                        "(default: %(default)s)")
    p.add_argument("--reader-exports", default="",
                   help="trainers (speculators,specforge) whose export is at its default, states: reader: "
                        "no states, the trainer's small files only (default: none)")
    p.add_argument("--json", action="store_true", help="print the projection as JSON")
    args = p.parse_args(argv)
    if args.engine_starts != "per-shard" and not args.engine_starts.isdigit():
        p.error("--engine-starts takes a count or per-shard")
    if args.gpus % args.tp:
        p.error("--tp must divide --gpus")
    if set(filter(None, args.reader_exports.split(","))) - {"speculators", "specforge"}:
        p.error("--reader-exports takes speculators, specforge or both, comma-separated")
    node, sources = node_from_args(args)
    result = project(node)
    compared = project(replace(node, engine_starts=1 if node.engine_starts is None else None))
    if args.json:
        print(json.dumps({"inputs": asdict(node), "sources": sources, **result, "compared": compared}, indent=1))
    else:
        print_projection(node, sources, result, compared)


if __name__ == "__main__":
    main()
