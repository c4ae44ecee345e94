#!/usr/bin/env python3
"""Independent float64 NumPy forward pass for the golden checkpoints (no PyTorch).

A readable statement of the semantics the fixtures encode, and a cross-check of
the reference.json files that make_golden.py records with transformers:

    python3 tests/golden/numpy_reference.py                 # every model under tests/golden/models
    python3 tests/golden/numpy_reference.py path/to/model   # one checkpoint directory
    python3 tests/golden/numpy_reference.py --int8 [dirs]   # the error int8 weights would cause

For each case it recomputes the prompt logits and the 32 greedy tokens (by
re-running the whole sequence, no KV cache) and prints the largest logit
difference against reference.json. Needs only numpy.

Semantics (transformers 5.23, eager attention):
  * RMSNorm: w * x / sqrt(mean(x^2) + eps)  (weight multiplies, no 1 + w).
  * RoPE rotate_half: x[i] pairs with x[i + d/2]; inv_freq_i = theta^(-2i/d);
    llama3 scaling rescales inv_freq (see llama3_inv_freq).
  * GQA: query head h uses kv head h // (num_heads / num_kv_heads).
  * scores scaled by head_dim^-0.5; causal; sliding window W: key j visible from
    query i iff 0 <= i - j < W (W keys including the query itself).
  * Llama attention_bias: bias on q, k, v AND o; Qwen2: bias on q, k, v only.
  * Mixtral: softmax over all experts, top-k, renormalise the k weights.
  * Qwen2-MoE: softmax over all experts, top-k, renormalise only if
    norm_topk_prob; plus sigmoid(shared_expert_gate . x) * shared_expert(x).
  * Qwen3 / Qwen3-MoE: q and k are RMS-normalised per head (q_norm, k_norm
    weights [head_dim], eps rms_norm_eps) after the projections, before RoPE;
    attention_bias puts a bias on q, k, v AND o. Qwen3-MoE routes like
    Qwen2-MoE (norm_topk_prob, decoder_sparse_step, mlp_only_layers) with no
    shared expert; config.json may call num_experts num_local_experts.
  * Phi-3: qkv_proj is q, k, v stacked by rows (q first); gate_up_proj is gate
    then up; sliding_window (when set) applies to every layer. partial_rotary_factor
    (in rope_parameters, or at the top level): only the first
    r = int(head_dim * factor) elements of each q and k head rotate (element i with
    i + r/2; inv_freq over r), the rest pass through. longrope: inv_freq_i =
    1 / (f_i * theta^(2i/r)) with f = short_factor or long_factor, cos and sin times
    attention_factor (given, else sqrt(1 + ln(max_pos / orig) / ln(orig)), orig =
    original_max_position_embeddings); which factors a position uses follows
    transformers' KV-cache generation: the prompt's positions the long ones iff
    the prompt is longer than orig, a generated token's position p iff p + 1 > orig.
  * DeepSeek-V3 (multi-head latent attention, written out expanded here: the
    engine's absorbed form is checked against this): q = q_b(RMS(q_a(x))) (or
    q_proj(x) when q_lora_rank is null), per head [nope | rope]; kv_a(x) =
    [latent | k_rope]; c = RMS(latent) (kv_a_layernorm, eps 1e-6, as is
    q_a_layernorm); per head k = [W_UK c | k_rope], v = W_UV c from kv_b_proj's
    rows [nope | v] of each head; RoPE on the rope parts only, interleaved pairs
    (x0, x1), (x2, x3), ... when rope_interleave; yarn inv_freq (see
    yarn_inv_freq) and cos/sin times attention_factor; scores times
    qk_head_dim^-0.5 * mscale(factor, mscale_all_dim)^2. MoE layers (from
    first_k_dense_replace): s = sigmoid(router logits); choose by s + bias within
    the topk_group best of n_group groups (group score: sum of its two best);
    weights s (renormalised when norm_topk_prob) * routed_scaling_factor; plus
    the ungated shared_experts MLP.
  * DeepSeek-V2: V3's attention with RoPE always on interleaved pairs; MoE
    p = softmax(router logits); "group_limited_greedy": only the topk_group
    groups with the largest max p keep their experts ("greedy": all); the
    top_k p, not renormalised, times routed_scaling_factor; plus
    shared_experts. No score-correction bias.
  * Gemma-2: x = embed * float32(sqrt(hidden_size)); every RMSNorm multiplies
    by (1 + w); per layer x += post_attention_layernorm(attn(input_layernorm(x)))
    then x += post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)));
    MLP down(gelu_tanh(gate x) * up x); scores scaled by query_pre_attn_scalar^-0.5
    then soft-capped, c * tanh(s / c) with c = attn_logit_softcapping, before the
    mask; sliding_window on the layers whose layer_types entry is
    "sliding_attention"; final logits soft-capped by final_logit_softcapping.
  * Llama-4 (Llama4ForCausalLM; Llama4ForConditionalGeneration: the config's
    text_config and the weights under "language_model."): RoPE on interleaved
    pairs (x0, x1), (x2, x3), ... on the layers whose no_rope_layers entry is 1
    (default: all but every no_rope_layer_interval-th); on those layers q and k
    are then divided per head by sqrt(mean(x^2) + rms_norm_eps) when use_qk_norm,
    and, on "chunked_attention" layers (default: the RoPE layers), key j is
    visible from query i iff j // attention_chunk_size == i // attention_chunk_size.
    On NoPE layers with attn_temperature_tuning, q at position p is multiplied by
    log(1 + floor((p + 1) / floor_scale)) * attn_scale + 1. MoE layers (moe_layers,
    default every interleave_moe_layer_step-th): the top num_experts_per_tok
    router logits; expert e gets sigmoid(logit_e) * x and the outputs are summed;
    experts stored as gate_up_proj [E, hidden, 2 I] (x @ gate_up = [gate | up])
    and down_proj [E, I, hidden]; plus the shared_expert MLP. Dense layers'
    feed_forward is intermediate_size_mlp wide.
  * Gemma-3: Gemma-2's layer, plus per-head q_norm / k_norm ((1 + w), before
    RoPE) as Qwen3's; the attention scores are never soft-capped (transformers'
    Gemma-3 attention ignores attn_logit_softcapping); two RoPEs, by layer type:
    rope_parameters["sliding_attention"] / ["full_attention"] (or the legacy
    rope_local_base_freq, and rope_theta + rope_scaling), linear scaling
    dividing inv_freq by its factor.
  * Granite: Llama's layer with four multipliers from the config (each 1 when
    missing): x = embed * embedding_multiplier; scores scaled by
    attention_multiplier (not head_dim^-0.5); per layer x += attn(...) *
    residual_multiplier and x += mlp(...) * residual_multiplier; logits divided
    by logits_scaling. GraniteMoe: the same around an MoE block whose token
    weights are the softmax of its top num_experts_per_tok router logits
    (block_sparse_moe.router.layer); expert e is input_linear[e] (gate rows,
    then up rows) and output_linear[e] (down). GraniteMoeShared: GraniteMoe's
    block plus an ungated shared expert, shared_mlp.input_linear (gate rows,
    then up rows) and output_linear, added before the residual multiplier.
  * GraniteSWA / GraniteMoeSWA: Granite's / GraniteMoeShared's layer; each
    head's attention output times sigmoid(logsumexp(scores) - sinks[head])
    (GraniteMoeSWA's experts named block_sparse_moe.experts.gate_up_proj and
    down_proj, its router block_sparse_moe.router)
    (self_attn.sinks); sliding_window (default 128) on the layers whose
    layer_types entry is "sliding_attention" (default: all but every fourth,
    from layer 0); layer_rope_theta gives each layer its RoPE theta, 0 = no
    RoPE.
  * SmolLM3: Llama's layer; no RoPE on the layers whose no_rope_layers entry is
    0 (default: every no_rope_layer_interval-th); sliding_window on the layers
    whose layer_types entry is "sliding_attention".
  * GLM-4.5 (Glm4MoeForCausalLM): q/k/v biases (attention_bias; never on o);
    with use_qk_norm, Qwen3's per-head q_norm / k_norm before RoPE; RoPE (rotate_half)
    on the first int(head_dim * partial_rotary_factor) elements of each head
    (default factor 0.5), as Phi-3's; layers from first_k_dense_replace (default 1)
    are DeepSeek-V3's MoE block (sigmoid scores, e_score_correction_bias, groups)
    with Glm4MoeConfig's defaults: n_group 1, topk_group 1, routed_scaling_factor 1.
  * GLM-4 (Glm4ForCausalLM): q/k/v biases (none on o); RoPE on interleaved pairs
    (x0, x1), (x2, x3), ... of each head's first int(head_dim * partial_rotary_factor)
    elements (default factor 0.5), the rest passing through; per layer x +=
    post_self_attn_layernorm(attn(input_layernorm(x))) then x +=
    post_mlp_layernorm(mlp(post_attention_layernorm(x))); gate_up_proj is gate then up.
  * GLM-4.7-Flash (Glm4MoeLiteForCausalLM): DeepSeek-V3's attention (MLA, above) and
    GLM-4.5's MoE block on the layers whose mlp_layer_types entry is "sparse" (the
    checkpoint has a router there), routed_scaling_factor 1.8 by default.
  * GPT-OSS: Llama's layer with q/k/v/o biases and GraniteSWA's sinks; sliding_window
    on the layers whose layer_types entry is "sliding_attention" (default: the even
    ones); YaRN (yarn_inv_freq) with cos and sin times attention_factor on every head
    dim. MoE block: router logits x . W^T + b, the top num_experts_per_tok, weights
    the softmax of the chosen logits; expert e: gu = x . gate_up_proj[e] +
    gate_up_proj_bias[e] (gate_up_proj [hidden, 2 x width], gate = gu[0::2], up =
    gu[1::2]), g = min(gate, 7), u = clip(up, -7, 7), y = (g sigmoid(1.702 g) (u + 1))
    . down_proj[e] + down_proj_bias[e], times its weight. MXFP4 checkpoints
    (quant_method "mxfp4"): see dequantize_mxfp4.
  * tie_word_embeddings: logits = h . embed_tokens^T (no lm_head.weight stored).
  * FP8 checkpoints (quantization_config.quant_method "fp8"): a weight W stored
    F8_E4M3 (e4m3fn: bias 7, 3 mantissa bits, max 448, no infinities, codes
    0x7f/0xff NaN) is value * scale, exactly (float64). With weight_block_size
    [br, bc] the scale of W[i, j] is W_scale_inv[i // br, j // bc] (the last
    block of each dimension may be short); without it, one scale per tensor,
    W_scale_inv or W_scale of shape [], [1] or [1, 1]. Input (activation)
    scales are not used: activations stay in float64 here.
"""

