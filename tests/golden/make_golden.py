#!/usr/bin/env python3
"""Create tiny random-weight Hugging Face checkpoints and their reference outputs.

Run from the repository root:

    python3 tests/golden/make_golden.py            # all models
    python3 tests/golden/make_golden.py --only llama mistral

For every model this writes tests/golden/models/<name>/ with exactly what
`save_pretrained(safe_serialization=True)` writes (config.json,
generation_config.json, model.safetensors or model-0000x-of-0000y.safetensors +
model.safetensors.index.json) and a reference.json:

    {"model", "architecture", "generator", "transformers_version", "torch_version",
     "cases": [{"prompt_ids", "logits" (prompt_len x vocab), "greedy_ids" (32),
                "min_greedy_margin"}],
     "min_router_margin" (MoE models) | null}

References are computed by transformers itself (eager attention, float32, CPU,
one thread) on the checkpoint *reloaded from disk*, so what is tested is what is
committed.  Weights are re-initialised with large standard deviations so that the
logits are well spread, and every fixture is checked to have no near-ties (the
thresholds are 5x / 10x stricter than the 1e-3 / 1e-4 that cross-implementation
float32 comparisons need, to leave room for TF32-like GPU math):

  * every greedy decision: top1 - top2 > GREEDY_REL_MARGIN (5e-3) * max|logit| at
    that position, in both the KV-cache decode loop and a cache-free recompute
    (which must pick the same tokens);
  * MoE models: for every token (prompt and generated) and every sparse layer,
    p[k-1] - p[k] > ROUTER_MARGIN (1e-3) for the sorted router softmax
    probabilities (k = num_experts_per_tok); Llama-4, which chooses by router logit, for the
    sorted logits;
  * no generated token equals eos_token_id (2), so an engine that stops on EOS
    still produces all 32 tokens, and at least MIN_DISTINCT (12) distinct
    generated tokens per case (no degenerate repetition).

When a check fails the prompt (and, if needed, the weight seed) is changed
deterministically.  Recorded: min_greedy_margin = smallest absolute top1 - top2
logit gap over the greedy steps of a case (logit units); min_router_margin =
smallest router-probability gap p[k-1] - p[k] over all cases (null for dense
models).  Everything is deterministic: re-running reproduces identical files
(same torch / transformers versions, CPU).
"""

import argparse
import json
import os
import shutil
import sys

import numpy as np
import torch
import transformers
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GraniteConfig,
    GraniteForCausalLM,
    GraniteMoeConfig,
    GraniteMoeForCausalLM,
    GraniteMoeSharedConfig,
    GraniteMoeSharedForCausalLM,
    GraniteMoeSWAConfig,
    GraniteMoeSWAForCausalLM,
    GraniteSWAConfig,
    GraniteSWAForCausalLM,
    Glm4Config,
    Glm4ForCausalLM,
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    Glm4MoeLiteConfig,
    Glm4MoeLiteForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    Llama4Config,
    Llama4ForCausalLM,
    Llama4ForConditionalGeneration,
    Llama4TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    SeedOssConfig,
    SeedOssForCausalLM,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS_DIR = os.path.join(HERE, "models")
GENERATOR = "tests/golden/make_golden.py"

VOCAB = 256
HIDDEN = 64
MAX_POS = 128
BOS, EOS = 1, 2
PROMPT_LENS = (1, 5, 11)
NEW_TOKENS = 32
GREEDY_REL_MARGIN = 5e-3
ROUTER_MARGIN = 1e-3
MIN_DISTINCT = 12  # greedy outputs stuck on one token make weak tests
MAX_MODEL_SEEDS = 50
MAX_PROMPT_TRIES = 100

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    max_position_embeddings=MAX_POS,
    hidden_act="silu",
    bos_token_id=BOS,
    eos_token_id=EOS,
    attention_dropout=0.0,
)

# The granite fixtures' multipliers, none of them 1 (transformers' default): see "granite" below.
GRANITE_MULTIPLIERS = dict(
    embedding_multiplier=4.0,
    attention_multiplier=0.1,
    residual_multiplier=0.5,
    logits_scaling=4.0,
)

# qwen3's config, which qwen3_yarn extends.
QWEN3 = dict(
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # explicit, != hidden_size / num_attention_heads (16), as in Qwen3-0.6B
    rms_norm_eps=1e-6,
    attention_bias=False,
    use_sliding_window=False,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    tie_word_embeddings=False,
)

# The GPT-OSS fixtures' config (4 experts x 32, 2 per token; GptOssConfig's default YaRN).
GPT_OSS = dict(
    intermediate_size=32,  # per expert
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=4,
    tie_word_embeddings=False,
)

# The MLA + MoE shape that deepseek_v3 and glm4_moe_lite share: 3 layers, 4 heads of multi-head
# latent attention (q compressed to 32, a latent of 32, nope 16 + rope 8, v 16), a dense MLP of 96
# and 8 routed experts of 16, 2 per token.
MLA_MOE = dict(
    intermediate_size=96,  # the dense MLP
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
)

# granite_moe's config, which granite_moe_shared extends.
GRANITE_MOE = dict(
    intermediate_size=16,  # per expert
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    num_local_experts=8,
    num_experts_per_tok=2,
    attention_bias=False,
    **GRANITE_MULTIPLIERS,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    tie_word_embeddings=False,
)

