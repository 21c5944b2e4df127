"""Synthetic token prompts written as a tokenized shard, for the engine checks and benchmarks."""

from __future__ import annotations

import random

import pandas as pd

from eagle3data.contracts.schemas import TokenizedShard, check
from eagle3data.storage.store import atomic_path


def random_prompts(count: int, tokens: int, vocab: int, seed: int = 0, vary: bool = False) -> dict:
    """{sample_id: token ids}: `count` prompts of `tokens` ids (or 1/4..1 of it with `vary`)."""
    rng = random.Random(seed)
    prompts = {}
    for i in range(count):
        length = rng.randint(max(tokens // 4, 1), tokens) if vary else tokens
        prompts[f"synthetic-{seed:04d}-{i:08d}"] = [rng.randrange(10, vocab) for _ in range(length)]
    return prompts


def write_token_shard(path: str, prompts: dict) -> None:
    """A tokenized shard (TokenizedShard schema) whose samples are `prompts`, every token trainable."""
    rows = [
        {"sample_id": sid, "source_row": i, "source_id": "", "input_ids": ids, "loss_mask": [1] * len(ids),
         "num_tokens": len(ids), "num_trainable": len(ids), "truncated": False,
         "matches_full_tokenization": True}
        for i, (sid, ids) in enumerate(prompts.items())
    ]
    frame = check(TokenizedShard, pd.DataFrame(rows), f"synthetic shard {path}")
    with atomic_path(path) as tmp:
        frame.to_parquet(tmp, index=False)