import json
import math
import os
import struct
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def e4m3_values():
    """The 256 float8 e4m3fn codes as float64 (NaN for 0x7f and 0xff)."""
    out = np.empty(256)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exp, man = (code >> 3) & 0xF, code & 0x7
        if exp == 0xF and man == 0x7:
            out[code] = np.nan
        elif exp == 0:
            out[code] = sign * man / 8.0 * 2.0**-6
        else:
            out[code] = sign * (1.0 + man / 8.0) * 2.0 ** (exp - 7)
    return out


E4M3 = e4m3_values()


def read_safetensors(path, dtypes=None):
    """Tensors of one file as float64 arrays (F8_E4M3 as the e4m3 values, unscaled);
    fills `dtypes` (name -> safetensors dtype) when given."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        raw = data[base + a : base + b]
        dt = info["dtype"]
        if dt == "F32":
            arr = np.frombuffer(raw, dtype="<f4")
        elif dt == "F16":
            arr = np.frombuffer(raw, dtype="<f2")
        elif dt == "BF16":
            arr = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        elif dt == "F8_E4M3":
            arr = E4M3[np.frombuffer(raw, dtype=np.uint8)]
        elif dt == "U8":
            arr = np.frombuffer(raw, dtype=np.uint8)
        else:
            raise ValueError(f"unsupported dtype {dt}")
        out[name] = arr.reshape(info["shape"]).astype(np.float64)
        if dtypes is not None:
            dtypes[name] = dt
    return out


def dequantize_fp8(cfg, w, dtypes):
    """Replaces every F8_E4M3 weight of `w` by value * scale (see the module docstring)."""
    fp8 = sorted(n for n, dt in dtypes.items() if dt == "F8_E4M3")
    if not fp8:
        return
    qc = cfg.get("quantization_config") or {}
    if qc.get("quant_method") != "fp8":
        raise ValueError(f"F8_E4M3 tensors but quantization_config is {qc}")
    block = qc.get("weight_block_size")
    for name in fp8:
        x = w[name]
        if np.isnan(x).any():
            raise ValueError(f"{name}: NaN fp8 code")
        if block:
            s = w[name + "_scale_inv"]
            br, bc = block
            want = (-(-x.shape[0] // br), -(-x.shape[1] // bc))
            if s.shape != want:
                raise ValueError(f"{name}_scale_inv: shape {s.shape}, expected {want}")
            scale = np.repeat(np.repeat(s, br, axis=0), bc, axis=1)[: x.shape[0], : x.shape[1]]
        else:
            key = name + "_scale_inv" if name + "_scale_inv" in w else name + "_scale"
            s = w[key]
            if s.size != 1:
                raise ValueError(f"{key}: shape {s.shape}, expected one scale")
            scale = float(s.reshape(-1)[0])
        if not (np.isfinite(s).all() and (s > 0).all()):
            raise ValueError(f"{name}: scales must be finite and > 0")
        w[name] = x * scale


E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def dequantize_mxfp4(cfg, w):
    """Replaces each MXFP4 pair <name>_blocks [experts, out, in/32, 16] (two e2m1 codes a byte, the
    even input in the low nibble) and <name>_scales [experts, out, in/32] (2^(byte - 127) for 32
    inputs) of `w` by <name> as transformers holds it, [experts, in, out]."""
    names = sorted(n[: -len("_blocks")] for n in w if n.endswith("_blocks"))
    if not names:
        return
    if (cfg.get("quantization_config") or {}).get("quant_method") != "mxfp4":
        raise ValueError("_blocks tensors but quantization_config is not mxfp4")
    for name in names:
        blocks = w.pop(name + "_blocks").astype(np.uint8)
        scales = w.pop(name + "_scales").astype(np.int64)
        codes = np.stack([blocks & 15, blocks >> 4], -1).reshape(*blocks.shape[:-1], 32)
        values = E2M1[codes] * np.exp2(scales - 127)[..., None]
        e, out = values.shape[:2]
        w[name] = values.reshape(e, out, -1).transpose(0, 2, 1)


def load_checkpoint(d):
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    idx = os.path.join(d, "model.safetensors.index.json")
    w, dtypes = {}, {}
    if os.path.exists(idx):
        with open(idx) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        for fn in files:
            w.update(read_safetensors(os.path.join(d, fn), dtypes))
    else:
        w = read_safetensors(os.path.join(d, "model.safetensors"), dtypes)
    dequantize_fp8(cfg, w, dtypes)
    dequantize_mxfp4(cfg, w)
    return cfg, w


def rope_params(cfg):
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rp = dict(rp)
    rp.setdefault("rope_type", rp.get("type", "default"))
    theta = rp.get("rope_theta", cfg.get("rope_theta", 10000.0))
    return rp, float(theta)


def llama3_inv_freq(inv_freq, rp):
    factor = rp["factor"]
    lo, hi = rp["low_freq_factor"], rp["high_freq_factor"]
    old = rp["original_max_position_embeddings"]
    low_wl, high_wl = old / lo, old / hi
    out = []
    for f in inv_freq:
        wl = 2 * math.pi / f
        if wl < high_wl:
            out.append(f)
        elif wl > low_wl:
            out.append(f / factor)
        else:
            s = (old / wl - lo) / (hi - lo)
            out.append((1 - s) * f / factor + s * f)
    return np.array(out)


def yarn_inv_freq(theta, dim, rp, max_pos):
    """transformers' _compute_yarn_parameters: (inv_freq, attention_factor)."""
    factor = rp.get("factor") or max_pos / rp["original_max_position_embeddings"]
    orig = rp.get("original_max_position_embeddings", max_pos)

    def mscale(s, m=1.0):
        return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

    af = rp.get("attention_factor")
    if af is None:
        if rp.get("mscale") and rp.get("mscale_all_dim"):
            af = mscale(factor, rp["mscale"]) / mscale(factor, rp["mscale_all_dim"])
        else:
            af = mscale(factor)
    beta_fast, beta_slow = rp.get("beta_fast") or 32, rp.get("beta_slow") or 1

    def corr(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = corr(beta_fast), corr(beta_slow)
    if rp.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extra = 1 - ramp
    return (1 / (factor * pos_freqs)) * (1 - extra) + (1 / pos_freqs) * extra, af


def top_k_softmax(logits, k):
    """(expert, weight) of the k largest logits (ties: the lower index), weighted by the softmax of
    those k: GraniteMoe's and GPT-OSS's routing, which is Mixtral's renormalised softmax."""
    top = np.argsort(-logits, kind="stable")[:k]
    wts = np.exp(logits[top] - logits[top].max())
    return zip(top, wts / wts.sum())


class Model:
    def __init__(self, d=None, cfg=None, w=None):
        """From checkpoint directory d, or from a config.json dict and float64 weights."""
        if d is not None:
            cfg, w = load_checkpoint(d)
        if cfg["architectures"][0] == "Llama4ForConditionalGeneration":
            # The text model: its config nested, its weights prefixed (the vision tower is unused).
            cfg = dict(cfg["text_config"], architectures=["Llama4ForCausalLM"])
            pre = "language_model."
            w = {n[len(pre):]: t for n, t in w.items() if n.startswith(pre)}
        self.cfg, self.w = cfg, w
        c = self.cfg
        self.arch = c["architectures"][0]
        self.H = c["hidden_size"]
        self.nh = c["num_attention_heads"]
        self.nkv = c.get("num_key_value_heads") or self.nh
        self.hd = c.get("head_dim") or self.H // self.nh
        self.eps = c["rms_norm_eps"]
        self.L = c["num_hidden_layers"]
        rp, theta = rope_params(c)
        self.glm4_moe = self.arch == "Glm4MoeForCausalLM"
        self.glm4 = self.arch == "Glm4ForCausalLM"
        default_partial = 0.5 if self.glm4_moe or self.glm4 else 1.0
        self.rot = int(self.hd * rp.get("partial_rotary_factor", c.get("partial_rotary_factor", default_partial)))
        self.mla = self.arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM")
        self.glm4_moe_lite = self.arch == "Glm4MoeLiteForCausalLM"
        self.deepseek_v2 = self.arch == "DeepseekV2ForCausalLM"
        self.gemma = self.arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
        self.gemma3 = self.arch == "Gemma3ForCausalLM"
        self.llama4 = self.arch == "Llama4ForCausalLM"
        self.swa = self.arch in ("GraniteSWAForCausalLM", "GraniteMoeSWAForCausalLM")
        self.granite = self.swa or self.arch in ("GraniteForCausalLM", "GraniteMoeForCausalLM",
                                                 "GraniteMoeSharedForCausalLM")
        self.smollm3 = self.arch == "SmolLM3ForCausalLM"
        self.gpt_oss = self.arch == "GptOssForCausalLM"
        self.rope_layers = [1] * self.L  # Llama-4 and SmolLM3: 0 for a NoPE layer
        if self.llama4 or self.smollm3:
            interval = c.get("no_rope_layer_interval", 4)
            self.rope_layers = c.get("no_rope_layers") or [int((l + 1) % interval != 0) for l in range(self.L)]
        if self.llama4:
            types = c.get("layer_types") or ["chunked_attention" if r else "full_attention" for r in self.rope_layers]
            self.chunk = [c.get("attention_chunk_size", 8192) if t == "chunked_attention" else None for t in types]
            self.moe_layers = c.get("moe_layers")
            if self.moe_layers is None:
                step = c.get("interleave_moe_layer_step", 1)
                self.moe_layers = list(range(step - 1, self.L, step))
        self.scale = (c.get("query_pre_attn_scalar", 256) if self.gemma else self.hd) ** -0.5
        if self.granite:
            self.scale = c.get("attention_multiplier", 1.0)
        self.rope_scale = 1.0
        if self.mla:
            self.hd = c["qk_rope_head_dim"]  # the RoPE width (transformers' head_dim)
        if self.mla:
            self.rot = self.hd
        inv = 1.0 / theta ** (np.arange(0, self.rot, 2, dtype=np.float64) / self.rot)
        self.inv_long, self.cos_scale = None, 1.0
        if rp["rope_type"] == "longrope":
            self.orig = rp.get("original_max_position_embeddings", c.get("original_max_position_embeddings"))
            factor = rp.get("factor") or c["max_position_embeddings"] / self.orig
            af = rp.get("attention_factor")
            if af is None:
                af = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(self.orig))
            self.cos_scale = af
            self.inv_long = inv / np.array(rp["long_factor"], dtype=np.float64)
            inv = inv / np.array(rp["short_factor"], dtype=np.float64)
        elif rp["rope_type"] == "llama3":
            inv = llama3_inv_freq(inv, rp)
        elif rp["rope_type"] == "yarn" and self.mla:
            inv, self.rope_scale = yarn_inv_freq(theta, self.hd, rp, c["max_position_embeddings"])
        elif rp["rope_type"] == "yarn":  # rotate-half heads: cos and sin times attention_factor
            inv, self.cos_scale = yarn_inv_freq(theta, self.rot, rp, c["max_position_embeddings"])
        elif rp["rope_type"] != "default":
            raise ValueError(f"rope_type {rp['rope_type']} not implemented here")
        self.inv_freq = inv
        self.prompt_len = None  # longrope: set by forward
        self.layer_inv_freq = [inv] * self.L
        if self.gemma3:
            self.layer_inv_freq = [self.gemma3_inv_freq(t) for t in c["layer_types"]]
        if self.swa and c.get("layer_rope_theta"):
            if rp["rope_type"] != "default":
                raise ValueError("layer_rope_theta with a scaled RoPE is not implemented here")
            thetas = c["layer_rope_theta"]
            self.rope_layers = [int(t != 0) for t in thetas]
            self.layer_inv_freq = [1.0 / t ** (np.arange(0, self.rot, 2, dtype=np.float64) / self.rot) if t else None
                                   for t in thetas]
        # sliding window per layer
        sw = c.get("sliding_window")
        if self.arch in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM"):
            self.windows = [sw] * self.L
        elif self.gemma or self.smollm3:  # layer_types given (make_golden's configs always have it)
            self.windows = [sw if t == "sliding_attention" else None for t in c["layer_types"]]
        elif self.swa or self.gpt_oss:
            full = (lambda l: l % 2 == 1) if self.gpt_oss else (lambda l: l % 4 == 0)
            types = c.get("layer_types") or ["full_attention" if full(l) else "sliding_attention"
                                             for l in range(self.L)]
            self.windows = [(128 if "sliding_window" not in c else sw) if t == "sliding_attention" else None
                            for t in types]
        else:  # Qwen2 / Qwen2-MoE / Qwen3 / Qwen3-MoE: only with use_sliding_window, per layer_types
            types = c.get("layer_types") or ["full_attention"] * self.L
            use = c.get("use_sliding_window", False)
            self.windows = [sw if (use and t == "sliding_attention") else None for t in types]

    def gemma3_inv_freq(self, layer_type):
        c = self.cfg
        rp = dict((c.get("rope_parameters") or {}).get(layer_type) or {})
        if layer_type == "full_attention":
            rp.update(c.get("rope_scaling") or {})
            rp.setdefault("rope_theta", c.get("rope_theta", 1e6))
        else:
            rp.setdefault("rope_theta", c.get("rope_local_base_freq", 1e4))
        inv = 1.0 / rp["rope_theta"] ** (np.arange(0, self.hd, 2, dtype=np.float64) / self.hd)
        kind = rp.get("rope_type", rp.get("type", "default"))
        if kind == "linear":
            return inv / rp["factor"]
        if kind != "default":
            raise ValueError(f"Gemma-3 rope_type {kind} not implemented here")
        return inv

    def mm(self, x, w):  # every projection's product (Int8Model rounds both sides)
        return x @ w.T

    def lin(self, x, name):
        y = self.mm(x, self.w[name + ".weight"])
        b = self.w.get(name + ".bias")
        return y if b is None else y + b

    def head(self, x, w):
        return self.mm(x, w)

    def rms(self, x, name):
        w = self.w[name + ".weight"] + (1.0 if self.gemma else 0.0)
        return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps)

    def rope(self, x, pos, inv_freq=None):  # x [T, heads, hd]; the first self.rot elements of each head rotate
        inv = np.repeat((self.inv_freq if inv_freq is None else inv_freq)[None, :], len(pos), 0)
        if self.inv_long is not None:  # longrope: per position, as the KV-cache generation rotates it
            n = self.prompt_len
            long_pos = np.where(pos < n, n > self.orig, pos + 1 > self.orig)
            inv[long_pos] = self.inv_long
        ang = pos[:, None] * inv
        cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None, :] * self.cos_scale
        sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None, :] * self.cos_scale
        r, h = self.rot, self.rot // 2
        xr = x[..., :r]
        rot = np.concatenate([-xr[..., h:], xr[..., :h]], -1)
        return np.concatenate([xr * cos + rot * sin, x[..., r:]], -1)

    def qkv(self, x, p):
        if self.arch == "Phi3ForCausalLM":
            qkv = self.lin(x, p + ".qkv_proj")
            nq, nk = self.nh * self.hd, self.nkv * self.hd
            return qkv[:, :nq], qkv[:, nq : nq + nk], qkv[:, nq + nk :]
        return self.lin(x, p + ".q_proj"), self.lin(x, p + ".k_proj"), self.lin(x, p + ".v_proj")

    def rope_pairs(self, x, pos):  # Llama-4: pairs (x0, x1), (x2, x3), ... rotated in place
        ang = pos[:, None] * self.inv_freq[None, :]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = b * cos + a * sin
        return out

    def rope_interleaved(self, x, pos):  # DeepSeek: pairs (x0, x1), (x2, x3), ...; output de-interleaved
        ang = pos[:, None] * self.inv_freq[None, :]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        a, b = x[..., 0::2], x[..., 1::2]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)

    def mla_attention(self, x, l):
        c = self.cfg
        p = f"model.layers.{l}.self_attn"
        T = x.shape[0]
        pos = np.arange(T, dtype=np.float64)
        nope, rope, vd, lat = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
        if c.get("q_lora_rank"):
            qa = self.lin(x, p + ".q_a_proj")
            qa = self.w[p + ".q_a_layernorm.weight"] * qa / np.sqrt(np.mean(qa * qa, -1, keepdims=True) + 1e-6)
            q = self.lin(qa, p + ".q_b_proj")
        else:
            q = self.lin(x, p + ".q_proj")
        q = q.reshape(T, self.nh, nope + rope)
        kva = self.lin(x, p + ".kv_a_proj_with_mqa")
        cl, kr = kva[:, :lat], kva[:, lat:].reshape(T, 1, rope)
        cl = self.w[p + ".kv_a_layernorm.weight"] * cl / np.sqrt(np.mean(cl * cl, -1, keepdims=True) + 1e-6)
        # V2 always rotates interleaved pairs (its config has no rope_interleave switch).
        rot = self.rope_interleaved if self.deepseek_v2 or c.get("rope_interleave", True) else self.rope
        q_rot = rot(q[..., nope:], pos) * self.rope_scale
        k_rot = rot(kr, pos) * self.rope_scale
        kv = (cl @ self.w[p + ".kv_b_proj.weight"].T).reshape(T, self.nh, nope + vd)
        qk = nope + rope
        scale = qk**-0.5
        rp, _ = rope_params(c)
        if rp["rope_type"] != "default" and rp.get("mscale_all_dim"):
            m = 0.1 * rp["mscale_all_dim"] * math.log(rp["factor"]) + 1.0
            scale *= m * m
        visible = np.arange(T)[None, :] <= np.arange(T)[:, None]
        out = np.zeros((T, self.nh, vd))
        for h in range(self.nh):
            qh = np.concatenate([q[:, h, :nope], q_rot[:, h]], -1)
            kh = np.concatenate([kv[:, h, :nope], k_rot[:, 0]], -1)
            s_ = np.where(visible, (qh @ kh.T) * scale, -np.inf)
            s_ = np.exp(s_ - s_.max(-1, keepdims=True))
            s_ /= s_.sum(-1, keepdims=True)
            out[:, h, :] = s_ @ kv[:, h, nope:]
        return self.lin(out.reshape(T, -1), p + ".o_proj")

    def deepseek_moe(self, x, m):
        c = self.cfg
        if self.deepseek_v2:
            return self.deepseek_v2_moe(x, m)
        n_exp, k = c["n_routed_experts"], c["num_experts_per_tok"]
        glm = self.glm4_moe or self.glm4_moe_lite
        ng, kg = c.get("n_group", 1 if glm else 8), c.get("topk_group", 1 if glm else 4)
        scaling = c.get("routed_scaling_factor", 1.8 if self.glm4_moe_lite else 1.0 if self.glm4_moe else 2.5)
        s_all = 1 / (1 + np.exp(-(x @ self.w[m + ".gate.weight"].T)))
        biased_all = s_all + self.w[m + ".gate.e_score_correction_bias"]
        out = np.zeros_like(x)
        for t in range(x.shape[0]):
            biased = biased_all[t].copy()
            groups = biased.reshape(ng, -1)
            gscore = np.sort(groups, -1)[:, -2:].sum(-1)
            keep = np.argsort(-gscore, kind="stable")[:kg]
            mask = np.full(ng, False)
            mask[keep] = True
            biased[~np.repeat(mask, n_exp // ng)] = -np.inf
            top = np.argsort(-biased, kind="stable")[:k]
            wts = s_all[t, top]
            if c.get("norm_topk_prob", True):
                wts = wts / (wts.sum() + 1e-20)
            wts = wts * scaling
            for e, wt in zip(top, wts):
                ep = m + f".experts.{e}"
                out[t] += wt * self.swiglu(x[t : t + 1], self.w[ep + ".gate_proj.weight"],
                                           self.w[ep + ".up_proj.weight"], self.w[ep + ".down_proj.weight"])[0]
        s = m + ".shared_experts"
        return out + self.swiglu(x, self.w[s + ".gate_proj.weight"], self.w[s + ".up_proj.weight"],
                                 self.w[s + ".down_proj.weight"])

    def deepseek_v2_moe(self, x, m):
        c = self.cfg
        n_exp, k = c["n_routed_experts"], c["num_experts_per_tok"]
        logits = x @ self.w[m + ".gate.weight"].T
        p_all = np.exp(logits - logits.max(-1, keepdims=True))
        p_all /= p_all.sum(-1, keepdims=True)
        out = np.zeros_like(x)
        for t in range(x.shape[0]):
            p = p_all[t].copy()
            if c.get("topk_method", "greedy") == "group_limited_greedy":
                ng, kg = c["n_group"], c["topk_group"]
                keep = np.argsort(-p.reshape(ng, -1).max(-1), kind="stable")[:kg]
                mask = np.full(ng, False)
                mask[keep] = True
                p[~np.repeat(mask, n_exp // ng)] = 0.0
            top = np.argsort(-p, kind="stable")[:k]
            for e in top:
                ep = m + f".experts.{e}"
                out[t] += p[e] * c.get("routed_scaling_factor", 1.0) * self.swiglu(
                    x[t : t + 1], self.w[ep + ".gate_proj.weight"], self.w[ep + ".up_proj.weight"],
                    self.w[ep + ".down_proj.weight"])[0]
        s = m + ".shared_experts"
        return out + self.swiglu(x, self.w[s + ".gate_proj.weight"], self.w[s + ".up_proj.weight"],
                                 self.w[s + ".down_proj.weight"])

    def attention(self, x, l):
        if self.mla:
            return self.mla_attention(x, l)
        p = f"model.layers.{l}.self_attn"
        T = x.shape[0]
        pos = np.arange(T, dtype=np.float64)
        q, k, v = self.qkv(x, p)
        q = q.reshape(T, self.nh, self.hd)
        k = k.reshape(T, self.nkv, self.hd)
        v = v.reshape(T, self.nkv, self.hd)
        qk_norm = self.arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM")
        if qk_norm or (self.glm4_moe and self.cfg.get("use_qk_norm", False)):
            q = self.rms(q, p + ".q_norm")  # per head: the mean runs over head_dim
            k = self.rms(k, p + ".k_norm")
        i = np.arange(T)[:, None]
        j = np.arange(T)[None, :]
        visible = j <= i
        if self.llama4:
            c = self.cfg
            if self.rope_layers[l]:
                q, k = self.rope_pairs(q, pos), self.rope_pairs(k, pos)
                if c.get("use_qk_norm", True):
                    q = q / np.sqrt(np.mean(q * q, -1, keepdims=True) + self.eps)
                    k = k / np.sqrt(np.mean(k * k, -1, keepdims=True) + self.eps)
            elif c.get("attn_temperature_tuning", True):
                temp = np.log1p(np.floor((pos + 1) / c.get("floor_scale", 8192))) * c.get("attn_scale", 0.1) + 1
                q = q * temp[:, None, None]
            if self.chunk[l] is not None:
                visible &= (j // self.chunk[l]) == (i // self.chunk[l])
        elif self.glm4:  # interleaved pairs over the rotated part
            r = self.rot
            q = np.concatenate([self.rope_pairs(q[..., :r], pos), q[..., r:]], -1)
            k = np.concatenate([self.rope_pairs(k[..., :r], pos), k[..., r:]], -1)
        elif self.rope_layers[l]:  # SmolLM3's NoPE layers: no rotation
            q = self.rope(q, pos, self.layer_inv_freq[l])
            k = self.rope(k, pos, self.layer_inv_freq[l])
        if self.windows[l] is not None:
            visible &= (i - j) < self.windows[l]
        group = self.nh // self.nkv
        out = np.zeros((T, self.nh, self.hd))
        for h in range(self.nh):
            kv = h // group
            s = (q[:, h, :] @ k[:, kv, :].T) * self.scale
            cap = self.cfg.get("attn_logit_softcapping") if self.gemma and not self.gemma3 else None
            if cap:
                s = cap * np.tanh(s / cap)
            s = np.where(visible, s, -np.inf)
            top = s.max(-1, keepdims=True)
            s = np.exp(s - top)
            total = s.sum(-1, keepdims=True)
            s /= total
            out[:, h, :] = s @ v[:, kv, :]
            if self.swa or self.gpt_oss:  # the sink: sigmoid(logsumexp(scores) - sink), as transformers' eager path
                lse = (top + np.log(total))[:, 0]
                out[:, h, :] *= (1.0 / (1.0 + np.exp(-(lse - self.w[p + ".sinks"][h]))))[:, None]
        return self.lin(out.reshape(T, -1), p + ".o_proj")

    def swiglu(self, x, gate, up, down):
        g = self.mm(x, gate)
        if self.gemma:  # gelu_pytorch_tanh
            act = 0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)))
        else:
            act = g / (1 + np.exp(-g))
        return self.mm(act * self.mm(x, up), down)

    def mlp(self, x, l):
        p = f"model.layers.{l}"
        c = self.cfg
        if self.arch == "MixtralForCausalLM":
            m = p + ".block_sparse_moe"
            return self.moe(x, m + ".gate.weight", c["num_local_experts"], c["num_experts_per_tok"], True,
                            lambda e: (m + f".experts.{e}.w1.weight", m + f".experts.{e}.w3.weight",
                                       m + f".experts.{e}.w2.weight"))
        if self.arch == "Qwen2MoeForCausalLM" and (p + ".mlp.gate.weight") in self.w:
            m = p + ".mlp"
            y = self.moe(x, m + ".gate.weight", c["num_experts"], c["num_experts_per_tok"], c["norm_topk_prob"],
                         lambda e: (m + f".experts.{e}.gate_proj.weight", m + f".experts.{e}.up_proj.weight",
                                    m + f".experts.{e}.down_proj.weight"))
            s = m + ".shared_expert"
            shared = self.swiglu(x, self.w[s + ".gate_proj.weight"], self.w[s + ".up_proj.weight"],
                                 self.w[s + ".down_proj.weight"])
            g = x @ self.w[m + ".shared_expert_gate.weight"].T  # [T, 1]
            return y + shared / (1 + np.exp(-g))
        if self.arch == "Qwen3MoeForCausalLM" and (p + ".mlp.gate.weight") in self.w:
            m = p + ".mlp"
            n_exp = c.get("num_experts", c.get("num_local_experts"))
            return self.moe(x, m + ".gate.weight", n_exp, c["num_experts_per_tok"], c["norm_topk_prob"],
                            lambda e: (m + f".experts.{e}.gate_proj.weight", m + f".experts.{e}.up_proj.weight",
                                       m + f".experts.{e}.down_proj.weight"))
        if (self.mla or self.glm4_moe) and (p + ".mlp.gate.weight") in self.w:
            return self.deepseek_moe(x, p + ".mlp")
        if self.llama4:
            return self.llama4_ffn(x, l)
        if self.arch == "GraniteMoeForCausalLM":
            return self.granite_moe(x, p + ".block_sparse_moe")
        if self.gpt_oss:
            return self.gpt_oss_moe(x, p + ".mlp")
        if self.arch in ("GraniteMoeSharedForCausalLM", "GraniteMoeSWAForCausalLM"):
            y = self.granite_moe(x, p + ".block_sparse_moe")
            if self.cfg.get("shared_intermediate_size", 0) == 0:
                return y
            gu, down = self.w[p + ".shared_mlp.input_linear.weight"], self.w[p + ".shared_mlp.output_linear.weight"]
            n = gu.shape[0] // 2
            return y + self.swiglu(x, gu[:n], gu[n:], down)
        m = p + ".mlp"
        if self.arch in ("Phi3ForCausalLM", "Glm4ForCausalLM"):
            gu = self.w[m + ".gate_up_proj.weight"]
            n = gu.shape[0] // 2
            return self.swiglu(x, gu[:n], gu[n:], self.w[m + ".down_proj.weight"])
        return self.swiglu(x, self.w[m + ".gate_proj.weight"], self.w[m + ".up_proj.weight"],
                           self.w[m + ".down_proj.weight"])

    def granite_moe(self, x, m):
        # GraniteMoe: the softmax of each token's top-k router logits weights its experts; expert e
        # is input_linear[e] = [gate; up] and output_linear[e] = down, as nn.Linear holds them.
        if self.swa:  # transformers 5's names (it keeps the older ones for GraniteMoe's checkpoints)
            gu, down = self.w[m + ".experts.gate_up_proj"], self.w[m + ".experts.down_proj"]
            router = self.w[m + ".router.weight"]
        else:
            gu, down = self.w[m + ".input_linear.weight"], self.w[m + ".output_linear.weight"]
            router = self.w[m + ".router.layer.weight"]
        width = down.shape[2]
        logits = x @ router.T
        k = self.cfg.get("num_experts_per_tok", 2)
        out = np.zeros_like(x)
        for t in range(x.shape[0]):
            for e, wt in top_k_softmax(logits[t], k):
                out[t] += wt * self.swiglu(x[t : t + 1], gu[e, :width], gu[e, width:], down[e])[0]
        return out

    def gpt_oss_moe(self, x, m):
        gu, gub = self.w[m + ".experts.gate_up_proj"], self.w[m + ".experts.gate_up_proj_bias"]
        down, db = self.w[m + ".experts.down_proj"], self.w[m + ".experts.down_proj_bias"]
        logits = x @ self.w[m + ".router.weight"].T + self.w[m + ".router.bias"]  # never int8
        k = self.cfg.get("num_experts_per_tok", 4)
        out = np.zeros_like(x)
        for t in range(x.shape[0]):
            for e, wt in top_k_softmax(logits[t], k):
                h = self.mm(x[t : t + 1], gu[e].T) + gub[e]
                g = np.minimum(h[:, 0::2], 7.0)
                u = np.clip(h[:, 1::2], -7.0, 7.0)
                act = g / (1 + np.exp(-1.702 * g)) * (u + 1)
                out[t] += wt * (self.mm(act, down[e].T) + db[e])[0]
        return out

    def llama4_ffn(self, x, l):
        f = f"model.layers.{l}.feed_forward"
        if l not in self.moe_layers:
            return self.swiglu(x, self.w[f + ".gate_proj.weight"], self.w[f + ".up_proj.weight"],
                               self.w[f + ".down_proj.weight"])
        k = self.cfg.get("num_experts_per_tok", 1)
        logits = x @ self.w[f + ".router.weight"].T
        gate_up, down = self.w[f + ".experts.gate_up_proj"], self.w[f + ".experts.down_proj"]
        n = gate_up.shape[2] // 2
        out = self.swiglu(x, self.w[f + ".shared_expert.gate_proj.weight"], self.w[f + ".shared_expert.up_proj.weight"],
                          self.w[f + ".shared_expert.down_proj.weight"])
        for t in range(x.shape[0]):
            for e in np.argsort(-logits[t], kind="stable")[:k]:
                xe = x[t : t + 1] / (1 + np.exp(-logits[t, e]))
                out[t] += self.swiglu(xe, gate_up[e][:, :n].T, gate_up[e][:, n:].T, down[e].T)[0]
        return out

    def moe(self, x, gate_name, n_exp, k, renorm, names):
        logits = x @ self.w[gate_name].T
        pr = np.exp(logits - logits.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        out = np.zeros_like(x)
        for t in range(x.shape[0]):
            top = np.argsort(-pr[t], kind="stable")[:k]
            wts = pr[t, top]
            if renorm:
                wts = wts / wts.sum()
            for e, wt in zip(top, wts):
                g, u, d = names(e)
                out[t] += wt * self.swiglu(x[t : t + 1], self.w[g], self.w[u], self.w[d])[0]
        return out

    def forward(self, ids, prompt_len=None):
        """Logits at every position of ids; prompt_len (default: all of ids) is the part of ids
        that the KV-cache generation would have processed in its first forward (longrope)."""
        self.prompt_len = len(ids) if prompt_len is None else prompt_len
        x = self.w["model.embed_tokens.weight"][np.array(ids)]
        if self.gemma:
            x = x * float(np.float32(self.H**0.5))  # float32 checkpoints: the multiplier in float32
        residual = 1.0
        if self.granite:
            x = x * self.cfg.get("embedding_multiplier", 1.0)
            residual = self.cfg.get("residual_multiplier", 1.0)
        for l in range(self.L):
            p = f"model.layers.{l}"
            if self.gemma:
                x = x + self.rms(self.attention(self.rms(x, p + ".input_layernorm"), l), p + ".post_attention_layernorm")
                x = x + self.rms(self.mlp(self.rms(x, p + ".pre_feedforward_layernorm"), l),
                                 p + ".post_feedforward_layernorm")
                continue
            if self.glm4:
                x = x + self.rms(self.attention(self.rms(x, p + ".input_layernorm"), l), p + ".post_self_attn_layernorm")
                x = x + self.rms(self.mlp(self.rms(x, p + ".post_attention_layernorm"), l), p + ".post_mlp_layernorm")
                continue
            x = x + self.attention(self.rms(x, p + ".input_layernorm"), l) * residual
            x = x + self.mlp(self.rms(x, p + ".post_attention_layernorm"), l) * residual
        x = self.rms(x, "model.norm")
        head = self.w.get("lm_head.weight")
        if head is None:
            head = self.w["model.embed_tokens.weight"]
        logits = self.head(x, head)
        if self.granite:
            logits = logits / self.cfg.get("logits_scaling", 1.0)
        cap = self.cfg.get("final_logit_softcapping") if self.gemma else None
        return cap * np.tanh(logits / cap) if cap else logits


def block_int8(a, block=64):
    """a rounded as block int8 stores it: per row, each block of 64 values as round(v / s) * s with
    s = max|v| / 127 (the engine's --quantize=int8 for weights and for the activations entering
    each projection)."""
    rows = a.reshape(-1, a.shape[-1])
    out = np.empty_like(rows)
    for b in range(0, rows.shape[1], block):
        part = rows[:, b : b + block]
        s = np.abs(part).max(-1, keepdims=True) / 127.0
        s[s == 0] = 1.0
        out[:, b : b + block] = np.round(part / s) * s
    return out.reshape(a.shape)


class Int8Model(Model):
    """The same forward pass with the operands of every projection and of the lm_head (tied or
    not) block-int8 rounded: an estimate, independent of the engine, of how far int8 weights move
    a fixture's logits (its activation blocks follow the projection's input, not the engine's
    kernel layout; routers and the attention products stay exact, as in the engine)."""

    def __init__(self, d):
        super().__init__(d)
        self.rounded = {}  # id(weight) -> (weight, its rounding)

    def mm(self, x, w):
        if id(w) not in self.rounded:
            self.rounded[id(w)] = (w, block_int8(w))
        return block_int8(x) @ self.rounded[id(w)][1].T


def int8_error(d):
    """Largest |logit_int8 - logit| / max|logit| over the prompt positions of reference.json."""
    with open(os.path.join(d, "reference.json")) as f:
        ref = json.load(f)
    exact, rounded = Model(d), Int8Model(d)
    worst = 0.0
    for case in ref["cases"]:
        a, b = exact.forward(list(case["prompt_ids"])), rounded.forward(list(case["prompt_ids"]))
        worst = max(worst, float((np.abs(a - b).max(-1) / np.abs(a).max(-1)).max()))
    print(f"{ref['model']:28s} int8 max |logit change| / max|logit| = {worst:.4f}")


def check(d):
    ref_path = os.path.join(d, "reference.json")
    with open(ref_path) as f:
        ref = json.load(f)
    m = Model(d)
    worst, ok = 0.0, True
    for case in ref["cases"]:
        ids = list(case["prompt_ids"])
        logits = m.forward(ids)
        ref_logits = np.array(case["logits"])
        worst = max(worst, float(np.abs(logits - ref_logits).max()))
        n = len(case["greedy_ids"])
        for _ in range(n):
            ids.append(int(np.argmax(m.forward(ids, len(case["prompt_ids"]))[-1])))
        got = ids[len(case["prompt_ids"]) :]
        if got != case["greedy_ids"]:
            ok = False
            first = next(i for i, (a, b) in enumerate(zip(got, case["greedy_ids"])) if a != b)
            print(f"  {ref['model']}: greedy differs at step {first}: {got} vs {case['greedy_ids']}")
    print(f"{ref['model']:28s} max |logit - ref| = {worst:.3g}  greedy {'OK' if ok else 'MISMATCH'}")
    return ok and worst < 1e-3


def main():
    args = sys.argv[1:]
    int8 = "--int8" in args
    dirs = [a for a in args if a != "--int8"]
    if not dirs:
        root = os.path.join(HERE, "models")
        dirs = [os.path.join(root, n) for n in sorted(os.listdir(root))]
    if int8:
        for d in dirs:
            int8_error(d)
        return
    ok = all([check(d) for d in dirs])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
