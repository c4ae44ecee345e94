#!/usr/bin/env python3
"""`shardserve plan` on the config.json of real large models (no weights): the MoE models
(DeepSeek-V3 and V2-Lite, Qwen3, Llama-4, GLM-4.5) and Gemma-3 27B (a multimodal config served as its
language model). The placement on 8-GPU nodes and the KV capacity from each architecture's real
per-token KV size.

    python3 tests/sdk/cli_plan_real_models_test.py build/bin
"""
import json
import os
import subprocess
import sys
import tempfile

BIN = os.path.join(sys.argv[1], "shardserve")
DEEPSEEK = "tests/sim/models/deepseek-v3-671b"
QWEN3 = "tests/sim/models/qwen3-235b-a22b"
MAVERICK = "tests/sim/models/llama4-maverick-400b"
SCOUT = "tests/sim/models/llama4-scout-109b"
GEMMA3 = "tests/sim/models/gemma-3-27b-it"
DEEPSEEK_V2_LITE = "tests/sim/models/deepseek-v2-lite"
GLM45 = "tests/sim/models/glm-4.5-355b"
TWO_NODES = "a=cuda:8x80GiB,b=cuda:8x80GiB"


def run(*args, ok=True):
    p = subprocess.run([BIN, "plan", *args], capture_output=True, text=True, timeout=120)
    if ok and p.returncode != 0:
        sys.exit(f"shardserve plan {' '.join(args)} failed ({p.returncode}): {p.stderr}")
    if not ok and p.returncode == 0:
        sys.exit(f"shardserve plan {' '.join(args)} should have failed:\n{p.stdout}")
    return p


def check_stages(j, per_token_layer_bytes):
    """Every stage fits, and its KV bytes are its KV tokens x the architecture's bytes per token."""
    assert j["error"] is None, j["error"]
    chosen = [l for l in j["explain"]["layouts"] if l["verdict"] == "chosen"]
    assert len(chosen) == 1, j["explain"]["layouts"]
    for s in chosen[0]["stages"]:
        assert s["fits"] and s["weight_bytes_per_rank"] + s["kv_bytes_per_rank"] <= s["free_bytes_per_rank"], s
        assert s["kv_tokens"] >= j["explain"]["min_kv_tokens"], s
    for r in j["plan"]["replicas"]:
        for s in r["stages"]:
            layers = s["layer_end"] - s["layer_begin"]
            assert s["kv_tokens"] > 0, s
            assert s["kv_bytes_per_rank"] == s["kv_tokens"] * layers * per_token_layer_bytes, (s, per_token_layer_bytes)
    return chosen[0]


