r"""Every stage measured against its own limit, in one run: `python -m eagle3bench` runs `main`.

Each figure is a ratio (or, for planning, seconds) of a stage against its reference, both measured in
the same run on the same data. Prints, last, one line per figure (number, name, value, goal, PASS /
FAIL, or `-` where the issue sets no goal), and writes every measurement as JSON (`--out`). See
docs/benchmarks.md for what each figure measures and how.

    python -m eagle3bench --quick --out bench.json          # a few minutes on 2 cores
    python -m eagle3bench --out bench.json                  # the full sizes
    python -m eagle3bench --figures 1,7 --device cuda --model DIR --captures 2:input,... \
        --engine load_format=dummy                                   # extraction on a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from eagle3data.utils.checkout import REPO
from eagle3bench.crosscheck import parse_capture_arg, parse_engine_args

DEMO_MODEL = "resources/demo-model"
DEMO_CAPTURES = "2:input,4:input,5:input,7:output"
NAMES = {"1": "extract", "7": "steady", "7d": "to_dataset", "7w": "whole_run", "7t": "tail", "2": "validate", "3": "pack",
         "3m": "pack_memory", "4": "tokenize", "5": "planning", "6": "storage", "6f": "fp8_storage",
         "6e": "fp8_error", "12": "reader", "12v": "verify", "9": "load", "10": "footprint_peak",
         "11": "footprint_after", "13": "parity"}  # 3m is pack's memory; 7 a run's steady part, 7d to its dataset, 7w whole, 7t tail; 6f, 6e fp8's bytes and error
ORDER = tuple(NAMES)


@dataclass
class Scale:
    plan_conversations: int
    tokenize_conversations: int
    io_samples_per_shard: int  # Kimi-sized samples; 1x is one shard, 4x four
    io_repeats: int
    extract_prompts: int
    extract_tokens: int
    e2e_conversations: int
    e2e_shards: int
    load_runs: int
    storage_conversations: int  # figure 6's real SmolLM2 run (figure 8's training conversations)
    reader_repeats: int


SCALES = {
    "quick": Scale(1_000_000, 1_000, 4, 1, 16, 256, 64, 2, 1, 64, 1),
    "full": Scale(1_000_000, 5_000, 16, 3, 64, 512, 512, 4, 3, 192, 3),
}


@dataclass
class Figure:
    figure: str
    name: str
    value: float | None
    goal: str  # "" where the issue sets none
    passed: bool | None
    detail: str

    def line(self) -> str:
        value = "-" if self.value is None else f"{self.value:.4f}"
        verdict = "-" if self.passed is None else ("PASS" if self.passed else "FAIL")
        return (f"figure {self.figure:<2} {self.name:<11} {value:>8}  goal {self.goal or 'none':<8} "
                f"{verdict:<4}  {self.detail}")


def judged(figure: str, name: str, value: float, goal: str, detail: str) -> Figure:
    """A figure against its goal, written `>= x`, `<= x` or `< x`."""
    op, bound = goal.split()
    passed = {">=": value >= float(bound), "<=": value <= float(bound), "<": value < float(bound)}[op]
    return Figure(figure, name, value, goal, passed, detail)


def run_child(cmd: list[str], log: Path) -> None:
    """A measuring subprocess whose output goes to `log`; raises naming the log when it fails."""
    with open(log, "w") as f:
        if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[:4])} ... failed; see {log}")


def extract_figures(args, scale: Scale, work: Path, measured: dict) -> tuple[dict, list[Figure]]:
    """Figure 1: eagle3bench.extract (pipeline extract vs bare prefill of the same engine)."""
    from eagle3bench.extract import describe_steps

    out = work / "extract.json"
    cmd = [sys.executable, "-m", "eagle3bench.extract", "--model", args.model, "--device", args.device,
           "--captures", args.captures, "--prompts", str(scale.extract_prompts),
           "--tokens", str(scale.extract_tokens), "--work", str(work / "extract"),
           "--out", str(out)]
    run_child(cmd + (["--engine", *args.engine] if args.engine else []), work / "extract.log")
    result = json.loads(out.read_text())
    shutil.rmtree(work / "extract", ignore_errors=True)  # its states (34 GB on a GPU) leave room for figure 7's
    e, b = result["extract"], result["bare"]
    goal = ">= 0.97" if args.device == "cuda" else ">= 0.8"
    return result, [judged("1", "extract", result["figures"]["extract_over_bare"], goal,
                           f"extract {e['tokens_per_second']:.0f} tok/s / bare prefill "
                           f"{b['tokens_per_second']:.0f} tok/s ({result['prompts']} x {result['tokens_per_prompt']} "
                           f"tokens, files raw; seconds: {describe_steps(e)}, bare prefill {b['seconds']:.2f}); "
                           f"bare at {result['figures']['bare_over_matmul']:.3f} of a bf16 "
                           f"{result['matmul']['size']}² matmul; "
                           f"the store's durable writes at {result['figures']['store_write_over_bare_need']:.2f} "
                           f"x bare's need")]


def describe_timeline(t: dict, bare_seconds: float) -> str:
    """Figure 7's seconds from the engine ready: what bounds it, extraction or the tail after it."""
    return (f"seconds from the engine ready: bare prefill of these tokens {bare_seconds:.1f}, jobs in generate() "
            f"{t['engine_held_seconds']:.1f} of the {t['last_generate_end']:.1f} to the last generate's end, last "
            f"extract job ends {t['last_extract_end']:.1f}, validate {t['last_validate_end']:.1f}, pack_shard "
            f"{t['last_pack_shard_end']:.1f}, index {t['index_end']:.1f}")


