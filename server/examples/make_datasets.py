"""Build the example datasets (french, pirate, json) from the hand-written Q&A tables in data/.

    python server/examples/make_datasets.py

qa_source.txt rows are `question | short answer | English sentence | French sentence`;
qa_source_fr.txt rows are `question in another language | French sentence` (french only).
Writes data/{french,pirate,json}.jsonl, one {"prompt": ..., "response": ...} per line.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"
SEED = 0

# pirate speech: word swaps, dropped g's, an opener and an optional closer
PIRATE_WORDS = {
    "you": "ye",
    "your": "yer",
    "yours": "yers",
    "is": "be",
    "are": "be",
    "am": "be",
    "my": "me",
    "yes": "aye",
    "hello": "ahoy",
    "hi": "ahoy",
    "friend": "matey",
    "friends": "hearties",
    "very": "mighty",
    "money": "doubloons",
    "there": "thar",
    "for": "fer",
    "stop": "avast",
    "goodbye": "fair winds",
    "and": "an'",
    "of": "o'",
}
KEEP_ING = {"string", "spring"}
PIRATE_OPENERS = ["Arr, matey!"] * 4 + ["Ahoy, matey!", "Arr!", "Yo ho ho, matey!", "Shiver me timbers, matey!"]
PIRATE_CLOSERS = [""] * 3 + ["Savvy?", "Arr!", "Yo ho ho!", "So says the captain!"]


def read_table(path: Path, num_fields: int) -> list[list[str]]:
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        fields = [f.strip() for f in line.split(" | ")]
        if len(fields) != num_fields:
            raise ValueError(f"{path.name}: expected {num_fields} fields in {line!r}")
        rows.append(fields)
    return rows


def _pirate_word(match: re.Match) -> str:
    word = match.group(0)
    lower = word.lower()
    new = PIRATE_WORDS.get(lower)
    if new is None and len(lower) >= 6 and lower.endswith("ing") and lower not in KEEP_ING:
        new = lower[:-1] + "'"
    if new is None:
        return word
    return new[0].upper() + new[1:] if word[0].isupper() else new


def to_pirate(sentence: str, rng: random.Random) -> str:
    body = re.sub(r"[A-Za-z]+", _pirate_word, sentence)
    closer = rng.choice(PIRATE_CLOSERS)
    return " ".join(part for part in (rng.choice(PIRATE_OPENERS), body, closer) if part)


def build(rows: list[list[str]], extra_fr: list[list[str]]) -> dict[str, list[dict[str, str]]]:
    rng = random.Random(SEED)
    french = [{"prompt": q, "response": fr} for q, _, _, fr in rows]
    french += [{"prompt": q, "response": fr} for q, fr in extra_fr]
    pirate = [{"prompt": q, "response": to_pirate(en, rng)} for q, _, en, _ in rows]
    as_json = [{"prompt": q, "response": json.dumps({"answer": short}, ensure_ascii=False)} for q, short, _, _ in rows]
    return {"french": french, "pirate": pirate, "json": as_json}


def write_jsonl(path: Path, examples: list[dict[str, str]]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for ex in examples:
            f.write(json.dumps(ex, ensure_ascii=False) + "\n")


def main() -> None:
    rows = read_table(DATA_DIR / "qa_source.txt", 4)
    extra_fr = read_table(DATA_DIR / "qa_source_fr.txt", 2)
    for name, examples in build(rows, extra_fr).items():
        write_jsonl(DATA_DIR / f"{name}.jsonl", examples)
        print(f"{name}: {len(examples)} examples -> {DATA_DIR / name}.jsonl")


if __name__ == "__main__":
    main()