SPECS = [
    dict(
        name="llama",
        model_cls=LlamaForCausalLM,
        config_cls=LlamaConfig,
        config=dict(
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=False,
        ),
    ),
    dict(
        name="llama_tied_llama3rope_bias",
        model_cls=LlamaForCausalLM,
        # With tied embeddings a large embedding makes every token predict itself
        # (logit e_t . e_t dominates): keep it small so the layers drive the output.
        std_embed=0.3,
        config_cls=LlamaConfig,
        config=dict(
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,  # != hidden_size / num_attention_heads (16)
            rms_norm_eps=1e-5,
            attention_bias=True,  # q, k, v AND o_proj get a bias
            mlp_bias=False,
            tie_word_embeddings=True,
            # head_dim 32, theta 5e5: wavelengths 2*pi*theta^(2i/32) = 6.28, 14.3, 32.4, 73.4, ...
            # original_max_position_embeddings 32 -> high_freq_wavelen 8, low_freq_wavelen 32:
            # i=0 unchanged, i=1 smoothed, i>=2 divided by factor: all three branches are used.
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    dict(
        name="mistral",
        model_cls=MistralForCausalLM,
        config_cls=MistralConfig,
        config=dict(
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            sliding_window=8,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=False,
        ),
    ),
    dict(
        name="qwen2",
        model_cls=Qwen2ForCausalLM,
        config_cls=Qwen2Config,
        config=dict(
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-6,
            use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=False,
        ),
    ),
    dict(
        name="mixtral",
        model_cls=MixtralForCausalLM,
        config_cls=MixtralConfig,
        config=dict(
            intermediate_size=32,  # per expert
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=None,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=False,
        ),
    ),
    dict(
        name="qwen2_moe",
        model_cls=Qwen2MoeForCausalLM,
        config_cls=Qwen2MoeConfig,
        config=dict(
            intermediate_size=96,  # dense MLP of the mlp_only_layers
            moe_intermediate_size=16,  # per routed expert
            shared_expert_intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-6,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[1],  # layers 0 and 2 sparse, layer 1 dense
            use_sliding_window=False,
            qkv_bias=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=False,
        ),
    ),
    dict(
        name="llama_bf16_sharded",
        model_cls=LlamaForCausalLM,
        config_cls=LlamaConfig,
        config=dict(
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=False,
        ),
        save_dtype=torch.bfloat16,
        max_shard_size="100KB",
    ),
    # Added with issue 22 (new architectures). Appended, so the seeds of the models above are
    # unchanged (they derive from the index in this list).
    dict(
        name="qwen3",
        model_cls=Qwen3ForCausalLM,
        config_cls=Qwen3Config,
        config=QWEN3,
    ),
    dict(
        name="qwen3_moe",
        model_cls=Qwen3MoeForCausalLM,
        config_cls=Qwen3MoeConfig,
        config=dict(
            intermediate_size=96,  # dense MLP of the mlp_only_layers
            moe_intermediate_size=16,  # per routed expert
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            rms_norm_eps=1e-6,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],  # layers 0 and 2 sparse, layer 1 dense
            attention_bias=True,  # q, k, v and o biases together with the q/k norms
            use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=False,
        ),
    ),
    dict(
        name="phi3",
        model_cls=Phi3ForCausalLM,
        config_cls=Phi3Config,
        config=dict(
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            sliding_window=16,  # reached by the 11-token prompt + 32 generated tokens
            original_max_position_embeddings=MAX_POS,
            pad_token_id=None,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
            tie_word_embeddings=False,
        ),
    ),
    # DeepSeek-V3: multi-head latent attention (q compressed to q_lora_rank, k/v to one shared
    # latent of kv_lora_rank plus a decoupled RoPE key), yarn RoPE whose attention_factor (mscale
    # != mscale_all_dim) scales the rotary part and whose mscale_all_dim scales the softmax, RoPE
    # interleaved; layer 0 dense, layers 1-2 MoE with sigmoid scoring, a nonzero
    # e_score_correction_bias, grouped top-k (4 groups, 2 chosen), routed_scaling_factor and one
    # shared expert.
    dict(
        name="deepseek_v3",
        model_cls=DeepseekV3ForCausalLM,
        config_cls=DeepseekV3Config,
        score_bias_std=0.05,
        config=dict(
            **MLA_MOE,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            first_k_dense_replace=1,
            rms_norm_eps=1e-6,
            rope_interleave=True,
            num_mtp_layers=0,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 0.7,
            },
            tie_word_embeddings=False,
        ),
    ),
    # DeepSeek-V2-Lite-like MLA: no q compression (q_lora_rank null: one q_proj), default RoPE
    # not interleaved, one expert group, no top-k renormalisation, two shared experts.
    dict(
        name="deepseek_v3_noqlora",
        model_cls=DeepseekV3ForCausalLM,
        config_cls=DeepseekV3Config,
        score_bias_std=0.05,
        config=dict(
            intermediate_size=96,
            moe_intermediate_size=16,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=None,
            kv_lora_rank=24,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=12,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            n_shared_experts=2,
            routed_scaling_factor=1.5,
            norm_topk_prob=False,
            first_k_dense_replace=2,
            rms_norm_eps=1e-6,
            rope_interleave=False,
            num_mtp_layers=0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=False,
        ),
    ),
    # Gemma-2: embeddings scaled by sqrt(hidden_size), RMSNorm by (1 + weight) (the norm weights
    # are drawn around 0, so the factor is around 1), norms before and after both the attention
    # and the MLP, gelu_pytorch_tanh gated MLP, softmax scale query_pre_attn_scalar^-1/2 (24, not
    # head_dim 32), attention-score and final-logit soft-capping small enough to bite, layers 0
    # and 2 "sliding_attention" with a window of 8 (transformers' default layer_types), layer 1
    # full; embeddings tied (Gemma's default). COMMON's hidden_act ("silu") is ignored by Gemma2,
    # which reads hidden_activation.
    dict(
        name="gemma2",
        model_cls=Gemma2ForCausalLM,
        config_cls=Gemma2Config,
        norm_center=0.0,
        # Small embeddings: scaled by 8 and tied to lm_head, larger ones dominate the residual stream
        # and the model only repeats its last token.
        std_embed=0.05,
        config=dict(
            intermediate_size=96,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            hidden_activation="gelu_pytorch_tanh",
            rms_norm_eps=1e-6,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=8.0,  # |q.k| * scale reaches ~12 on these weights
            final_logit_softcapping=1.5,  # uncapped max |logit| ~1.4-1.8
            sliding_window=8,
            attention_bias=False,
            pad_token_id=0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=True,
        ),
    ),
    # Llama-4 (Scout-like): layers 1 and 3 MoE (interleave_moe_layer_step 2) with 8 experts x 16,
    # top-2 by router logit, sigmoid weights applied to the experts' inputs, and a shared expert
    # of intermediate_size (16); layers 0 and 2 dense of intermediate_size_mlp (96). Layer 2 is a
    # NoPE layer (no_rope_layers 0) whose queries are scaled by the attention temperature
    # (floor_scale 4 and attn_scale 0.5, so that it changes every 4 positions within the fixture's
    # 43); the RoPE layers 0, 1, 3 attend within chunks of 8 positions (transformers' default
    # layer_types) and L2-normalise q and k after RoPE (use_qk_norm). RoPE on interleaved pairs,
    # llama3 scaling with low_freq_factor == high_freq_factor as Scout's (no smoothed band).
    dict(
        name="llama4",
        model_cls=Llama4ForCausalLM,
        config_cls=Llama4TextConfig,
        config=dict(
            intermediate_size=16,  # each expert and the shared expert
            intermediate_size_mlp=96,  # dense layers
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            rms_norm_eps=1e-5,
            num_local_experts=8,
            num_experts_per_tok=2,
            interleave_moe_layer_step=2,
            no_rope_layers=[1, 1, 0, 1],
            attention_chunk_size=8,
            use_qk_norm=True,
            attn_temperature_tuning=True,
            floor_scale=4,
            attn_scale=0.5,
            attention_bias=False,
            pad_token_id=None,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 1.0,
                "original_max_position_embeddings": 32,
            },
            tie_word_embeddings=False,
        ),
    ),
    # Llama4ForConditionalGeneration (Maverick-like text model): the text config nested in
    # `text_config` and the text weights under `language_model.` (a tiny vision tower beside them,
    # which the engine does not load); every layer MoE with top-1 routing, no q/k norm, default
    # RoPE, NoPE every third layer (no_rope_layer_interval 3: layer 2), chunks of 16.
    dict(
        name="llama4_multimodal",
        model_cls=Llama4ForConditionalGeneration,
        config_cls=Llama4Config,
        nested_text_config=True,
        outer_config=dict(
            vision_config=dict(
                hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                vision_output_dim=16, image_size=28, patch_size=14, projector_input_dim=16,
                projector_output_dim=16,
            ),
            tie_word_embeddings=False,
        ),
        config=dict(
            intermediate_size=32,
            intermediate_size_mlp=96,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            rms_norm_eps=1e-5,
            num_local_experts=4,
            num_experts_per_tok=1,
            interleave_moe_layer_step=1,
            no_rope_layer_interval=3,
            attention_chunk_size=16,
            use_qk_norm=False,
            attn_temperature_tuning=True,
            floor_scale=8,
            attn_scale=0.3,
            attention_bias=False,
            pad_token_id=None,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=False,
        ),
    ),
    # Phi-3 with partial RoPE (Phi-4-mini-like): only the first half of each 16-wide q and k head
    # rotates (partial_rotary_factor 0.5: 8 dims, 4 frequencies), the rest passes through; tied
    # embeddings as Phi-4-mini; no sliding window.
    dict(
        name="phi3_partial_rotary",
        model_cls=Phi3ForCausalLM,
        config_cls=Phi3Config,
        std_embed=0.3,  # tied: see llama_tied_llama3rope_bias
        config=dict(
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            sliding_window=None,
            original_max_position_embeddings=MAX_POS,
            pad_token_id=None,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            tie_word_embeddings=True,
        ),
    ),
    # Phi-3 LongRoPE (Phi-3.5-mini / Phi-4-mini-like) with partial RoPE 0.75 (12 of 16 dims, 6
    # frequencies): original_max_position_embeddings 12 of max_position_embeddings 128, so the
    # attention factor is sqrt(1 + ln(128 / 12) / ln 12) = 1.40 and every prompt (at most 11
    # tokens) rotates with the short factors while the decode steps from position 12 on rotate
    # with the long ones (transformers' KV-cache generation: cached keys keep their rotation).
    # transformers' cache-free recompute of a sequence past 12 tokens rotates every position with
    # the long factors, so that check is skipped here: the reference is the KV-cache generation.
    dict(
        name="phi3_longrope",
        model_cls=Phi3ForCausalLM,
        config_cls=Phi3Config,
        cache_free_check=False,
        config=dict(
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            sliding_window=None,
            original_max_position_embeddings=12,
            pad_token_id=None,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                "long_factor": [1.0, 1.5, 3.0, 6.0, 10.0, 16.0],
                "original_max_position_embeddings": 12,
            },
            tie_word_embeddings=False,
        ),
    ),
    # Gemma-3 (text): Gemma-2's layer (sqrt(hidden) embedding scale, (1 + w) RMSNorms, sandwich
    # norms, gelu_pytorch_tanh, query_pre_attn_scalar 24 != head_dim 32) plus per-head q and k
    # RMSNorms with (1 + w) weights drawn around 0 (their names end in "norm.weight"), and two
    # RoPEs: the sliding layers 0 and 2 (a pattern of 2, window 6 < the prompts + generated
    # tokens) rotate with theta 1e4, the full layer 1 with theta 1e6 and linear scaling x8 (as
    # the 4B+ models). No soft-capping (null, as the released Gemma-3 configs).
    dict(
        name="gemma3",
        model_cls=Gemma3ForCausalLM,
        config_cls=Gemma3TextConfig,
        norm_center=0.0,
        std_embed=0.05,
        config=dict(
            intermediate_size=96,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            hidden_activation="gelu_pytorch_tanh",
            rms_norm_eps=1e-6,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=None,
            final_logit_softcapping=None,
            sliding_window=6,
            sliding_window_pattern=2,
            attention_bias=False,
            pad_token_id=0,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
            tie_word_embeddings=True,
        ),
    ),
    # DeepSeek-V2-Lite-like: V3's multi-head latent attention without query compression
    # (q_lora_rank null), RoPE always on interleaved pairs (V2 has no rope_interleave switch), yarn
    # with mscale == mscale_all_dim (attention_factor 1, the softmax scale times
    # mscale(factor, mscale_all_dim)^2) as V2-Lite's config; V2's gate: softmax over the experts,
    # topk_method "greedy" (the top_k probabilities, not renormalised, times
    # routed_scaling_factor), no score-correction bias; layer 0 dense, two shared experts.
    dict(
        name="deepseek_v2_lite",
        model_cls=DeepseekV2ForCausalLM,
        config_cls=DeepseekV2Config,
        config=dict(
            intermediate_size=96,
            moe_intermediate_size=16,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=None,
            kv_lora_rank=24,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            topk_method="greedy",
            n_shared_experts=2,
            routed_scaling_factor=1.0,
            norm_topk_prob=False,
            first_k_dense_replace=1,
            rms_norm_eps=1e-6,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
            },
            tie_word_embeddings=False,
        ),
    ),
    # DeepSeek-V2-like: query compression (q_lora_rank 32), topk_method "group_limited_greedy"
    # (8 experts in 2 groups of 4 ranked by their best softmax score, top-2 from the best group: it
    # differs from "greedy" whenever the runner-up expert is in the other group; with top_k <=
    # topk_group the group limit could never change a choice),
    # routed_scaling_factor 2, one shared expert, yarn with mscale != mscale_all_dim
    # (attention_factor != 1); rms_norm_eps 1e-5 while the latent norms (q_a_layernorm,
    # kv_a_layernorm) keep transformers' default 1e-6.
    dict(
        name="deepseek_v2",
        model_cls=DeepseekV2ForCausalLM,
        config_cls=DeepseekV2Config,
        config=dict(
            intermediate_size=96,
            moe_intermediate_size=16,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            topk_method="group_limited_greedy",
            n_shared_experts=1,
            routed_scaling_factor=2.0,
            norm_topk_prob=False,
            first_k_dense_replace=1,
            rms_norm_eps=1e-5,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 0.8,
            },
            tie_word_embeddings=False,
        ),
    ),
    # Granite: Llama's layer with four multipliers, none of them 1 (transformers' defaults): the
    # embedding x 4, the softmax scale 0.1 instead of head_dim^-1/2 = 0.25, each layer's attention
    # and MLP outputs x 0.5 before the residual add, the logits / 4. attention_bias (q, k, v and o:
    # the o bias is scaled with its matrix). Untied, unlike the released models: tied, this tiny
    # model repeats one or two tokens whatever the embedding's scale (50 seeds tried); ties are
    # llama_tied_llama3rope_bias's, and the logits' multiplier does not depend on them.
    dict(
        name="granite",
        model_cls=GraniteForCausalLM,
        config_cls=GraniteConfig,
        config=dict(
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            attention_bias=True,
            mlp_bias=False,
            **GRANITE_MULTIPLIERS,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=False,
        ),
    ),
    # GraniteMoe: Granite's multipliers (the residual one also scales the expert outputs) around
    # Mixtral-like routing (softmax of the top-2 router logits of 8 experts) over experts stored
    # stacked: block_sparse_moe.input_linear [8, 2 x 16, 64], output_linear [8, 64, 16] and the
    # router block_sparse_moe.router.layer, as the released checkpoints store them.
    dict(
        name="granite_moe",
        model_cls=GraniteMoeForCausalLM,
        config_cls=GraniteMoeConfig,
        config=GRANITE_MOE,
    ),
    # SmolLM3: Llama's layer where no_rope_layers' 0 entries skip RoPE (NoPE), with layer_types'
    # sliding layers windowed under use_sliding_window. Four layers cover each pairing: RoPE and
    # full, NoPE and sliding, RoPE and sliding, NoPE and full (the released 3B: every fourth layer
    # NoPE, no window). attention_bias (q, k, v and o); tied, as SmolLM3Config defaults.
    dict(
        name="smollm3",
        model_cls=SmolLM3ForCausalLM,
        config_cls=SmolLM3Config,
        std_embed=0.3,
        config=dict(
            intermediate_size=96,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-6,
            attention_bias=True,
            pad_token_id=None,  # SmolLM3Config's 128004 is outside this vocabulary
            no_rope_layers=[1, 0, 1, 0],
            use_sliding_window=True,
            sliding_window=8,
            layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=True,
        ),
    ),
    # GraniteMoeShared: granite_moe's layer plus an ungated shared expert beside the routed ones,
    # stored as shared_mlp.input_linear [2 x 32, 64] (gate rows first) and output_linear [64, 32];
    # the residual multiplier scales the sum of both. Three layers, so that PP=2 splits it unevenly.
    dict(
        name="granite_moe_shared",
        model_cls=GraniteMoeSharedForCausalLM,
        config_cls=GraniteMoeSharedConfig,
        config=dict(GRANITE_MOE, shared_intermediate_size=32, num_hidden_layers=3),
    ),
    # GraniteSWA: Granite's layer with a learned attention sink per head (self_attn.sinks, drawn
    # with std 1 so that heads differ in how much they attend to nothing), windowed layer_types
    # layers and a RoPE theta per layer (layer_rope_theta; 0 = NoPE). Four layers pair RoPE/NoPE
    # with full/sliding, one RoPE layer with theta 100 (the global 1e4 would not tell them apart).
    # Untied, as granite (the released configs tie).
    dict(
        name="granite_swa",
        model_cls=GraniteSWAForCausalLM,
        config_cls=GraniteSWAConfig,
        config=dict(
            intermediate_size=96,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            attention_bias=False,
            mlp_bias=False,
            **GRANITE_MULTIPLIERS,
            sliding_window=4,
            layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
            layer_rope_theta=[10000.0, 0, 100.0, 0],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=False,
        ),
    ),
    # GraniteMoeSWA: granite_moe_shared's MoE layer (with its shared expert) under GraniteSWA's
    # attention; layer_types and layer_rope_theta left to the config's defaults (layer 0 full, the
    # others sliding; every layer at the global theta), which its config.json then spells out.
    # transformers 5 writes its experts and router under their new names (experts.gate_up_proj,
    # experts.down_proj, router), having no older ones to convert back to.
    dict(
        name="granite_moe_swa",
        model_cls=GraniteMoeSWAForCausalLM,
        config_cls=GraniteMoeSWAConfig,
        config=dict(GRANITE_MOE, shared_intermediate_size=32, num_hidden_layers=3, sliding_window=4),
    ),
    # GPT-OSS: q/k/v/o biases, sinks, sliding layers (the even ones by default), YaRN (GptOssConfig's
    # default rope_parameters: factor 32 over 4096 positions, which at head_dim 16 blends frequencies
    # 3 and 4 and interpolates 5 to 7, and scales cos and sin by 1.35), a biased router and biased
    # experts with the clamped SwiGLU. gpt_oss's expert gate/up weights are drawn large enough (std
    # 0.45) that the clamps at +-7 bite; gpt_oss_mxfp4's at the default std (larger ones made its
    # routing flip under any rounding). gpt_oss is saved as transformers saves it
    # (experts.gate_up_proj [experts, hidden, 2 x width], gate and up in alternating columns);
    # gpt_oss_mxfp4 as GPT-OSS is released: bf16, its experts' matrices MXFP4 (`_blocks` and
    # `_scales`; see write_mxfp4), which transformers dequantizes when it loads them for the reference.
    dict(
        name="gpt_oss",
        model_cls=GptOssForCausalLM,
        config_cls=GptOssConfig,
        config=dict(GPT_OSS, num_hidden_layers=4),
        std_overrides={"experts.gate_up_proj": 0.45},
    ),
    dict(
        name="gpt_oss_mxfp4",
        model_cls=GptOssForCausalLM,
        config_cls=GptOssConfig,
        config=dict(GPT_OSS, num_hidden_layers=3,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
        save_dtype=torch.bfloat16,
        mxfp4=True,
    ),
    # Qwen3 with YaRN rope_parameters, as Qwen3's model cards suggest for long contexts: factor 4
    # over 16 original positions at theta 1e4 (frequencies 0 kept, 1 blended, 2-15 interpolated;
    # cos and sin x 1.139).
    dict(
        name="qwen3_yarn",
        model_cls=Qwen3ForCausalLM,
        config_cls=Qwen3Config,
        config=dict(QWEN3, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                            "original_max_position_embeddings": 16}),
    ),
    # GLM-4.5 (Glm4MoeForCausalLM): grouped-query attention with q/k/v biases (no o bias), per-head
    # q/k RMSNorms before RoPE (use_qk_norm, as GLM-4.5 and 4.6), RoPE on the first half of each
    # head (partial_rotary_factor 0.5: 16 of head_dim 32, which is not hidden / heads), layer 0
    # dense, layers 1-2 DeepSeek-V3's MoE (sigmoid scores chosen with a nonzero
    # e_score_correction_bias, top-2 renormalised, routed_scaling_factor 2.5 as GLM-4.5, one shared
    # expert); one expert group, as every released GLM-4.5.
    dict(
        name="glm4_moe",
        model_cls=Glm4MoeForCausalLM,
        config_cls=Glm4MoeConfig,
        score_bias_std=0.05,
        config=dict(
            intermediate_size=96,  # dense MLP of the first_k_dense_replace layers
            moe_intermediate_size=16,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            partial_rotary_factor=0.5,
            attention_bias=True,
            use_qk_norm=True,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            first_k_dense_replace=1,
            rms_norm_eps=1e-5,
            num_mtp_layers=0,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5},
            tie_word_embeddings=False,
        ),
    ),
    # GLM-4.7-Flash (Glm4MoeLiteForCausalLM): DeepSeek-V3's multi-head latent attention (q compressed,
    # RoPE interleaved) under GLM-4.5's MoE block (one group, a nonzero e_score_correction_bias,
    # renormalised top-2, routed_scaling_factor 1.8 as its config's default, one shared expert);
    # the sparse layers from mlp_layer_types, here not the default (layer 0 dense): sparse, dense,
    # sparse.
    dict(
        name="glm4_moe_lite",
        model_cls=Glm4MoeLiteForCausalLM,
        config_cls=Glm4MoeLiteConfig,
        score_bias_std=0.05,
        config=dict(
            **MLA_MOE,
            n_group=1,
            topk_group=1,
            n_shared_experts=1,
            routed_scaling_factor=1.8,
            norm_topk_prob=True,
            mlp_layer_types=["sparse", "dense", "sparse"],
            rms_norm_eps=1e-5,
            rope_interleave=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=False,
        ),
    ),
    # Seed-OSS (ByteDance's Seed-OSS-36B): Llama's layer with q/k/v biases but none on o
    # (attention_out_bias false, its default), head_dim 32 (not hidden / heads), its config's
    # training-only residual dropout left at 0.1.
    dict(
        name="seed_oss",
        model_cls=SeedOssForCausalLM,
        config_cls=SeedOssConfig,
        config=dict(
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            attention_bias=True,
            attention_out_bias=False,
            mlp_bias=False,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0},
            tie_word_embeddings=False,
        ),
    ),
    # GLM-4 (Glm4ForCausalLM: GLM-4-9B/32B-0414, GLM-Z1): q/k/v biases (no o bias), RoPE on
    # interleaved pairs of each head's first half (16 of head_dim 32, not hidden / heads), gate and
    # up fused in one gate_up_proj, four norms per layer (post_self_attn_layernorm on the attention's
    # output, post_attention_layernorm before the MLP, post_mlp_layernorm after it).
    dict(
        name="glm4",
        model_cls=Glm4ForCausalLM,
        config_cls=Glm4Config,
        config=dict(
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            partial_rotary_factor=0.5,
            attention_bias=True,
            rms_norm_eps=1e-5,
            pad_token_id=None,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            tie_word_embeddings=False,
        ),
    ),
]