def end_to_end_figures(args, scale: Scale, work: Path, measured: dict) -> tuple[dict, list[Figure]]:
    """A whole run's tokens per wall second / bare prefill's (figure 1's), over three spans: 7 its steady
    part, from the engine ready to the last extract job's end; 7d from the engine ready to the packed
    dataset; 7w the whole run, from the command to its end (engine load and tokenize included, stated in
    seconds); 7t its tail in seconds, from the last extract job's end to the packed dataset. 10 and 11: its
    disk footprint with the trainer exports (run only when asked for: on a GPU's disk a SpecForge copy of a
    large run may not fit)."""
    from eagle3bench.stages import measure_end_to_end

    bare_tps = measured["extract"]["bare"]["tokens_per_second"]
    engine = {"device": args.device, **parse_engine_args(args.engine)}
    exports = bool({"10", "11"} & set(args.figures.split(",")))
    codec = args.codec
    result = measure_end_to_end(work / "e2e", args.model, scale.e2e_conversations, engine,
                                parse_capture_arg(args.captures), os.cpu_count(), scale.e2e_shards, exports,
                                args.jobs_per_engine, args.transport_dir, codec)
    jobs = f", {args.jobs_per_engine} extract jobs side by side" if args.device == "cuda" else ""
    if codec != "none":
        jobs += f", states stored with {codec}"
    if args.transport_dir:
        jobs += (f", per-sample files on {args.transport_dir} (peak "
                 f"{result['footprint']['transport_peak_bytes'] / 1e9:.1f} GB of memory)")
    timeline, tokens = result["timeline"], result["tokens"]
    steady, tail = timeline["last_extract_end"], timeline["index_end"] - timeline["last_extract_end"]
    to_dataset, whole = result["seconds_from_engine_ready"], result["seconds"]
    before_ready = whole - result["seconds_from_engine_ready_to_end_of_run"]
    run = (f"{tokens} tokens of {result['conversations']} conversations in {result['shards']} shards{jobs}; bare "
           f"prefill {bare_tps:.0f} tok/s, {tokens / bare_tps:.1f} s for these tokens")
    figures = [
        judged("7", "steady", tokens / steady / bare_tps, ">= 0.95",
               f"steady part: {steady:.1f} s from the engine ready to the last extract job's end = "
               f"{tokens / steady:.0f} tok/s; {run}; {describe_timeline(timeline, tokens / bare_tps)}"),
        judged("7d", "to_dataset", tokens / to_dataset / bare_tps, ">= 0.85",
               f"{to_dataset:.1f} s from the engine ready to the packed dataset = {tokens / to_dataset:.0f} tok/s; {run}"),
        Figure("7w", "whole_run", tokens / whole / bare_tps, "", None,
               f"the whole run, {whole:.1f} s from the command to its end = {tokens / whole:.0f} tok/s; of which "
               f"{before_ready:.1f} s before the first engine was ready ({result['engine_loads']} engine load(s) "
               f"{result['engine_load_seconds']:.1f} s, the rest tokenize and the jobs' starts) and "
               f"{whole - before_ready - to_dataset:.1f} s after the dataset; {run}"),
        judged("7t", "tail", tail, "<= 5",
               "seconds from the last extract job's end to the packed dataset (its last validate, pack_shard "
               "and the index): a fixed cost per run, not per token"),
    ]
    if not exports:
        return result, figures
    disk = result["footprint"]
    gb = {k: f"{v / 1e9:.3f} GB" for k, v in disk.items() if isinstance(v, (int, float))}
    where = (f"dataset {gb['dataset_bytes']} (states stored with codec {args.codec}; raw "
             f"{disk['raw_state_bytes'] / 1e9:.3f} GB), per-sample store beyond it {gb['store_bytes']} "
             f"(storage.drop_packed_states), exports' own bytes {gb['exports_own_bytes']} (both with "
             f"states: reader)")
    return result, figures + [
        judged("10", "footprint_peak", disk["peak_bytes"] / disk["dataset_bytes"], "<= 1.5",
               f"the run's largest disk use {gb['peak_bytes']} (sampled each second) / the dataset's "
               f"{gb['dataset_bytes']}; before the exports {gb['pipeline_peak_bytes']}: "
               f"{disk['pipeline_peak_bytes'] / disk['dataset_bytes']:.2f}"),
        judged("11", "footprint_after", disk["run_bytes"] / disk["dataset_bytes"], "<= 1.1",
               f"the run directory after the run and both exports {gb['run_bytes']} / the dataset: {where}"),
    ]


