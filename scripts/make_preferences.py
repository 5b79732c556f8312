"""Regenerate memrecipe's embedded preference set from the embedded chat data: each conversation's own answer is
`chosen`, a plausible wrong one `rejected` (another sum, another capital or color, another day, the words in
another order), in TRL's conversational preference format (prompt / chosen / rejected as message lists).

    python scripts/make_preferences.py      # reads cli/memrecipe/data/chat.jsonl, writes cli/memrecipe/data/preferences.jsonl
"""

import json
import random
import re
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "cli" / "memrecipe" / "data"


def wrong(question: str, answer: str, rng: random.Random, answers: list[str]) -> str:
    """A wrong answer of the same shape as the right one."""
    if m := re.fullmatch(r"(\d+) plus (\d+) is (\d+)\.", answer):
        a, b, total = map(int, m.groups())
        return f"{a} plus {b} is {total + rng.choice([-2, -1, 1, 2, 10])}."
    if question.startswith("Repeat after me: "):
        words = answer.split()
        while words == answer.split():
            rng.shuffle(words)
        return " ".join(words)
    same_shape = [a for a in answers if a.split()[:2] == answer.split()[:2] and a != answer]
    if same_shape:  # "The capital of X is Y." / "After X comes Y." / "X is <color>.": the last word of another
        return answer.rsplit(" ", 1)[0] + " " + rng.choice(same_shape).rsplit(" ", 1)[1]
    return rng.choice([a for a in answers if a != answer])


def main():
    rng = random.Random(0)
    rows = [json.loads(line) for line in open(DATA / "chat.jsonl")]
    answers = [r["messages"][-1]["content"] for r in rows]
    with open(DATA / "preferences.jsonl", "w") as f:
        for row in rows:
            *prompt, last = row["messages"]
            rejected = wrong(prompt[-1]["content"], last["content"], rng, answers)
            f.write(json.dumps({"prompt": prompt, "chosen": [last],
                                "rejected": [{"role": "assistant", "content": rejected}]}) + "\n")
    print(f"wrote {len(rows)} pairs to {DATA / 'preferences.jsonl'}")


if __name__ == "__main__":
    main()