def main():
    # Qwen3-235B-A22B (bf16, 94 layers, 4 KV heads of 128): tp=8 replicates the KV heads, one per
    # rank: 2 x 128 values x 2 bytes per token and layer. Each node holds the whole model: two replicas.
    text = run("--model", QWEN3, "--workers", TWO_NODES).stdout
    assert text.startswith("plan: 2 replicas x 1 stage, max_seq_len 40960"), text
    j = json.loads(run("--model", QWEN3, "--workers", TWO_NODES, "--json").stdout)
    check_stages(j, 2 * 128 * 2)
    assert all(s["kv_tokens"] > 400_000 for r in j["plan"]["replicas"] for s in r["stages"]), j["plan"]

    # DeepSeek-V3 (671B, FP8: CUDA workers keep the F8_E4M3 matrices as 1-byte codes + their
    # 128 x 128 scale blocks, 676 GB) does not fit one 8 x 80 GiB node together with one
    # 163840-token sequence of KV: a clear error, not a wrong plan.
    p = run("--model", DEEPSEEK, "--workers", "a=cuda:8x80GiB", ok=False)
    assert "RESOURCE_EXHAUSTED" in p.stderr and "675.8 GB weights" in p.stderr, p.stderr
    # MLA's KV per token and layer is the latent + the RoPE key, (512 + 64) x 2 bytes on every rank
    # (not 128 heads x (192 + 128)): 12.8 GB for that sequence over 61 layers at kv_fraction 0.9.
    assert "12.8 GB for the KV of 1 sequence of 163840 tokens" in p.stderr, p.stderr
    mla_token_layer = (512 + 64) * 2
    # Two such nodes hold it with the full context, in a two-stage pipeline, without spill.
    j = json.loads(run("--model", DEEPSEEK, "--workers", TWO_NODES, "--json").stdout)
    chosen = check_stages(j, mla_token_layer)
    assert not chosen["expert_spill"] and chosen["pp"] == 2, chosen
    assert all(s["kv_tokens"] >= 163840 for s in j["plan"]["replicas"][0]["stages"]), j["plan"]
    # One stage on an 8 x 80 GiB node (pp fixed to 1) with 4096-token sequences: the experts it has
    # no room for go to a smaller node as an expert host.
    small = "a=cuda:8x80GiB,b=cuda:8x24GiB"
    j = json.loads(run("--model", DEEPSEEK, "--workers", small, "--max_seq_len=4096", "--pp=1", "--json").stdout)
    chosen = check_stages(j, mla_token_layer)
    assert chosen["expert_spill"] and chosen["pp"] == 1, chosen
    (stage,) = j["plan"]["replicas"][0]["stages"]
    assert (stage["worker_id"], stage["tp"], stage["layer_begin"], stage["layer_end"]) == ("a", 8, 0, 61), stage
    assert stage["kv_tokens"] >= 4096, stage
    text = run("--model", DEEPSEEK, "--workers", small, "--max_seq_len=4096", "--pp=1").stdout
    assert "remote experts" in text and "expert hosts:" in text, text
    # On one 8 x 141 GiB node (H200) the full context fits in one stage.
    j = json.loads(run("--model", DEEPSEEK, "--workers", "a=cuda:8x141GiB", "--json").stdout)
    chosen = check_stages(j, mla_token_layer)
    assert not chosen["expert_spill"] and chosen["pp"] == 1, chosen
    assert all(s["kv_tokens"] >= 163840 for s in j["plan"]["replicas"][0]["stages"]), j["plan"]

    # Llama-4-Maverick (Llama4ForConditionalGeneration, bf16, 48 layers, every other one MoE with
    # 128 experts and a shared expert): about 800 GB, so two tp=8 stages, one per node, with every
    # expert local. 8 KV heads of 128 over 8 ranks: one per rank, 2 x 128 values x 2 bytes per token
    # and layer, on chunked layers too (the engine keeps their whole context); the full 1M-token
    # context fits.
    text = run("--model", MAVERICK, "--workers", TWO_NODES).stdout
    assert text.startswith("plan: 1 replica x 2 stages, max_seq_len 1048576"), text
    j = json.loads(run("--model", MAVERICK, "--workers", TWO_NODES, "--json").stdout)
    chosen = check_stages(j, 2 * 128 * 2)
    assert not chosen["expert_spill"] and chosen["pp"] == 2, chosen
    stages = j["plan"]["replicas"][0]["stages"]
    assert [(s["worker_id"], s["tp"], s["layer_begin"], s["layer_end"]) for s in stages] == [
        ("a", 8, 0, 24), ("b", 8, 24, 48)], stages
    assert all(s["kv_tokens"] >= 1048576 for s in stages), stages
    # Llama-4-Scout (109B, every layer MoE with 16 experts): one node holds it at tp=8, so two
    # replicas, each with KV for its 262144-token context.
    text = run("--model", SCOUT, "--workers", TWO_NODES).stdout
    assert text.startswith("plan: 2 replicas x 1 stage, max_seq_len 262144"), text
    j = json.loads(run("--model", SCOUT, "--workers", TWO_NODES, "--json").stdout)
    check_stages(j, 2 * 128 * 2)
    assert all(s["kv_tokens"] >= 262144 and s["tp"] == 8 for r in j["plan"]["replicas"] for s in r["stages"]), j
    # A Llama-4 field value the engine does not implement is refused at plan time, naming it.
    with open(os.path.join(MAVERICK, "config.json")) as f:
        config = json.load(f)
    config["text_config"]["layer_types"] = ["sliding_attention"] * 48
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(config, f)
        p = run("--model", d, "--workers", TWO_NODES, ok=False)
        assert "text_config: field \"layer_types\" has \"sliding_attention\"" in p.stderr, p.stderr
    check_gemma3()
    check_deepseek_v2_lite()
    check_glm45()
    print("ok")


