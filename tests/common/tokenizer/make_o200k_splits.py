#!/usr/bin/env python3
"""Records how the pre-tokenizer pattern of GPT-OSS's tokenizer (o200k's: letter runs split at case
changes, contractions, digits in threes, punctuation runs with a trailing slash or newline) splits
a set of texts, by Python's `regex` module (an independent Unicode regex engine), into
o200k_splits.json next to this file. tokenizer_internal_test.cc compares the tokenizer's PCRE2
regex against it.

    python3 -m venv /tmp/rv && /tmp/rv/bin/pip install regex && /tmp/rv/bin/python tests/common/tokenizer/make_o200k_splits.py
"""
import json
import os

import regex

PATTERN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
           r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

TEXTS = ["Hello World", "HelloWorld CamelCASEWord iPhone", "don't I'M they'LL we've", "12345 1,234.56",
         "日本語のテキスト", "emoji 👍🏽 done", "cafe\u0301 naïve", "line1\nline2\r\n\n  indented",
         "/usr/bin/env python3\n", "   spaces   ", "Ünïcödé ✓ <|start|>", "x  \n\ty", "ǅungla Σίσυφος",
         "ABC's DEF'S", "<|channel|>analysis<|message|>We need 3 tools.\n\n"]


def main():
    cases = [{"text": t, "splits": [m.group(0) for m in regex.finditer(PATTERN, t)]} for t in TEXTS]
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "o200k_splits.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"generator": "make_o200k_splits.py", "regex": regex.__version__, "pattern": PATTERN,
                   "cases": cases}, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {len(cases)} cases to {path}")


if __name__ == "__main__":
    main()