# Standard deviations of the re-initialisation (see module docstring).
STD_EMBED = 1.0
STD_LINEAR = 0.2
STD_BIAS = 0.2
STD_NORM_NOISE = 0.1
STD_ROUTER = 0.25
STD_SHARED_GATE = 0.5
STD_SINK = 1.0


def reinit_(model, seed, std_embed=STD_EMBED, score_bias_std=0.0, norm_center=1.0, std_overrides=None):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # DeepSeek-V3's e_score_correction_bias is a buffer (not a parameter): give it values so
        # that selecting by score + bias differs from selecting by score.
        if score_bias_std > 0:
            for name, b in sorted(model.named_buffers(), key=lambda kv: kv[0]):
                if name.endswith("e_score_correction_bias"):
                    b.copy_(score_bias_std * torch.randn(b.shape, generator=gen, dtype=torch.float32))
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            override = [std for suffix, std in (std_overrides or {}).items() if name.endswith(suffix)]
            if override:
                value = override[0] * noise
            elif name.endswith("norm.weight"):
                value = norm_center + STD_NORM_NOISE * noise
            elif name.endswith(".bias"):
                value = STD_BIAS * noise
            elif "embed_tokens" in name:
                value = std_embed * noise
            elif (name.endswith("mlp.gate.weight") or name.endswith("feed_forward.router.weight")
                  or name.endswith("block_sparse_moe.router.weight") or name.endswith("mlp.router.weight")):
                # MoE router (Mixtral, Qwen2-MoE, Qwen3-MoE; Llama-4; GraniteMoe; GPT-OSS)
                value = STD_ROUTER * noise
            elif name.endswith("shared_expert_gate.weight"):
                value = STD_SHARED_GATE * noise
            elif name.endswith("self_attn.sinks"):
                value = STD_SINK * noise
            else:
                value = STD_LINEAR * noise
            p.copy_(value.to(p.dtype))