def io_figures(args, scale: Scale, work: Path, measured: dict) -> tuple[dict, list[Figure]]:
    """Figures 2, 3 and 3m on Kimi-sized synthetic samples (eagle3bench.io); their storage ratio
    goes into figure 6's line."""
    from eagle3bench.io import measure

    r = measure(work / "io", 1, scale.io_samples_per_shard, 512, scale.io_repeats)
    rss, shape = r["pack_peak_rss_mib"], r["shape"]
    gbs = {k: f"{v / 1e9:.2f} GB/s" for k, v in r.items() if k.endswith("_bytes_per_second")}
    warm = {k: f"{v / 1e9:.2f}" for k, v in r["warm"].items()}
    return r, [
        judged("2", "validate", r["validate_bytes_per_second"] / r["read_bytes_per_second"], ">= 0.5",
               f"validate {gbs['validate_bytes_per_second']} of states (the facts written with them) / read "
               f"{gbs['read_bytes_per_second']} from disk, {shape['files']} raw files of 4 x [512, 7168] bf16; "
               f"measuring every byte (validation.read_states) {gbs['validate_measuring_bytes_per_second']} = "
               f"{r['validate_measuring_bytes_per_second'] / r['read_bytes_per_second']:.2f} (from page cache: "
               f"{warm['validate_measuring_bytes_per_second']} / {warm['read_bytes_per_second']})"),
        judged("3", "pack", r["pack_bytes_per_second"] / r["cp_durable_bytes_per_second"], ">= 0.5",
               f"pack {gbs['pack_bytes_per_second']} of states (raw files into {r['compression']} rows, "
               f"{r['pack_threads']} threads) / cp {gbs['cp_durable_bytes_per_second']} of the same files "
               f"({shape['bytes'] / 1e9:.2f} GB holding {shape['raw_bytes'] / 1e9:.2f} GB of states), both made "
               f"durable (cp then sync; cp alone {gbs['cp_bytes_per_second']}, its copies left in the page "
               f"cache); raw files packed without compression {gbs['pack_raw_bytes_per_second']} / their cp "
               f"{gbs['cp_durable_raw_bytes_per_second']} = "
               f"{r['pack_raw_bytes_per_second'] / r['cp_durable_raw_bytes_per_second']:.3f}"),
        judged("3m", "pack_memory", rss["4x"] / rss["1x"], "<= 1.3",
               f"peak RSS packing {shape['files']} samples in one shard {rss['4x']:.0f} MiB / the "
               f"{shape['files'] // 4} of {shape['shards_1x']} shard {rss['1x']:.0f} MiB (imports alone {rss['before_pack']:.0f} MiB)"),
    ]


