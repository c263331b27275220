"""Qwen3 (dense) and Qwen3-MoE causal language models built from `minite.nn`.

Per decoder layer: `h = x + o_proj(attn(rope(q_norm(q)), rope(k_norm(k)), v))` on `input_layernorm(x)`,
then `out = h + mlp(post_attention_layernorm(h))`, where `mlp` is a SwiGLU MLP
`down(silu(gate(x)) * up(x))` or, in MoE layers, top-k routed SwiGLU experts. After the last layer a
final RMSNorm and the LM head (tied to the embedding or not) give the logits.

Numerics: every projection of attention, MLP and experts is a recipe-driven `minite.nn.Linear` (or
the experts' grouped equivalent); embedding, LM head, router and norms are never quantized. The
recipe's `bf16_first_layers` / `bf16_last_layers` keep those decoder layers unquantized.
`set_recipe` switches every layer. Parameter names follow Hugging Face's (without the `model.`
prefix), so checkpoints map one to one except the experts' fused 3D tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minite.models.config import ModelConfig
from minite.nn.attention import Attention, packed_layout
from minite.nn.forward_scope import forward_scope
from minite.nn.fused_projections import project
from minite.nn.linear import Linear
from minite.nn.moe import MoEExperts
from minite.nn.norm import RMSNorm
from minite.nn.swiglu import swiglu
from minite.recipe import Recipe, get_recipe


class MLP(nn.Module):
    """SwiGLU feed-forward block: `down(silu(gate(x)) * up(x))`."""

    def __init__(self, hidden_size: int, intermediate_size: int, recipe):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, recipe=recipe)
        self.up_proj = Linear(hidden_size, intermediate_size, recipe=recipe)
        self.down_proj = Linear(intermediate_size, hidden_size, recipe=recipe)

    def fused_projection_groups(self) -> list[tuple]:
        """The linears run as one GEMM where they can (`minite.nn.fused_projections`)."""
        return [(self.gate_proj, self.up_proj)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(x, self.fused_projection_groups()[0], self)
        return self.down_proj(swiglu(gate, up, self.down_proj.recipe))


class DecoderLayer(nn.Module):
    """Pre-norm attention block followed by a pre-norm MLP or MoE block, both residual."""

    def __init__(self, config: ModelConfig, layer: int, recipe: Recipe):
        super().__init__()
        self.is_moe = config.is_moe_layer(layer)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                                   config.head_dim, config.rope_theta, config.rms_norm_eps, recipe)
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
        mlp = [self.mlp] if self.is_moe else [self.mlp.gate_proj, self.mlp.up_proj, self.mlp.down_proj]
        return [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, *mlp]

    # the norms also quantize their output for the NVFP4 projections that read it (`nn.norm.rms_norm`);
    # not in MoE layers, where the router reads it in bf16 and the experts their own rows
    def attn_input(self, x: torch.Tensor) -> torch.Tensor:
        return self.input_layernorm(x, self.self_attn.q_proj.recipe)

    def mlp_input(self, h: torch.Tensor) -> torch.Tensor:
        return self.post_attention_layernorm(h, None if self.is_moe else self.mlp.gate_proj.recipe)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor | None = None):
        """x `[B, T, H]`, positions `[B, T]` -> `[B, T, H]`."""
        h = x + self.self_attn(self.attn_input(x), positions, cu_seqlens)
        y = self.mlp_input(h)
        y = self.mlp(y.reshape(-1, y.shape[-1])).view_as(y) if self.is_moe else self.mlp(y)
        return h + y


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
            return get_recipe("bf16", backend=recipe.backend)
        return recipe

    def set_recipe(self, recipe: str | Recipe) -> None:
        """Run every quantizable layer under `recipe` from now on (weights are not touched)."""
        self.recipe = get_recipe(recipe)
        for i, layer in enumerate(self.layers):
            for module in layer.quantizable_modules():
                module.set_recipe(self.layer_recipe(i))

    def default_positions(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
        """0, 1, 2, ... per row, or per packed sequence when `cu_seqlens` is given; `[B, T]` int64."""
        B, T = input_ids.shape
        if cu_seqlens is None:
            return torch.arange(T, device=input_ids.device).expand(B, T)
        cu = cu_seqlens.to(input_ids.device)
        # output_size: no host sync to learn it (the packed length is T)
        starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1], output_size=T)
        return (torch.arange(T, device=input_ids.device) - starts)[None]

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                      cu_seqlens: torch.Tensor | None = None, check: bool = True) -> torch.Tensor:
        """Final-norm hidden states `[B, T, H]` (the LM head's input). With `cu_seqlens` `[S + 1]`,
        `input_ids` is `[1, N]`: S sequences packed back to back, attending only within themselves.
        `check=False` skips the check that cu_seqlens runs from 0 to N (a host sync on the GPU) for
        callers that built it (the learner's packing)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        if cu_seqlens is not None and input_ids.shape[0] != 1:
            raise ValueError(
                f"packed input (cu_seqlens) needs input_ids of shape [1, N], got {tuple(input_ids.shape)}")
        if check and cu_seqlens is not None and (cu_seqlens[0] != 0 or cu_seqlens[-1] != input_ids.shape[1]):
            raise ValueError(f"cu_seqlens must run from 0 to the packed length {input_ids.shape[1]}, "
                             f"got {cu_seqlens.tolist()}")
        default = position_ids is None
        if default:
            position_ids = self.default_positions(input_ids, cu_seqlens)
        position_ids = position_ids.expand(input_ids.shape)
        x = self.embed_tokens(input_ids)  # [B, T, H]
        with forward_scope():
            if default and cu_seqlens is not None:  # the attention kernel's layout, known without a check
                packed_layout(position_ids, cu_seqlens, *input_ids.shape, kernel_ok=True)
            for layer in self.layers:
                x = layer(x, position_ids, cu_seqlens)
        return self.norm(x)

    def lm_head_weight(self) -> torch.Tensor:
        """The `[V, H]` output projection (the embedding matrix when tied)."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[..., H]` -> `[..., V]` through the (unquantized) LM head."""
        return F.linear(hidden, self.lm_head_weight())

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids `[B, T]` -> logits `[B, T, V]` in the model's dtype."""
        return self.logits(self.hidden_states(input_ids, position_ids, cu_seqlens))

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """Random weights for tests and benchmarks: N(0, std) matrices, ones for the norms. Draws run on
        each parameter's device; a generator on another device seeds one there (so a GPU model never
        draws its billions of values on the CPU)."""
        local = {}
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            g = generator
            if g is not None and g.device.type != param.device.type:
                if param.device not in local:
                    local[param.device] = torch.Generator(param.device).manual_seed(g.initial_seed())
                g = local[param.device]
            param.copy_(torch.randn(param.shape, generator=g, device=param.device) * std)
