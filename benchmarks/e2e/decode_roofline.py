"""The roofline of one rollout decode step: the bytes it must read and the FLOPs it must do, against the
H200's measured ceilings (`benchmarks.common`: HBM copy rate, cuBLAS bf16 peak; docs/facts.md).

A decode step of B sequences at mean context c (one new token each):
- linear layers and the LM head: every weight a step touches read once in its storage format (bf16:
  2 B a weight; NVFP4: 0.5 B of codes + 1/16 B of E4M3 block scales), 2 * B FLOPs per weight used
  (MoE: the k routed experts of each token; the experts read are the distinct ones the batch routes
  to, E * (1 - (1 - k / E)^B) expected);
- attention: the KV cache of every sequence read once in its format, 4 * c * head_dim FLOPs per query
  head and token;
- the logits: written in bf16 and read back once by the sampler.

`roofline_ms` is the sum over those three parts of max(bytes / bandwidth, FLOPs / peak): the step's
kernels run one after another, so each part is bound on its own. `overlap_ms`, max(all bytes /
bandwidth, all FLOPs / peak), is the looser bound of a step whose parts overlapped perfectly.
"""

from __future__ import annotations

from benchmarks.common import CUBLAS_BF16_TFLOPS, HBM_COPY_TBPS

# bytes per element of each storage format (NVFP4: codes and E4M3 scales of 16-element blocks)
WEIGHT_BYTES = {"bf16": 2.0, "nvfp4": 0.5 + 1 / 16}
# the KV formats: bytes per element, plus fp32 scale bytes per (token, kv head) of K and of V
KV_BYTES = {"bf16": (2.0, 0), "fp8": (1.0, 4), "nvfp4": (0.5 + 1 / 16, 4)}


def linear_params(config) -> tuple[float, float]:
    """(weights a decode step of one token uses, weights stored) over the decoder layers' linears."""
    h, d = config.hidden_size, config.head_dim
    attn = h * d * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    if config.is_moe:
        expert = 3 * h * config.moe_intermediate_size
        used, stored = config.num_experts_per_tok * expert, config.num_experts * expert
    else:
        used = stored = 3 * h * config.intermediate_size
    layers = config.num_hidden_layers
    return layers * (attn + used), layers * (attn + stored)


def decode_step(config, batch: int, context: float, weight_format: str = "bf16", kv_format: str = "bf16",
                tbps: float = HBM_COPY_TBPS, tflops: float = CUBLAS_BF16_TFLOPS) -> dict:
    """Bytes, FLOPs and the roofline times (ms) of a decode step of `batch` sequences at mean `context`."""
    h, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    wb = WEIGHT_BYTES[weight_format]
    used, _ = linear_params(config)
    attn = h * config.head_dim * (2 * config.num_attention_heads + 2 * config.num_key_value_heads) * layers
    if config.is_moe:
        e, k = config.num_experts, config.num_experts_per_tok
        expert = 3 * h * config.moe_intermediate_size
        read = attn + layers * expert * e * (1 - (1 - k / e) ** batch)
        router = layers * h * e * 2.0  # bf16
    else:
        read, router = used, 0.0
    head = vocab * h * 2.0  # bf16 LM head (tied or not, read once)
    gemm_bytes = read * wb + router + head
    gemm_flops = 2.0 * batch * (used + (config.num_experts * h * layers if config.is_moe else 0) + vocab * h)
    elt, scale = KV_BYTES[kv_format]
    per_token = layers * 2 * config.num_key_value_heads * (config.head_dim * elt + scale)
    kv_bytes = batch * context * per_token
    attn_flops = 4.0 * batch * context * config.head_dim * config.num_attention_heads * layers
    logit_bytes = batch * vocab * 2.0 * 2
    bw, peak = tbps * 1e12, tflops * 1e12
    parts = dict(gemm=max(gemm_bytes / bw, gemm_flops / peak),
                 attention=max(kv_bytes / bw, attn_flops / peak), logits=logit_bytes / bw)
    total_bytes, total_flops = gemm_bytes + kv_bytes + logit_bytes, gemm_flops + attn_flops
    return dict(weight_gb=gemm_bytes / 1e9, kv_gb=kv_bytes / 1e9, tflop=total_flops / 1e12,
                roofline_ms=1e3 * sum(parts.values()),
                overlap_ms=1e3 * max(total_bytes / bw, total_flops / peak),
                **{f"{p}_roofline_ms": 1e3 * t for p, t in parts.items()})
