"""Qwen3 (dense) and Qwen3-MoE causal language models built from `minite.nn`.

Per decoder layer: `h = x + o_proj(attn(rope(q_norm(q)), rope(k_norm(k)), v))` on `input_layernorm(x)`,
then `out = h + mlp(post_attention_layernorm(h))`, where `mlp` is a SwiGLU MLP
`down(silu(gate(x)) * up(x))` or, in MoE layers, top-k routed SwiGLU experts. After the last layer a
final RMSNorm and the LM head (tied to the embedding or not) give the logits.

One forward for every engine: `forward(input_ids, context=...)` runs the layers under a per-step
`minite.nn.context.ForwardContext` (positions, the attention backend, the KV cache and its slots,
the rows to output). Without one it makes the full-sequence context of `input_ids` (with
`position_ids` / `cu_seqlens`): the learner's and the diagnostics' forward; the sampler's runner
passes its cached step's. `activation_checkpointing=True` keeps only each layer's input under
autograd and recomputes the layer in the backward.

Numerics: every projection of attention, MLP and experts is a recipe-driven `minite.nn.Linear`:
q|k|v and gate|up as one `SegmentedLinear` each (each segment quantized as its own tensor, the outputs
of separate linears), the experts their grouped equivalent; embedding, LM head, router and norms are
never quantized. The recipe's `bf16_first_layers` / `bf16_last_layers` keep those decoder layers
unquantized. `set_recipe` switches every layer. How everything executes (kernels or reference, fast
paths) is the recipe's `execution` (`minite.execution`), read by every op of the forward. Parameter
names follow Hugging Face's (without the `model.` prefix) except the segmented projections
(`self_attn.qkv_proj`, `mlp.gate_up_proj`) and the experts' fused 3D tensors, which
`minite.models.checkpoint` maps to Hugging Face's tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from minite.models.config import ModelConfig
from minite.nn.attention import Attention
from minite.nn.context import ForwardContext, sequence_context
from minite.nn.forward_scope import forward_scope, in_scope
from minite.nn.linear import Linear, SegmentedLinear
from minite.nn.moe import MoEExperts
from minite.nn.norm import RMSNorm
from minite.nn.swiglu import swiglu_quantized
from minite.recipe import Recipe, get_recipe


class MLP(nn.Module):
    """SwiGLU feed-forward block: `down(silu(gate(x)) * up(x))`, gate|up one segmented projection."""

    def __init__(self, hidden_size: int, intermediate_size: int, recipe):
        super().__init__()
        widths = (intermediate_size, intermediate_size)
        self.gate_up_proj = SegmentedLinear(hidden_size, widths, recipe=recipe)
        self.down_proj = Linear(intermediate_size, hidden_size, recipe=recipe)

    def forward(self, x: torch.Tensor, quantized=None) -> torch.Tensor:
        """`quantized`: x's quantization, handed over by the norm before."""
        gate, up = self.gate_up_proj(x, quantized)
        h, hq = swiglu_quantized(gate, up, self.down_proj.recipe)  # h quantized for down in the same launch
        return self.down_proj(h, hq)