def check_gemma3():
    # gemma-3-27b-it (Gemma3ForConditionalGeneration; its text_config: bf16, 62 layers, 32 heads and
    # 16 KV heads of 128, MLP 21504, vocab 262208 and context 131072 from Gemma3TextConfig's
    # defaults). 54 GB of weights: each node holds a replica at tp=8.
    text = run("--model", GEMMA3, "--workers", TWO_NODES).stdout
    assert text.startswith("plan: 2 replicas x 1 stage, max_seq_len 131072"), text
    j = json.loads(run("--model", GEMMA3, "--workers", TWO_NODES, "--json").stdout)
    # 2 KV heads per rank: 2 x 128 values of K and V, bf16, per token and layer.
    chosen = check_stages(j, 2 * 2 * 128 * 2)
    assert chosen["pp"] == 1, chosen
    h, q, kv, ff, vocab, tp = 5376, 32 * 128, 16 * 128, 21504, 262208, 8
    # Per rank: its eighth of every bf16 matrix, the f32 norms (four per layer, q/k norms, final)
    # whole, the whole embedding and an eighth of the (tied) lm_head's rows.
    layer = (h * q + 2 * h * kv + q * h + 3 * h * ff) * 2 // tp + (4 * h + 2 * 128) * 4
    weights = 62 * layer + vocab * h * 2 + -(-vocab // tp) * h * 2 + h * 4
    for r in j["plan"]["replicas"]:
        (stage,) = r["stages"]
        assert (stage["tp"], stage["layer_begin"], stage["layer_end"]) == (8, 0, 62), stage
        assert stage["weight_bytes_per_rank"] == weights, (stage, weights)
        assert stage["kv_tokens"] >= 131072, stage
    # A field value the engine does not implement is refused by the plan, naming it.
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(GEMMA3, "config.json")) as f:
            config = json.load(f)
        config["text_config"]["rope_scaling"] = {"rope_type": "yarn", "factor": 8.0}
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(config, f)
        p = run("--model", d, "--workers", TWO_NODES, ok=False)
        assert "UNIMPLEMENTED" in p.stderr and "text_config (full_attention layers)" in p.stderr, p.stderr


def check_deepseek_v2_lite():
    # DeepSeek-V2-Lite (DeepseekV2ForCausalLM, bf16, 27 layers: layer 0 dense (10944), 26 MoE with
    # 64 experts of 1408 and 2 shared; 16 heads of MLA without query compression, kv_lora_rank 512,
    # RoPE 64): 31 GB, on one 8 x 80 GiB node at tp=8 with the experts spread, 8 per rank.
    one_node = "a=cuda:8x80GiB"
    text = run("--model", DEEPSEEK_V2_LITE, "--workers", one_node).stdout
    assert text.startswith("plan: 1 replica x 1 stage, max_seq_len 163840"), text
    j = json.loads(run("--model", DEEPSEEK_V2_LITE, "--workers", one_node, "--json").stdout)
    # MLA's KV: the latent and the RoPE key, (512 + 64) x 2 bytes per token and layer on every rank.
    chosen = check_stages(j, (512 + 64) * 2)
    assert chosen["pp"] == 1 and not chosen["expert_spill"], chosen
    h, tp, vocab, heads = 2048, 8, 102400, 16 // 8
    # Per rank: the norms (f32) and kv_a_proj_with_mqa whole; q_proj (192 rows per head), kv_b_proj
    # ((128 + 128) x 512 per head) and o_proj's columns of its 2 heads; an eighth of the dense MLP
    # and of the shared experts; the f32 router whole; 8 of the 64 experts; the whole embedding and
    # an eighth of lm_head's rows.
    attn = 2 * h * 4 + heads * 192 * h * 2 + (512 + 64) * h * 2 + 512 * 4 + heads * 256 * 512 * 2 + h * heads * 128 * 2
    dense = 3 * h * (10944 // tp) * 2
    sparse = 64 * h * 4 + 3 * (2 * 1408 // tp) * h * 2 + (64 // tp) * 3 * 1408 * h * 2
    weights = 27 * attn + dense + 26 * sparse + vocab * h * 2 + vocab // tp * h * 2 + h * 4
    (stage,) = j["plan"]["replicas"][0]["stages"]
    assert (stage["tp"], stage["layer_begin"], stage["layer_end"]) == (8, 0, 27), stage
    assert stage["weight_bytes_per_rank"] == weights, (stage, weights)
    assert stage["kv_tokens"] >= 163840, stage
    # V3's routing fields on a V2 config are refused at plan time, naming the field.
    with open(os.path.join(DEEPSEEK_V2_LITE, "config.json")) as f:
        config = json.load(f)
    for field, value in [("topk_method", "noaux_tc"), ("scoring_func", "sigmoid"), ("norm_topk_prob", True)]:
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "config.json"), "w") as f:
                json.dump(dict(config, **{field: value}), f)
            p = run("--model", d, "--workers", one_node, ok=False)
            assert "UNIMPLEMENTED" in p.stderr and f"field \"{field}\" is" in p.stderr, p.stderr


