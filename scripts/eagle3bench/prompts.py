"""The prompts of figure 8 (acceptance): a varied single-turn prompt set, composed from lists in
data/acceptance/, with reference answers written here, not by the target.

Figure 8 asks whether a draft trained on this pipeline's data is accepted by the target. Its arm (a)
trains on answers that are NOT the target's own (as with any public chat set), so each prompt gets a
templated reference answer: correct where it can be computed (arithmetic, the code in
code_tasks.jsonl, the rewrites), generic prose otherwise. Families: explain, facts, summarize, why,
poem, compare, code, math, rewrite, advice. Held-out prompts (served for acceptance) are drawn from
the same families but never appear among the training prompts.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from eagle3data.utils.checkout import REPO

LISTS = REPO / "data" / "acceptance"


@dataclass(frozen=True)
class Prompt:
    family: str
    text: str
    answer: str


def _lines(name: str) -> list[str]:
    return [line.strip() for line in (LISTS / name).read_text().splitlines() if line.strip()]


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


_OPENERS = ["Sure.", "Good question.", "Here is a short answer.", "Happy to help.", "Of course."]
_GENERIC = [
    "{T} has a long history, and people have studied it from many angles.",
    "A simple way to picture {t} is to think about its parts and how they affect one another.",
    "Most of what makes {t} interesting comes from a few basic rules that repeat at every scale.",
    "Scientists, teachers and hobbyists all find something different to like about {t}.",
    "The details can get complicated, but the main idea of {t} fits in a sentence or two.",
    "Many everyday things depend on {t}, even when we do not notice it.",
    "If you want to learn more about {t}, a good library book or an encyclopedia is a fine start.",
]


def _prose(rng: random.Random, topic: str, n: int) -> str:
    return " ".join(s.format(t=topic, T=_cap(topic)) for s in rng.sample(_GENERIC, n))


def _topic_prompts(rng: random.Random, topics: list[str]) -> list[Prompt]:
    out = []
    for i, t in enumerate(topics):
        other = topics[(i * 7 + 3) % len(topics)]
        asks = {
            "explain": [f"Explain {t} in simple terms.", f"What is {t}?", f"Describe {t} to a ten-year-old."],
            "facts": [f"Give me three facts about {t}.", f"List three interesting things about {t}."],
            "summarize": [f"Summarize what {t} is in two sentences."],
            "why": [f"Why is {t} important?"],
            "poem": [f"Write a short poem about {t}."],
            "compare": [f"What is the difference between {t} and {other}?"],
        }
        for family, texts in asks.items():
            for text in texts:
                if family == "facts":
                    facts = [s.format(t=t, T=_cap(t)) for s in rng.sample(_GENERIC, 3)]
                    answer = "Here are three facts:\n" + "\n".join(f"{k}. {f}" for k, f in enumerate(facts, 1))
                elif family == "poem":
                    answer = (f"Quiet lines on {t}:\n\nIn morning light I think of {t},\n"
                              f"a small idea that grows and grows;\nwe learn a little every day,\n"
                              f"and still there's more than someone knows.")
                elif family == "compare":
                    answer = (f"{_cap(t)} and {other} are different subjects. {_prose(rng, t, 1)} "
                              f"{_prose(rng, other, 1)} In short: they answer different questions.")
                elif family == "summarize":
                    answer = _prose(rng, t, 2)
                else:
                    answer = f"{rng.choice(_OPENERS)} {_prose(rng, t, 3)}"
                out.append(Prompt(family, text, answer))
    return out


def _code_prompts() -> list[Prompt]:
    out = []
    for line in _lines("code_tasks.jsonl"):
        item = json.loads(line)
        answer = f"Here is a Python function that {item['task']}:\n\n```python\n{item['code']}\n```"
        for text in (f"Write a Python function that {item['task']}.",
                     f"Show me Python code that {item['task']}."):
            out.append(Prompt("code", text, answer))
    return out


def _math_prompts(rng: random.Random, n: int) -> list[Prompt]:
    out, seen = [], set()
    while len(out) < n:
        a, b = rng.randint(12, 99), rng.randint(2, 11)
        kind = rng.choice(["plus", "times", "minus", "apples"])
        if (a, b, kind) in seen:
            continue
        seen.add((a, b, kind))
        if kind == "plus":
            out.append(Prompt("math", f"What is {a} plus {b}?", f"{a} + {b} = {a + b}."))
        elif kind == "times":
            out.append(Prompt("math", f"What is {a} times {b}?", f"{a} × {b} = {a * b}."))
        elif kind == "minus":
            out.append(Prompt("math", f"What is {a} minus {b}?", f"{a} − {b} = {a - b}."))
        else:
            out.append(Prompt("math", f"I have {a} apples and give away {b}. How many are left?",
                              f"You have {a} − {b} = {a - b} apples left."))
    return out


def _rewrite_prompts(sentences: list[str]) -> list[Prompt]:
    out = []
    for s in sentences:
        out.append(Prompt("rewrite", f"Rewrite this sentence in a formal tone: {s}",
                          f"A more formal version: \"{_cap(s.rstrip('.!?'))}.\""))
        out.append(Prompt("rewrite", f"Make this sentence shorter: {s}",
                          f"Shorter: \"{' '.join(s.split()[:8]).rstrip(',.')}.\""))
    return out


def _advice_prompts(rng: random.Random, activities: list[str]) -> list[Prompt]:
    tips = ["Start small and keep a steady routine.", "Set one clear goal for each week.",
            "Write down what worked and what did not.", "Ask someone with experience for feedback.",
            "Be patient: progress is slow at first.", "Plan ahead and remove distractions."]
    out = []
    for a in activities:
        for text in (f"Give me some tips for {a}.", f"How can I get better at {a}?"):
            chosen = rng.sample(tips, 3)
            out.append(Prompt("advice", text, f"Some tips for {a}:\n" + "\n".join(f"- {c}" for c in chosen)))
    return out


def all_prompts(seed: int = 0) -> list[Prompt]:
    """Every prompt once, in a fixed shuffled order (same seed, same order)."""
    rng = random.Random(seed)
    prompts = (_topic_prompts(rng, _lines("topics.txt")) + _code_prompts() + _math_prompts(rng, 120)
               + _rewrite_prompts(_lines("sentences.txt")) + _advice_prompts(rng, _lines("activities.txt")))
    by_text = {p.text: p for p in prompts}  # one answer per distinct prompt
    ordered = sorted(by_text.values(), key=lambda p: p.text)
    rng.shuffle(ordered)
    return ordered


def split(n_train: int, n_heldout: int, seed: int = 0) -> tuple[list[Prompt], list[Prompt]]:
    """Training and held-out prompts, disjoint: the held-out ones are the first `n_heldout` of the
    shuffled set, the training ones the next `n_train`."""
    prompts = all_prompts(seed)
    if n_train + n_heldout > len(prompts):
        raise ValueError(f"only {len(prompts)} distinct prompts; asked for {n_train} + {n_heldout}")
    heldout, train = prompts[:n_heldout], prompts[n_heldout:n_heldout + n_train]
    assert not {p.text for p in heldout} & {p.text for p in train}
    return train, heldout


def conversations(prompts: list[Prompt], answers: list[str] | None = None) -> list[dict]:
    """OpenAI-form rows: each prompt with its reference answer, or with `answers` (the target's)."""
    answers = answers if answers is not None else [p.answer for p in prompts]
    return [{"messages": [{"role": "user", "content": p.text}, {"role": "assistant", "content": a}]}
            for p, a in zip(prompts, answers, strict=True)]