class DecoderLayer(nn.Module):
    """Pre-norm attention block followed by a pre-norm MLP or MoE block, both residual."""

    def __init__(self, config: ModelConfig, layer: int, recipe: Recipe):
        super().__init__()
        self.is_moe = config.is_moe_layer(layer)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                                   config.head_dim, config.rope_theta, config.rms_norm_eps, recipe,
                                   layer_index=layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if self.is_moe:
            self.mlp = MoEExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size,
                                  config.num_experts_per_tok, recipe, norm_topk_prob=config.norm_topk_prob)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size, recipe)

    def quantizable_modules(self) -> list[nn.Module]:
        """The modules that follow the recipe: attention and MLP projections, or the MoE experts
        (whose router stays bf16)."""
        attn = self.self_attn
        mlp = [self.mlp] if self.is_moe else [self.mlp.gate_up_proj, self.mlp.down_proj]
        return [attn.qkv_proj, attn.o_proj, *mlp]

    def forward(self, x: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        """x `[B, T, H]` (or `[N, H]`, a cached step's new tokens) -> the same shape. The norms also
        quantize their output for the NVFP4 projection that reads it and hand it over (`xq`, `yq`; None
        where they do not); in MoE layers the router reads the bf16 output and the experts each token's
        quantized row. The residual adds run inside the post-attention norm and the MoE combine
        (torch's add's bits)."""
        qkv = self.self_attn.qkv_proj.recipe
        xn, xq = self.input_layernorm(x, qkv.execution, quantize_for=qkv)
        mlp = self.mlp.recipe if self.is_moe else self.mlp.gate_up_proj.recipe
        # h = x + attention, added by the norm that reads h (one launch in the sampler)
        h, (y, yq) = self.post_attention_layernorm(self.self_attn(xn, context, xq), mlp.execution,
                                                   quantize_for=mlp, residual=x)
        if self.is_moe:  # h added by the experts' combine
            return self.mlp(y.reshape(-1, y.shape[-1]), quantized=yq, residual=h).view_as(y)
        return h + self.mlp(y, yq)


class Qwen3(nn.Module):
    """Qwen3 / Qwen3-MoE causal LM: `forward(input_ids [B, T]) -> logits [B, T, V]`."""

    def __init__(self, config: ModelConfig, recipe: str | Recipe = "aligned"):
        super().__init__()
        self.config = config
        self.recipe = get_recipe(recipe)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, self.layer_recipe(i)) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def layer_recipe(self, layer: int, recipe: Recipe | None = None) -> Recipe:
        """The recipe decoder layer `layer` runs under: bf16 in the first/last N layers the recipe exempts."""
        recipe = self.recipe if recipe is None else recipe
        n = self.config.num_hidden_layers
        if layer < recipe.bf16_first_layers or layer >= n - recipe.bf16_last_layers:
            return get_recipe("bf16", execution=recipe.execution)
        return recipe

    def set_recipe(self, recipe: str | Recipe) -> None:
        """Run every quantizable layer under `recipe` from now on (weights are not touched)."""
        self.recipe = get_recipe(recipe)
        for i, layer in enumerate(self.layers):
            for module in layer.quantizable_modules():
                module.set_recipe(self.layer_recipe(i))

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                      cu_seqlens: torch.Tensor | None = None, check: bool = True, *,
                      context: ForwardContext | None = None,
                      activation_checkpointing: bool = False) -> torch.Tensor:
        """Final-norm hidden states `[B, T, H]` (the LM head's input), or of `context.output_rows`.
        Without `context`: the forward over whole sequences of `minite.nn.context.sequence_context`
        (`[B, T]`, or `[1, N]` packed with `cu_seqlens`; `check` as there)."""
        if context is None:
            context = sequence_context(input_ids, position_ids, cu_seqlens, check, self.recipe.execution,
                                       self.recipe.kv_cache)
        elif position_ids is not None or cu_seqlens is not None:
            raise ValueError("position_ids / cu_seqlens make a full-sequence context: give them or `context`")
        checkpointed = activation_checkpointing and torch.is_grad_enabled()
        x = self.embed_tokens(input_ids)  # [B, T, H] ([N, H] for a cached step)
        with forward_scope():  # one cos/sin table per positions tensor for every layer
            for layer in self.layers:
                if checkpointed:
                    x = checkpoint(_layer_in_scope, layer, x, context, use_reentrant=False)
                else:
                    x = layer(x, context)
        if context.output_rows is not None:
            x = x[context.output_rows]
        return self.norm(x, self.recipe.execution)

    def lm_head_weight(self) -> torch.Tensor:
        """The `[V, H]` output projection (the embedding matrix when tied)."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[..., H]` -> `[..., V]` through the (unquantized) LM head."""
        return F.linear(hidden, self.lm_head_weight())

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, *, context: ForwardContext | None = None,
                activation_checkpointing: bool = False) -> torch.Tensor:
        """input_ids `[B, T]` -> logits `[B, T, V]` in the model's dtype (of the context's output rows
        when it names them); the arguments as in `hidden_states`."""
        return self.logits(self.hidden_states(input_ids, position_ids, cu_seqlens, context=context,
                                              activation_checkpointing=activation_checkpointing))

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """Random weights for tests and benchmarks: N(0, std) matrices, ones for the norms; a segmented
        projection's segments drawn one after the other (the draws of separate projections). Draws run
        on each parameter's device; a generator on another device seeds one there (so a GPU model never
        draws its billions of values on the CPU)."""
        init_parameters(self, std, generator)


@torch.no_grad()
def init_parameters(module: nn.Module, std: float = 0.02, generator: torch.Generator | None = None,
                    prefix: str = "", local: dict | None = None) -> None:
    """`Qwen3.init_weights` on `module`, the model or one of its parts named `prefix` in it; `local`
    holds the generators seeded on other devices: shared by the calls over a model's parts in order,
    they draw what `init_weights` on the whole model draws."""
    local = {} if local is None else local
    segments = {f"{name}.weight": m.segments() for name, m in module.named_modules(prefix=prefix)
                if isinstance(m, SegmentedLinear)}
    for name, param in module.named_parameters(prefix=prefix):
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        g = generator
        if g is not None and g.device.type != param.device.type:
            if param.device not in local:
                local[param.device] = torch.Generator(param.device).manual_seed(g.initial_seed())
            g = local[param.device]
        for part in segments.get(name, [param]):
            part.copy_(torch.randn(part.shape, generator=g, device=part.device) * std)


def _layer_in_scope(layer: DecoderLayer, x: torch.Tensor, context: ForwardContext) -> torch.Tensor:
    """A checkpointed layer: its recompute in the backward runs outside the forward's scope, so it
    opens its own (the context, and with it the attention layout, is the forward's)."""
    if in_scope():
        return layer(x, context)
    with forward_scope():
        return layer(x, context)