def storage_figures(args, scale: Scale, work: Path, measured: dict) -> tuple[dict, list[Figure]]:
    """Figure 6 on real SmolLM2 states and the demo, 6f and 6e the same states as fp8, figure 12 the
    trainers' readers on them (eagle3bench.storage)."""
    from eagle3bench.storage import describe_verification, measure

    r = measure(work / "storage", args.model, scale.storage_conversations, scale.reader_repeats)
    real, demo, codecs, error = r["smollm2"], r["demo"], r["smollm2_codecs"], r["fp8_error"]
    kimi = measured.get("io")
    synthetic = (f"; Kimi-shaped random normal bf16 (figures 2-3's files) "
                 f"{kimi['dataset_bytes_per_token'] / kimi['raw_state_bytes_per_token']:.4f}" if kimi else "")
    rates = {name: {k: v / 1e9 for k, v in by.items()} for name, by in r["readers"]["bytes_per_second"].items()}
    c, raw = rates["compressed"], rates["raw"]
    kimi_rows = (f"; Kimi-shaped rows [512, 4, 7168] (figure 3's datasets): open_dataset "
                 + " / ".join(f"{v / 1e9:.2f}" for v in kimi["open_dataset_rates"].values())
                 if kimi else "")
    return r, [
        judged("6", "storage", real["stored_over_raw"], "<= 0.72",
               f"SmolLM2-135M-Instruct's real bf16 states ({real['samples']} samples, {real['tokens']} tokens, "
               f"{real['raw_state_bytes'] / 1e6:.1f} MB raw): dataset files {real['stored_bytes'] / 1e6:.1f} MB "
               f"with {real['compression']['codec']} level {real['compression']['level']}; uncompressed "
               f"{r['smollm2_uncompressed']['stored_over_raw']:.4f}; the same states as frames: "
               + ", ".join(f"{k} {v['frames_over_raw']:.4f}" for k, v in codecs.items())
               + f"; the demo {demo['stored_over_raw']:.4f} ({demo['tokens']} tokens){synthetic}"),
        judged("6f", "fp8_storage", r["smollm2_fp8"]["stored_over_raw"], "<= 0.40",
               f"the same states packed as fp8_e4m3 (zstd level 1): dataset files "
               f"{r['smollm2_fp8']['stored_bytes'] / 1e6:.1f} MB of {real['raw_state_bytes'] / 1e6:.1f} MB raw bf16 "
               f"(exact {real['stored_over_raw']:.4f}); its e4m3 codes' order-0 entropy "
               f"{error['codes_entropy_bits']:.3f} bits a value = {error['codes_entropy_bits'] / 16:.4f} of raw "
               f"bf16, what a byte-wise entropy coder reaches at best; speculators' reader "
               f"{rates['fp8']['speculators']:.2f} GB/s of bf16 states (exact {c['speculators']:.2f}), SpecForge's "
               f"{rates['fp8']['specforge']:.2f}, open_dataset {rates['fp8']['open_dataset']:.2f}"),
        judged("6e", "fp8_error", error["worst_relative"], "<= 0.0703",
               "worst ||fp8 - bf16|| / ||bf16|| of a sample's capture, as the readers return them (goal: the "
               "per-value bound 2^-4 + 2^-7); worst / median by capture: "
               + ", ".join(f"{n} {e['worst']:.4f} / {e['median']:.4f}" for n, e in error["by_capture"].items())
               + f"; every value's error at most {error['worst_error_over_bound']:.3f} of its stated bound; "
               f"{error['below_normal_share']:.2e} of the values below e4m3's normal range (2^-6 of their "
               "token's largest), where the bound's absolute part applies"),
        judged("12", "reader", c["speculators"], ">= 1",
               f"GB/s of raw states through speculators' reader (eagle3data backend) on the compressed "
               f"dataset, from the page cache, {r['blosc2_threads']} Blosc2 threads; uncompressed "
               f"{raw['speculators']:.2f}; SpecForge's reader {c['specforge']:.2f} / {raw['specforge']:.2f}; "
               f"open_dataset {c['open_dataset']:.2f} / {raw['open_dataset']:.2f} (compressed / raw){kimi_rows}"),
        judged("12v", "verify", r["readers"]["verified_over_unverified"]["compressed"]["speculators"], ">= 0.95",
               "speculators' reader GB/s on the compressed dataset with every row's checksums verified / without"
               + describe_verification(r)),
    ]