def f32(x):
    """Shortest decimal that round-trips the float32 value x."""
    return float(str(np.float32(x)))


def dump_reference(path, ref):
    """JSON with one logits row per line (compact but diffable)."""
    def enc(v):
        return json.dumps(v, separators=(", ", ": "))

    lines = ["{"]
    head = [k for k in ref if k not in ("cases", "min_router_margin")]
    for k in head:
        lines.append(f"  {enc(k)}: {enc(ref[k])},")
    lines.append('  "cases": [')
    for ci, case in enumerate(ref["cases"]):
        lines.append("    {")
        items = list(case.items())
        for ki, (k, v) in enumerate(items):
            comma = "," if ki + 1 < len(items) else ""
            if k in ("logits",):
                lines.append(f"      {enc(k)}: [")
                for ri, row in enumerate(v):
                    rc = "," if ri + 1 < len(v) else ""
                    lines.append("        " + enc(row) + rc)
                lines.append("      ]" + comma)
            else:
                lines.append(f"      {enc(k)}: {enc(v)}{comma}")
        lines.append("    }" + ("," if ci + 1 < len(ref["cases"]) else ""))
    lines.append("  ],")
    lines.append(f'  "min_router_margin": {enc(ref["min_router_margin"])}')
    lines.append("}")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


