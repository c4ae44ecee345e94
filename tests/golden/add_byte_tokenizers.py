#!/usr/bin/env python3
"""Gives every tiny golden model (vocab 256) a byte-level tokenizer, so that text prompts work on
them: a Hugging Face `tokenizer.json` whose 256 tokens are the 256 bytes in GPT-2's byte-to-unicode
alphabet (id = byte value, no merges, no special tokens). Records, per model, the ids the
`tokenizers` library gives for a few strings in `tokenizer_reference.json`.

    python3 tests/golden/add_byte_tokenizers.py        # needs: pip install tokenizers
"""
import json
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

HERE = os.path.dirname(os.path.abspath(__file__))
STRINGS = ["hello", "Once upon a time", "héllo wörld", "日本", "a  b\n", ""]


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def main():
    alphabet = bytes_to_unicode()
    vocab = {alphabet[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    models_dir = os.path.join(HERE, "models")
    for name in sorted(os.listdir(models_dir)):
        d = os.path.join(models_dir, name)
        tok.save(os.path.join(d, "tokenizer.json"))
        ref = {"generator": "tests/golden/add_byte_tokenizers.py",
               "cases": [{"text": s, "ids": tok.encode(s).ids} for s in STRINGS]}
        for case in ref["cases"]:
            assert tok.decode(case["ids"]) == case["text"]
        with open(os.path.join(d, "tokenizer_reference.json"), "w") as f:
            json.dump(ref, f, indent=1, ensure_ascii=False)
            f.write("\n")


if __name__ == "__main__":
    main()
