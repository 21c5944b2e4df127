"""Report pages for `snakemake --report`: counts and skip reasons, lengths, norms, throughput.

The summary also says what the data is made of, from the facts `tokenize` records per sample: how many
samples train tool calls and reasoning, and which share of the trainable tokens is the assistant's
reasoning, its tool calls and the rest of what it wrote (answers and the template's turn markers).
"""

from __future__ import annotations

import html
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402


SAMPLE_FACTS = ["sample_id", "num_tokens", "num_trainable", "truncated", "has_tool_calls", "has_reasoning",
                "reasoning_not_rendered", "reasoning_tokens", "tool_call_tokens"]


def _count_and_share(count: int, total: int) -> str:
    return f"{count} ({count / max(1, total):.1%})"


def content_rows(tokens: pd.DataFrame) -> list[tuple[str, str | int]]:
    """Summary rows on what the kept samples (one per sample id) are made of."""
    n, trainable = len(tokens), int(tokens["num_trainable"].sum())
    reasoning, calls = int(tokens["reasoning_tokens"].sum()), int(tokens["tool_call_tokens"].sum())
    return [
        ("tokens (kept samples)", int(tokens["num_tokens"].sum())),
        ("trainable tokens", _count_and_share(trainable, int(tokens["num_tokens"].sum()))),
        ("samples training tool calls", _count_and_share(int(tokens["has_tool_calls"].sum()), n)),
        ("samples training reasoning", _count_and_share(int(tokens["has_reasoning"].sum()), n)),
        ("trainable tokens: reasoning", _count_and_share(reasoning, trainable)),
        ("trainable tokens: tool calls", _count_and_share(calls, trainable)),
        ("trainable tokens: answers and turn markers", _count_and_share(trainable - reasoning - calls, trainable)),
        ("trained turns whose reasoning the template does not render", int(tokens["reasoning_not_rendered"].sum())),
    ]


def engines_per_node(shard_stats: pd.DataFrame) -> pd.DataFrame:
    """Per node: engine loads, seconds loading, seconds extracting (engine/server.py: one engine serves
    many shards). Shards with nothing to compute used no engine and are not counted."""
    used = shard_stats[shard_stats["computed"] > 0]
    if used.empty or "engine_node" not in used:
        return pd.DataFrame(columns=["node", "shards", "engine loads", "seconds loading", "seconds extracting"])
    loaded = used["engine_loaded_here"].astype(bool)
    return pd.DataFrame({
        "shards": used.groupby("engine_node").size(),
        "engine loads": loaded.groupby(used["engine_node"]).sum(),
        "seconds loading": used["engine_load_seconds"].where(loaded, 0.0).groupby(used["engine_node"]).sum(),
        "seconds extracting": used.groupby("engine_node")["seconds"].sum(),
    }).rename_axis("node").reset_index()


def parity_rows(parity: dict) -> list[tuple[str, str]]:
    """The parity gate's verdict over the run (validate/parity.py summarize), as report rows."""
    rows = [("parity gate", f"{parity['status']}" + (f": {parity['samples']} samples of {parity['shards']} shards"
                                                     if "samples" in parity else ""))]
    if final := parity.get("final_capture"):
        rows.append(("parity: final capture vs the engine's next-token log-probabilities",
                     f"worst median {final['worst_median']}, worst token {final['worst_max']} (allowed "
                     f"{final['tolerance']['median']}, {final['tolerance']['max']})"))
    if reference := parity.get("reference"):
        rows.append(("parity: captures vs transformers (first layers)",
                     f"{', '.join(reference['captures'])} through {reference['layers']} layers, in "
                     f"{reference['shards']} shards: worst median {reference['worst_median']} (allowed "
                     f"{reference['tolerance']})"))
    rows += [(f"parity: not run: {why}", f"{n} shards") for why, n in parity.get("not_run", {}).items()]
    return rows


def write_report(counts: str, tokenized: list[str], states: list[str], stats: list[str], out) -> None:
    counts_doc = json.loads(open(counts).read())
    tokens = pd.concat([pd.read_parquet(p, columns=SAMPLE_FACTS) for p in tokenized], ignore_index=True)
    tokens = tokens.drop_duplicates("sample_id")  # pack keeps one of equal samples in different shards
    manifest = pd.concat([pd.read_parquet(p) for p in states], ignore_index=True)
    shard_stats = pd.DataFrame([{"shard": i, **json.loads(open(p).read())} for i, p in enumerate(stats)])

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.hist(tokens["num_tokens"], bins=30)
    ax.set(xlabel="tokens per sample", ylabel="samples", title="Token lengths")
    fig.tight_layout()
    fig.savefig(out.lengths)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    order = manifest.drop_duplicates("capture").sort_values("slot")["capture"].tolist()
    if order:
        ax.boxplot([manifest.loc[manifest.capture == c, "mean_norm"] for c in order], tick_labels=order)
    else:  # every sample was skipped: the report still says why
        ax.text(0.5, 0.5, "no states: no sample was extracted", ha="center", va="center", transform=ax.transAxes)
    ax.set(ylabel="mean L2 norm per token", title="Hidden-state norms by capture")
    fig.tight_layout()
    fig.savefig(out.norms)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(shard_stats["shard"], shard_stats["tokens_per_second"].fillna(0))
    ax.set(xlabel="shard", ylabel="tokens/s (computed)", title="Extraction throughput")
    fig.tight_layout()
    fig.savefig(out.throughput)
    plt.close(fig)

    rows = [
        ("conversations in", counts_doc["conversations_in"]),
        ("samples beyond the first of conversations split by the template", counts_doc.get("split_samples", 0)),
        ("samples packed", counts_doc["packed"]),
        ("samples skipped", counts_doc["skipped"]),
        *((f"skipped: {reason}", n) for reason, n in counts_doc["skip_reasons"].items()),
        *content_rows(tokens),
        ("samples truncated to max_seq_len", int(tokens["truncated"].sum())),
        ("samples computed / reused", f"{shard_stats['computed'].sum()} / {shard_stats['reused'].sum()}"),
        *parity_rows(counts_doc.get("parity") or {"status": "off"}),
    ]
    table = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(str(v))}</td></tr>" for k, v in rows)
    throughput = shard_stats.to_html(index=False, float_format=lambda x: f"{x:.1f}")
    engines = engines_per_node(shard_stats).to_html(index=False, float_format=lambda x: f"{x:.1f}")
    with open(out.summary, "w") as f:
        f.write(f"<html><body><h2>Counts</h2><table>{table}</table>"
                f"<h2>Engines per node</h2>{engines}"
                f"<h2>Extraction per shard</h2>{throughput}</body></html>")