class RouterProbe:
    """Records, for every token routed by every MoE router, the gap between the
    k-th and (k+1)-th largest softmax probabilities."""

    def __init__(self, model):
        self.handles = []
        self.min_gap = float("inf")
        for name, mod in model.named_modules():
            if type(mod).__name__.endswith("TopKRouter"):
                self.top_k = mod.top_k
                self.handles.append(mod.register_forward_hook(self._hook))
            elif type(mod).__name__ in ("DeepseekV3TopkRouter", "Glm4MoeTopkRouter", "Glm4MoeLiteTopkRouter"):
                self.handles.append(mod.register_forward_hook(self._deepseek_hook))
            elif type(mod).__name__ == "DeepseekV2TopkRouter":
                self.handles.append(mod.register_forward_hook(self._deepseek_v2_hook))
            elif type(mod).__name__ == "Llama4Router":
                self.top_k = mod.top_k
                self.handles.append(mod.register_forward_hook(self._llama4_hook))

    @property
    def active(self):
        return bool(self.handles)

    def _hook(self, mod, inputs, output):
        router_logits = output[0].float()
        probs = torch.softmax(router_logits, dim=-1)
        s = torch.sort(probs, dim=-1, descending=True).values
        gap = (s[:, self.top_k - 1] - s[:, self.top_k]).min().item()
        self.min_gap = min(self.min_gap, gap)

    def _deepseek_hook(self, mod, inputs, output):
        # Sigmoid scores; selection by score + e_score_correction_bias: groups ranked by the sum of
        # their two best biased scores (topk_group kept), then the top_k biased scores inside the
        # kept groups. Both decisions must be clear: the topk_group-th group score beats the next,
        # and the top_k-th kept biased score beats the next kept one.
        router_logits = output[0].float()
        biased = torch.sigmoid(router_logits) + mod.e_score_correction_bias.float()
        groups = biased.view(-1, mod.num_group, mod.num_experts // mod.num_group)
        group_scores = groups.topk(2, dim=-1)[0].sum(dim=-1)
        if mod.topk_group < mod.num_group:
            gs = torch.sort(group_scores, dim=-1, descending=True).values
            self.min_gap = min(self.min_gap, (gs[:, mod.topk_group - 1] - gs[:, mod.topk_group]).min().item())
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(mod.topk_group, dim=-1)[1], 1.0)
        mask = keep.unsqueeze(-1).expand_as(groups).reshape(-1, mod.num_experts).bool()
        kept = torch.sort(biased.masked_fill(~mask, float("-inf")), dim=-1, descending=True).values
        if mod.top_k < kept.shape[-1]:
            gap = kept[:, mod.top_k - 1] - kept[:, mod.top_k]
            self.min_gap = min(self.min_gap, gap.min().item())

    def _deepseek_v2_hook(self, mod, inputs, output):
        # Softmax scores. "greedy": the top_k scores, so the k-th must beat the next.
        # "group_limited_greedy": groups ranked by their best score (topk_group kept), then the
        # top_k scores inside the kept groups: both decisions must be clear.
        scores = torch.softmax(output[0].float(), dim=-1)
        if mod.topk_method == "group_limited_greedy":
            groups = scores.view(-1, mod.num_group, mod.num_experts // mod.num_group)
            group_scores = groups.max(dim=-1).values
            if mod.topk_group < mod.num_group:
                gs = torch.sort(group_scores, dim=-1, descending=True).values
                self.min_gap = min(self.min_gap, (gs[:, mod.topk_group - 1] - gs[:, mod.topk_group]).min().item())
            keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(mod.topk_group, dim=-1)[1], 1.0)
            mask = keep.unsqueeze(-1).expand_as(groups).reshape(-1, mod.num_experts).bool()
            scores = scores.masked_fill(~mask, float("-inf"))
        kept = torch.sort(scores, dim=-1, descending=True).values
        gap = kept[:, mod.top_k - 1] - kept[:, mod.top_k]
        self.min_gap = min(self.min_gap, gap.min().item())

    def _llama4_hook(self, mod, inputs, output):
        # Llama-4 chooses the top_k router logits (their sigmoids are the weights): the k-th
        # largest logit must beat the next.
        s = torch.sort(output[1].float(), dim=-1, descending=True).values
        gap = (s[:, self.top_k - 1] - s[:, self.top_k]).min().item()
        self.min_gap = min(self.min_gap, gap)

    def reset(self):
        self.min_gap = float("inf")

    def remove(self):
        for h in self.handles:
            h.remove()


