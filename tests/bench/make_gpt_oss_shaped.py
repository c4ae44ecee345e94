#!/usr/bin/env python3
"""Writes a GPT-OSS checkpoint with gpt-oss-20b's layer shapes (hidden 2880, 64 query heads and 8
KV heads of 64, 32 experts of width 2880, top-4) but few layers and a small vocabulary, twice:

  OUT/mxfp4  its experts MXFP4 as gpt-oss is released (U8 `_blocks` and `_scales`);
  OUT/bf16   the same weights with the experts dequantized to bf16 (exact) in transformers' layout.

For shardserve-bench-decode (`--model=OUT/mxfp4`, then `--model=OUT/bf16`): the same model with its
experts kept as MXFP4 or as bf16, for decode speed, load time and weight bytes. Random weights (the
outputs mean nothing); the MXFP4 scales are 2^-6 .. 2^-4, like the released experts'.

Usage: make_gpt_oss_shaped.py OUT [--layers 1] [--vocab 4096] [--seed 0]. Needs numpy only.
"""
import argparse
import json
import os
import struct

import numpy as np

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, WIDTH, TOP_K = 2880, 64, 8, 64, 32, 2880, 4
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


def bf16_bytes(a):
    """float32 array -> bf16 bytes, round to nearest even."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16).tobytes()


def write_safetensors(path, tensors):
    """tensors: list of (name, dtype string, shape, bytes)."""
    header, offset = {}, 0
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, _, _, data in tensors:
            f.write(data)


def mxfp4_matrix(rng, experts, rows, cols):
    """Random [experts, rows, cols] MXFP4: (blocks bytes, scales bytes, dequantized f32)."""
    codes = rng.integers(0, 16, size=(experts, rows, cols), dtype=np.uint8)
    scales = rng.integers(121, 124, size=(experts, rows, cols // 32), dtype=np.uint8)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    values = E2M1[codes] * np.exp2(np.repeat(scales, 32, axis=-1).astype(np.float32) - 127)
    return blocks.tobytes(), scales.tobytes(), values


def config(layers, vocab, mxfp4):
    c = {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
        "hidden_size": HIDDEN, "intermediate_size": WIDTH, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "num_hidden_layers": layers,
        "num_local_experts": EXPERTS, "num_experts_per_tok": TOP_K, "vocab_size": vocab,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "sliding_window": 128,
        "layer_types": ["sliding_attention" if l % 2 == 0 else "full_attention" for l in range(layers)],
        "rope_theta": 150000.0,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "original_max_position_embeddings": 4096, "truncate": False},
        "swiglu_limit": 7.0, "tie_word_embeddings": False, "dtype": "bfloat16", "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if mxfp4:
        c["quantization_config"] = {
            "quant_method": "mxfp4",
            "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                       "model.embed_tokens", "lm_head"],
        }
    return c


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)

    def normal(*shape, std=0.02):
        return rng.standard_normal(shape, dtype=np.float32) * std

    common, mx, bf = [], [], []

    def add(name, a):
        common.append((name, "BF16", a.shape, bf16_bytes(a)))

    add("model.embed_tokens.weight", normal(args.vocab, HIDDEN))
    add("lm_head.weight", normal(args.vocab, HIDDEN))
    add("model.norm.weight", np.ones(HIDDEN, np.float32))
    for l in range(args.layers):
        p = f"model.layers.{l}."
        add(p + "input_layernorm.weight", np.ones(HIDDEN, np.float32))
        add(p + "post_attention_layernorm.weight", np.ones(HIDDEN, np.float32))
        for name, rows in (("q", HEADS * HEAD_DIM), ("k", KV_HEADS * HEAD_DIM), ("v", KV_HEADS * HEAD_DIM)):
            add(p + f"self_attn.{name}_proj.weight", normal(rows, HIDDEN))
            add(p + f"self_attn.{name}_proj.bias", normal(rows))
        add(p + "self_attn.o_proj.weight", normal(HIDDEN, HEADS * HEAD_DIM))
        add(p + "self_attn.o_proj.bias", normal(HIDDEN))
        add(p + "self_attn.sinks", normal(HEADS, std=1.0))
        add(p + "mlp.router.weight", normal(EXPERTS, HIDDEN))
        add(p + "mlp.router.bias", normal(EXPERTS))
        add(p + "mlp.experts.gate_up_proj_bias", normal(EXPERTS, 2 * WIDTH))
        add(p + "mlp.experts.down_proj_bias", normal(EXPERTS, HIDDEN))
        e = p + "mlp.experts."
        gu_blocks, gu_scales, gu = mxfp4_matrix(rng, EXPERTS, 2 * WIDTH, HIDDEN)
        mx.append((e + "gate_up_proj_blocks", "U8", (EXPERTS, 2 * WIDTH, HIDDEN // 32, 16), gu_blocks))
        mx.append((e + "gate_up_proj_scales", "U8", (EXPERTS, 2 * WIDTH, HIDDEN // 32), gu_scales))
        # transformers' layout: [experts, hidden, 2 x width] and [experts, width, hidden].
        bf.append((e + "gate_up_proj", "BF16", (EXPERTS, HIDDEN, 2 * WIDTH), bf16_bytes(gu.transpose(0, 2, 1))))
        del gu
        dn_blocks, dn_scales, dn = mxfp4_matrix(rng, EXPERTS, HIDDEN, WIDTH)
        mx.append((e + "down_proj_blocks", "U8", (EXPERTS, HIDDEN, WIDTH // 32, 16), dn_blocks))
        mx.append((e + "down_proj_scales", "U8", (EXPERTS, HIDDEN, WIDTH // 32), dn_scales))
        bf.append((e + "down_proj", "BF16", (EXPERTS, WIDTH, HIDDEN), bf16_bytes(dn.transpose(0, 2, 1))))
        del dn
    for kind, extra in (("mxfp4", mx), ("bf16", bf)):
        d = os.path.join(args.out, kind)
        os.makedirs(d, exist_ok=True)
        write_safetensors(os.path.join(d, "model.safetensors"), common + extra)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(config(args.layers, args.vocab, kind == "mxfp4"), f, indent=1)
        print("wrote", d)


if __name__ == "__main__":
    main()
