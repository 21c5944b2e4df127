"""Report pages for `snakemake --report`: counts and skip reasons, lengths, norms, throughput."""

from __future__ import annotations

import html
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402


def write_report(counts: str, tokenized: list[str], states: list[str], stats: list[str], out) -> None:
    counts_doc = json.loads(open(counts).read())
    tokens = pd.concat([pd.read_parquet(p, columns=["num_tokens", "num_trainable", "truncated"])
                        for p in tokenized], ignore_index=True)
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
    ax.boxplot([manifest.loc[manifest.capture == c, "mean_norm"] for c in order], tick_labels=order)
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

    trainable_share = tokens["num_trainable"].sum() / max(1, tokens["num_tokens"].sum())
    rows = [
        ("conversations in", counts_doc["conversations_in"]),
        ("samples packed", counts_doc["packed"]),
        ("samples skipped", counts_doc["skipped"]),
        *((f"skipped: {reason}", n) for reason, n in counts_doc["skip_reasons"].items()),
        ("tokens (packed samples)", int(tokens["num_tokens"].sum())),
        ("trainable token share", f"{trainable_share:.3f}"),
        ("samples truncated to max_seq_len", int(tokens["truncated"].sum())),
        ("samples computed / reused", f"{shard_stats['computed'].sum()} / {shard_stats['reused'].sum()}"),
    ]
    table = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(str(v))}</td></tr>" for k, v in rows)
    throughput = shard_stats.to_html(index=False, float_format=lambda x: f"{x:.1f}")
    with open(out.summary, "w") as f:
        f.write(f"<html><body><h2>Counts</h2><table>{table}</table>"
                f"<h2>Extraction per shard</h2>{throughput}</body></html>")