def greedy_margin(row):
    top2 = torch.topk(row, 2).values
    gap = (top2[0] - top2[1]).item()
    return gap, gap / row.abs().max().item()


@torch.no_grad()
def run_case(model, prompt_ids, cache_free_check=True):
    """Returns (prompt_logits [L,V], greedy ids, min abs margin, min rel margin) or
    raises ValueError if the two generation paths disagree (unless cache_free_check is off:
    LongRoPE, whose cache-free recompute rotates differently by design)."""
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    # 1) cache-free forward over the prompt: the recorded logits.
    prompt_logits = model(ids, use_cache=False).logits[0].float()

    # 2) greedy decode with the KV cache.
    out = model(ids, use_cache=True)
    cached_prompt_logits = out.logits[0].float()
    if not torch.allclose(cached_prompt_logits, prompt_logits, rtol=1e-5, atol=1e-5):
        raise ValueError("cached and cache-free prompt logits differ")
    past = out.past_key_values
    row = out.logits[0, -1].float()
    gen, abs_m, rel_m = [], [], []
    for step in range(NEW_TOKENS):
        a, r = greedy_margin(row)
        abs_m.append(a)
        rel_m.append(r)
        tok = int(torch.argmax(row))
        gen.append(tok)
        if step + 1 == NEW_TOKENS:
            break
        out = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        row = out.logits[0, -1].float()

    if not cache_free_check:
        return prompt_logits, gen, min(abs_m), min(rel_m)
    # 3) cache-free recompute over prompt + generated: same argmax everywhere.
    full = torch.tensor([list(prompt_ids) + gen[:-1]], dtype=torch.long)
    logits = model(full, use_cache=False).logits[0].float()
    L = len(prompt_ids)
    for step in range(NEW_TOKENS):
        row = logits[L - 1 + step]
        if int(torch.argmax(row)) != gen[step]:
            raise ValueError("cached and cache-free greedy tokens differ")
        a, r = greedy_margin(row)
        abs_m.append(a)
        rel_m.append(r)
    return prompt_logits, gen, min(abs_m), min(rel_m)


