#!/usr/bin/env python3
"""Record Hugging Face transformers reference outputs for the trained stories260K model.

Run from the repository root:

    python3 tests/golden/make_stories_reference.py [MODEL_DIR] [-o OUTPUT]

MODEL_DIR defaults to ../shared/models/stories260K relative to the repository
root (the model is read from there and never copied into the repository); the
output defaults to tests/golden/stories260K_reference.json.

Cases: BOS only ([1]) with 64 greedy tokens, and a few text prompts (tokenized by
the model's own tokenizer, BOS included) with 48 greedy tokens each.  Greedy
decoding runs for the full length (this model never emits EOS; it ends a story
with BOS, and the decoding does not stop there either).  For each case:
prompt_text (null for BOS only), prompt_ids, greedy_ids (generated tokens only),
text = tokenizer.decode(prompt_ids + greedy_ids, skip_special_tokens=True),
last_logits = logits at the last prompt position (vocab 512 floats), and
min_greedy_margin = smallest top1 - top2 logit gap over the greedy steps.
Computed in float32 with eager attention on CPU.
"""

import argparse
import hashlib
import json
import os

import numpy as np
import torch
import transformers
from transformers import AutoTokenizer, LlamaForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(HERE))
DEFAULT_MODEL_DIR = os.path.join(REPO_ROOT, "..", "shared", "models", "stories260K")
DEFAULT_OUTPUT = os.path.join(HERE, "stories260K_reference.json")
GENERATOR = "tests/golden/make_stories_reference.py"

BOS_ONLY_TOKENS = 64
TEXT_TOKENS = 48
TEXT_PROMPTS = [
    "Once upon a time",
    "Lily and Tom went to the park",
    "The cat",
    "One day, a little girl named Lily found a needle in her room.",
]
GREEDY_REL_MARGIN = 1e-3


def f32(x):
    return float(str(np.float32(x)))


@torch.no_grad()
def greedy(model, prompt_ids, n):
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    out = model(ids, use_cache=True)
    last_logits = out.logits[0, -1].float()
    nocache = model(ids, use_cache=False).logits[0, -1].float()
    assert torch.allclose(last_logits, nocache, rtol=1e-5, atol=1e-5)
    past, row = out.past_key_values, last_logits
    gen, gaps, rel = [], [], []
    for step in range(n):
        top2 = torch.topk(row, 2).values
        gaps.append((top2[0] - top2[1]).item())
        rel.append(gaps[-1] / row.abs().max().item())
        tok = int(torch.argmax(row))
        gen.append(tok)
        if step + 1 == n:
            break
        out = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
        past, row = out.past_key_values, out.logits[0, -1].float()
    # cache-free recompute must give the same tokens
    full = model(torch.tensor([list(prompt_ids) + gen[:-1]]), use_cache=False).logits[0].float()
    L = len(prompt_ids)
    for step in range(n):
        r = full[L - 1 + step]
        assert int(torch.argmax(r)) == gen[step], "cached and cache-free greedy differ"
        top2 = torch.topk(r, 2).values
        gaps.append((top2[0] - top2[1]).item())
        rel.append(gaps[-1] / r.abs().max().item())
    return last_logits, gen, min(gaps), min(rel)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model_dir", nargs="?", default=DEFAULT_MODEL_DIR)
    ap.add_argument("-o", "--output", default=DEFAULT_OUTPUT)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()

    model_dir = os.path.normpath(args.model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with open(os.path.join(model_dir, "model.safetensors"), "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()

    prompts = [(None, [tok.bos_token_id], BOS_ONLY_TOKENS)]
    for text in TEXT_PROMPTS:
        ids = tok(text)["input_ids"]
        assert ids[0] == tok.bos_token_id
        prompts.append((text, ids, TEXT_TOKENS))

    cases = []
    for text, ids, n in prompts:
        last_logits, gen, gap, rel = greedy(model, ids, n)
        if rel <= GREEDY_REL_MARGIN:
            print(f"WARNING: near-tie in greedy decoding for {text!r}: relative margin {rel:.3g}")
        decoded = tok.decode(ids + gen, skip_special_tokens=True)
        cases.append(
            {
                "prompt_text": text,
                "prompt_ids": ids,
                "greedy_ids": gen,
                "text": decoded,
                "last_logits": [f32(x) for x in last_logits.tolist()],
                "min_greedy_margin": f32(gap),
            }
        )
        print(f"{text!r}: {len(ids)} prompt tokens, min gap {gap:.4g} (rel {rel:.3g})\n  {decoded!r}")

    ref = {
        "model": "stories260K",
        "architecture": "LlamaForCausalLM",
        "generator": GENERATOR,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "model_safetensors_sha256": sha,
        "cases": cases,
    }
    enc = lambda v: json.dumps(v, ensure_ascii=False, separators=(", ", ": "))  # noqa: E731
    lines = ["{"]
    for k, v in ref.items():
        if k != "cases":
            lines.append(f"  {enc(k)}: {enc(v)},")
    lines.append('  "cases": [')
    for ci, case in enumerate(cases):
        body = ",\n".join(f"      {enc(k)}: {enc(v)}" for k, v in case.items())
        lines.append("    {\n" + body + "\n    }" + ("," if ci + 1 < len(cases) else ""))
    lines.append("  ]")
    lines.append("}")
    with open(args.output, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