def tokenize_figures(args, scale: Scale, work: Path, measured: dict) -> tuple[dict, list[Figure]]:
    from eagle3bench.stages import measure_tokenize

    sequence = {"max_seq_len": 512, "min_seq_len": 8}  # the demo's
    r = measure_tokenize(work, args.model, scale.tokenize_conversations, sequence)
    return r, [Figure("4", "tokenize", r["stage_samples_per_second"] / r["bare_samples_per_second"], "", None,
                      f"tokenize stage {r['stage_samples_per_second']:.0f} samples/s / bare tokenizer "
                      f"{r['bare_samples_per_second']:.0f} texts/s ({r['conversations']} conversations)")]


def planning_figures(args, scale: Scale, work: Path, measured: dict) -> tuple[dict, list[Figure]]:
    from eagle3bench.stages import measure_planning

    r = measure_planning(work / "plan", scale.plan_conversations)
    return r, [judged("5", "planning", r["seconds"], "< 30",
                      f"snakemake -n: {r['conversations']:,} conversations, {r['jobs']} jobs, "
                      f"{r['seconds']:.1f} s (23 conversations: {r['seconds_for_23']:.1f} s)")]


def load_figures(args, scale: Scale, work: Path, measured: dict) -> tuple[dict, list[Figure]]:
    """Figure 9: (engine start - a dummy-weight start) / the cold read of the weights (bench.load)."""
    from eagle3bench.load import describe, measure

    r = measure(args.model, scale.load_runs)
    return r, [judged("9", "load", r["ratios"][0], "<= 1.5", describe(r))]


def parity_figures(args, scale: Scale, work: Path, measured: dict) -> tuple[dict, list[Figure]]:
    """Figure 13: the parity gate's cost in a production run (bench.parity_cost)."""
    from eagle3bench.parity_cost import describe, measure

    r = measure(work / "parity")
    return r, [judged("13", "parity", r["ratios_worst_first"][0], "<= 0.02", describe(r))]


