"""The regeneration page of the report: did the target's answers replace the originals, and how long are they.

Kept apart from report/pages.py (the pipeline's pages) because the stage is optional: its rule runs only when
`regenerate.enabled`. Shows the counts (in = regenerated + kept original + skipped), finish reasons (a
share of `length` means `max_new_tokens` cuts answers short), and response lengths in tokens before (the
original answers) and after (the target's).
"""

from __future__ import annotations

import html
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402


def write_regenerate_report(responses: list[str], stats: list[str], summary_out: str, lengths_out: str) -> None:
    turns = pd.concat([pd.read_parquet(p) for p in responses], ignore_index=True)
    shards = [json.loads(open(p).read()) for p in stats]

    fig, ax = plt.subplots(figsize=(6, 3.5))
    before = turns["tokens_before"].dropna()
    after = turns.loc[turns["finish_reason"] != "error", "tokens_after"]
    bins = 30 if len(before) + len(after) else 1
    ax.hist([before, after], bins=bins, label=["original", "regenerated"])
    ax.set(xlabel="tokens per response", ylabel="responses", title="Response lengths before and after")
    ax.legend()
    fig.tight_layout()
    fig.savefig(lengths_out)
    plt.close(fig)

    def total(key: str) -> int:
        return sum(s[key] for s in shards)

    reasons = pd.Series([s["reason"].split(":")[0] for shard in shards for s in shard["skipped_rows"]])
    rows = [
        ("conversations in", total("conversations_in")),
        ("regenerated", total("regenerated")),
        ("kept original", total("original")),
        ("skipped", total("skipped")),
        *((f"skipped: {reason}", n) for reason, n in reasons.value_counts().items()),
        ("turns generated / reused from a journal",
         f"{(turns['origin'] == 'generated').sum()} / {(turns['origin'] == 'reused').sum()}"),
        *((f"finish reason: {reason}", n) for reason, n in turns["finish_reason"].value_counts().items()),
        ("median tokens before / after",
         f"{before.median() if len(before) else '-'} / {after.median() if len(after) else '-'}"),
        ("tokens generated per second (per shard)",
         ", ".join(f"{s['tokens_per_second']:.1f}" for s in shards if s["tokens_per_second"])),
    ]
    table = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(str(v))}</td></tr>" for k, v in rows)
    with open(summary_out, "w") as f:
        f.write(f"<html><body><h2>Regeneration</h2><table>{table}</table></body></html>")
