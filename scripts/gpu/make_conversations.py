"""Write N conversations built from the demo set, most long enough to be cut at max_seq_len (GPU runs).

    python scripts/gpu/make_conversations.py data/demo/conversations.jsonl OUT.jsonl 48
"""

import json
import random
import sys
from pathlib import Path

from eagle3data.inputs.conversations import normalize_messages


def main(src: str, out: str, count: int) -> None:
    pairs = []
    with open(src) as f:
        for line in f:
            messages = [m for m in normalize_messages(json.loads(line)) if m["role"] != "system"]
            pairs += [(u["content"], a["content"]) for u, a in zip(messages[::2], messages[1::2])
                      if u["role"] == "user" and a["role"] == "assistant"]
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        for i in range(count):
            rng = random.Random(i)
            messages = [{"role": "system", "content": f"You are assistant {i}. Answer carefully."}]
            target = 1200 if i % 4 == 0 else 4000  # characters: every 4th stays under 512 tokens
            while sum(len(m["content"]) for m in messages) < target:
                user, assistant = rng.choice(pairs)
                messages += [{"role": "user", "content": f"{user} ({i}.{len(messages)})"},
                             {"role": "assistant", "content": assistant}]
            f.write(json.dumps({"id": f"gpu-{i}", "messages": messages}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