def make_prompt(model_idx, case_idx, attempt):
    g = torch.Generator().manual_seed(7_919 * model_idx + 1_000_003 * (case_idx + 1) + attempt)
    return torch.randint(3, VOCAB, (PROMPT_LENS[case_idx],), generator=g).tolist()


def build_and_save(spec, seed, out_dir):
    torch.manual_seed(seed)
    if spec.get("nested_text_config"):
        config = spec["config_cls"](text_config=dict(**COMMON, **spec["config"]), **spec["outer_config"])
    else:
        config = spec["config_cls"](**COMMON, **spec["config"])
    model = spec["model_cls"](config)
    reinit_(model, seed, spec.get("std_embed", STD_EMBED), spec.get("score_bias_std", 0.0),
            spec.get("norm_center", 1.0), spec.get("std_overrides"))
    if spec.get("mxfp4"):
        mxfp4_round_experts_(model)
    save_dtype = spec.get("save_dtype", torch.float32)
    model = model.to(save_dtype)
    expected = {k: v.detach().clone().float() for k, v in model.state_dict().items()}
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    kwargs = {}
    if "max_shard_size" in spec:
        kwargs["max_shard_size"] = spec["max_shard_size"]
    model.save_pretrained(out_dir, safe_serialization=True, **kwargs)
    if spec.get("mxfp4"):
        write_mxfp4(out_dir)
    return expected