def commit() -> str:
    """The checkout's commit (the measurement index's commit column), `-dirty` when files differ from it;
    "" outside a git checkout (the GPU kit's copy)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD")
    if not head and (REPO / ".commit").is_file():  # a copy without .git (the GPU kit's): its commit, written there
        return (REPO / ".commit").read_text().strip()
    return head + ("-dirty" if head and git("status", "--porcelain", "--untracked-files=no") else "")


GROUPS = {  # name: (figures it yields, function(args, scale, work, measured so far)), in order
    "planning": (("5",), planning_figures),
    "tokenize": (("4",), tokenize_figures),
    "io": (("2", "3", "3m"), io_figures),
    "storage": (("6", "6f", "6e", "12", "12v"), storage_figures),
    "extract": (("1",), extract_figures),
    "end_to_end": (("7", "7d", "7w", "7t", "10", "11"), end_to_end_figures),
    "load": (("9",), load_figures),
    "parity": (("13",), parity_figures),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller sizes: a few minutes on 2 cores")
    parser.add_argument("--figures", default=",".join(ORDER), help="subset, e.g. 1,7 (3m: pack memory)")
    parser.add_argument("--model", default=DEMO_MODEL,
                        help="for 1, 4, 6 (the demo beside SmolLM2), 7, 9; the demo model is built if missing")
    parser.add_argument("--captures", default=DEMO_CAPTURES, help="for 1 and 7")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="for 1 and 7")
    parser.add_argument("--engine", nargs="*", default=[], help="engine settings KEY=VALUE, for 1 and 7")
    parser.add_argument("--prompts", type=int, help="figure 1's prompts (default: the scale's)")
    parser.add_argument("--tokens", type=int, help="figure 1's tokens per prompt (default: the scale's)")
    parser.add_argument("--conversations", type=int, help="figure 7's conversations (default: the scale's)")
    parser.add_argument("--shards", type=int, help="figure 7's shards (default: the scale's)")
    parser.add_argument("--jobs-per-engine", type=int, default=2,
                        help="figure 7 on a GPU: --resources gpu=<this x tensor parallel size>")
    parser.add_argument("--transport-dir", default="",
                        help="figure 7's storage.transport_dir (a RAM disk: the disk takes each state byte once)")
    parser.add_argument("--codec", default="zstd", choices=["none", "zstd", "lz4"],
                        help="storage.compression.codec of figure 7's run (so 10, 11): the packed dataset's")
    parser.add_argument("--weights", default="",
                        help="where the model's weights come from, for the results tables (e.g. 'random normal "
                             "weights'); default: 'dummy weights' under load_format=dummy")
    parser.add_argument("--work", default="results/benchmark", help="scratch directory (emptied first)")
    parser.add_argument("--out", help="write the JSON here")
    args = parser.parse_args(argv)
    wanted = set(args.figures.split(","))
    scale = SCALES["quick" if args.quick else "full"]
    sizes = {"extract_prompts": args.prompts, "extract_tokens": args.tokens, "e2e_conversations": args.conversations,
             "e2e_shards": args.shards}
    scale = replace(scale, **{k: v for k, v in sizes.items() if v})
    work = Path(args.work).resolve()  # the Snakemake runs below work in directories of their own
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    if not Path(args.model, "config.json").is_file() and args.model == DEMO_MODEL:
        from eagle3data.model.demo import build_demo_model
        from eagle3bench.stages import DEMO

        build_demo_model(DEMO, Path(args.model))
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "commit": commit(), "host": platform.node(),
              "cpus": os.cpu_count(), "weights": args.weights,
              "python": platform.python_version(), "scale": asdict(scale), "args": vars(args),
              "measurements": {}, "errors": {}}
    figures: list[Figure] = []
    needed = wanted | ({"1"} if wanted & set(GROUPS["end_to_end"][0]) else set())
    for group, (yields, measure) in GROUPS.items():
        if not needed & set(yields):
            continue
        print(f"benchmark: measuring {group} ...", file=sys.stderr, flush=True)
        began = time.perf_counter()
        try:
            report["measurements"][group], found = measure(args, scale, work, report["measurements"])
        except Exception as exc:  # one broken group must not cost the others' figures
            report["errors"][group] = traceback.format_exc()
            found = [Figure(f, NAMES[f], None, "", False, f"{group} failed: {type(exc).__name__}: {exc}"[:300])
                     for f in yields]
        figures += [f for f in found if f.figure in wanted]
        print(f"benchmark: {group} took {time.perf_counter() - began:.0f} s", file=sys.stderr, flush=True)
    figures.sort(key=lambda f: ORDER.index(f.figure))
    report["figures"] = [asdict(f) for f in figures]
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    for f in figures:
        print(f.line())
    return 1 if report["errors"] else 0