def check_glm45():
    # GLM-4.5 (Glm4MoeForCausalLM, bf16, 92 layers: 3 dense (12288), 89 MoE with 160 experts of 1536
    # and a shared one; 96 heads and 8 KV heads of 128): 706 GB of weights, more than one 8 x 80 GiB
    # node, so two tp=8 stages, one per node, every expert local. One KV head per rank: 2 x 128
    # values x 2 bytes per token and layer; the full 131072-token context fits.
    p = run("--model", GLM45, "--workers", "a=cuda:8x80GiB", ok=False)
    assert "RESOURCE_EXHAUSTED" in p.stderr and "705.7 GB weights" in p.stderr, p.stderr
    text = run("--model", GLM45, "--workers", TWO_NODES).stdout
    assert text.startswith("plan: 1 replica x 2 stages, max_seq_len 131072"), text
    j = json.loads(run("--model", GLM45, "--workers", TWO_NODES, "--json").stdout)
    chosen = check_stages(j, 2 * 128 * 2)
    assert not chosen["expert_spill"] and chosen["pp"] == 2, chosen
    assert all(s["kv_tokens"] >= 131072 and s["tp"] == 8 for s in j["plan"]["replicas"][0]["stages"]), j["plan"]
    # One 8 x 141 GiB node (H200) holds it in one stage. Per rank: the f32 norms (q/k norms included),
    # q/k/v biases, router and score-correction bias whole; its 12 heads' q and o, its KV head's k and
    # v; an eighth of the dense MLPs and of the shared expert; 20 of the 160 experts; the whole
    # embedding and an eighth of lm_head's rows.
    j = json.loads(run("--model", GLM45, "--workers", "a=cuda:8x141GiB", "--json").stdout)
    check_stages(j, 2 * 128 * 2)
    h, tp, vocab, q, kv = 5120, 8, 151552, 12 * 128, 128
    attn = (2 * h + 2 * 128) * 4 + (2 * q * h + 2 * kv * h) * 2 + (q + 2 * kv) * 4
    dense = 3 * h * (12288 // tp) * 2
    sparse = 160 * (h + 1) * 4 + 3 * h * (1536 // tp) * 2 + (160 // tp) * 3 * h * 1536 * 2
    weights = 92 * attn + 3 * dense + 89 * sparse + vocab * h * 2 + vocab // tp * h * 2 + h * 4
    (stage,) = j["plan"]["replicas"][0]["stages"]
    assert (stage["tp"], stage["layer_begin"], stage["layer_end"]) == (8, 0, 92), stage
    assert stage["weight_bytes_per_rank"] == weights, (stage, weights)
    # Its RoPE rotates half of each head; YaRN there is not checked against transformers: refused.
    with open(os.path.join(GLM45, "config.json")) as f:
        config = json.load(f)
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 65536}
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(config, f)
        p = run("--model", d, "--workers", TWO_NODES, ok=False)
        assert "UNIMPLEMENTED" in p.stderr and "rope type \"yarn\"" in p.stderr, p.stderr


if __name__ == "__main__":
    main()