# MXFP4 (GPT-OSS's release format): e2m1 codes (a sign bit over these magnitudes), two per byte
# (the even element in the low nibble), and one e8m0 scale 2^(byte - 127) per 32 consecutive inputs.
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
MXFP4_EXPERT_TENSORS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def mxfp4_quantize(w):
    """w [experts, out, in] (in % 32 == 0) -> (blocks u8 [experts, out, in/32, 16], scales u8
    [experts, out, in/32], the dequantized values). Each block's scale is the smallest power of two
    that brings its largest magnitude to 6 or below; each value rounds to the nearest magnitude."""
    e, rows, cols = w.shape
    g = w.reshape(e, rows, cols // 32, 32).astype(np.float64)
    amax = np.abs(g).max(axis=-1)
    exp = np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)).astype(np.int64)
    exp = np.clip(exp, -127, 127)
    x = g / np.exp2(exp)[..., None]
    magnitude = np.abs(np.abs(x)[..., None] - E2M1).argmin(axis=-1)
    codes = (magnitude + 8 * (x < 0)).astype(np.uint8)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    values = np.where(codes >= 8, -1.0, 1.0) * E2M1[codes & 7] * np.exp2(exp)[..., None]
    return blocks, (exp + 127).astype(np.uint8), values.reshape(e, rows, cols).astype(np.float32)


@torch.no_grad()
def mxfp4_round_experts_(model):
    """Rounds every expert matrix to its MXFP4 value, so that the saved model is exactly what its
    MXFP4 checkpoint holds."""
    for name, p in model.named_parameters():
        if name.endswith(MXFP4_EXPERT_TENSORS):
            # Stored [experts, in, out]; quantized along `in` per output, as nn.Linear holds it.
            w = p.detach().float().numpy().transpose(0, 2, 1)
            p.copy_(torch.from_numpy(mxfp4_quantize(w)[2].transpose(0, 2, 1).copy()))


def write_mxfp4(out_dir):
    """Rewrites the checkpoint save_pretrained wrote in out_dir with its experts' matrices as MXFP4
    `<name>_blocks` / `<name>_scales` and config.json's quantization_config as GPT-OSS's."""
    from safetensors.torch import load_file, save_file
    path = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(path)
    out = {}
    for name, t in tensors.items():
        if name.endswith(MXFP4_EXPERT_TENSORS):
            blocks, scales, values = mxfp4_quantize(t.float().numpy().transpose(0, 2, 1))
            if not np.array_equal(values.transpose(0, 2, 1), t.float().numpy()):
                raise RuntimeError(f"{name} is not exactly MXFP4")
            out[name + "_blocks"] = torch.from_numpy(np.ascontiguousarray(blocks))
            out[name + "_scales"] = torch.from_numpy(np.ascontiguousarray(scales))
        else:
            out[name] = t
    save_file(out, path, metadata={"format": "pt"})
    config_path = os.path.join(out_dir, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["quantization_config"] = {
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                   "lm_head"],
        "quant_method": "mxfp4",
    }
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def load(spec, out_dir):
    model = spec["model_cls"].from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    return model


def check_roundtrip(model, expected):
    got = model.state_dict()
    for k, v in expected.items():
        if k not in got:
            raise RuntimeError(f"reloaded model lacks {k}")
        if got[k].dtype != torch.float32 or not torch.equal(got[k], v):
            raise RuntimeError(f"reloaded weight {k} differs from the saved one")


def generate_model(model_idx, spec):
    name = spec["name"]
    out_dir = os.path.join(MODELS_DIR, name)
    for seed in range(1000 * model_idx, 1000 * model_idx + MAX_MODEL_SEEDS):
        expected = build_and_save(spec, seed, out_dir)
        model = load(spec, out_dir)
        check_roundtrip(model, expected)
        probe = RouterProbe(model)
        cases, router_min = [], float("inf")
        for ci in range(len(PROMPT_LENS)):
            found = None
            for attempt in range(MAX_PROMPT_TRIES):
                prompt = make_prompt(model_idx, ci, attempt)
                probe.reset()
                try:
                    logits, gen, abs_m, rel_m = run_case(model, prompt, spec.get("cache_free_check", True))
                except ValueError as e:
                    print(f"  {name} seed {seed} case {ci} try {attempt}: {e}", file=sys.stderr)
                    continue
                if rel_m <= GREEDY_REL_MARGIN or EOS in gen or len(set(gen)) < MIN_DISTINCT:
                    continue
                if probe.active and probe.min_gap <= ROUTER_MARGIN:
                    continue
                found = (prompt, logits, gen, abs_m, rel_m, probe.min_gap)
                break
            if found is None:
                break
            prompt, logits, gen, abs_m, rel_m, rgap = found
            if probe.active:
                router_min = min(router_min, rgap)
            cases.append(
                {
                    "prompt_ids": prompt,
                    "logits": [[f32(x) for x in row] for row in logits.tolist()],
                    "greedy_ids": gen,
                    "min_greedy_margin": f32(abs_m),
                }
            )
            print(
                f"  {name}: seed {seed} case {ci} (prompt try {attempt}): len {len(prompt)}, "
                f"min greedy gap {abs_m:.4g} (rel {rel_m:.4g})"
                + (f", min router gap {rgap:.4g}" if probe.active else "")
            )
        probe.remove()
        if len(cases) < len(PROMPT_LENS):
            print(f"  {name}: seed {seed} rejected, trying the next one", file=sys.stderr)
            continue
        ref = {
            "model": name,
            "architecture": spec["model_cls"].__name__,
            "generator": GENERATOR,
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__,
            "cases": cases,
            "min_router_margin": f32(router_min) if probe.active else None,
        }
        dump_reference(os.path.join(out_dir, "reference.json"), ref)
        return ref
    raise RuntimeError(f"{name}: no seed satisfies the margin checks")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", help="model names to regenerate (default: all)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    os.makedirs(MODELS_DIR, exist_ok=True)
    names = [s["name"] for s in SPECS]
    for n in args.only or []:
        if n not in names:
            ap.error(f"unknown model {n}; known: {', '.join(names)}")
    for model_idx, spec in enumerate(SPECS):
        if args.only and spec["name"] not in args.only:
            continue
        print(f"{spec['name']} ({spec['model_cls'].__name__})")
        generate_model(model_idx, spec)


if __name__ == "__main__":
    main()
