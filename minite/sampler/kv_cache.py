"""Paged KV cache: fixed-size blocks of `block_size` token slots per layer, handed out by reference count.

Storage per layer: `k[l]`, `v[l]` of shape `[num_blocks + 1, block_size, Hkv, D]` in the model dtype,
zero-initialized (so a masked slot never holds NaN). Token position p of a sequence lives in slot
`block_table[p // block_size] * block_size + p % block_size`. The extra last block is a scratch
block: padding rows of a batch write there and padded block-table entries point there; it is never
handed out. On CUDA the attention kernel (`minite.kernels.attention.paged_attention`) reads the
blocks in place through the block tables, in position order; `gather` (the CPU path) lays a
sequence's blocks out in block-table order, i.e. in position order, so attention reads cached keys
in the same order as a full-sequence forward.

A quantized KV format (`Recipe.kv_cache` fp8 / nvfp4, `minite.ref.kv_quant`): `k[l]`, `v[l]` are
`QuantizedKV` blocks (payload, per-(token, head) fp32 scale and, for nvfp4, E4M3 block scales, all
`[num_blocks + 1, block_size, Hkv, ...]`); `write` quantizes (the learner's forward quantizes its k
and v with the same quantizer, so both hold the same bits), the kernel reads the blocks in place and
`gather` dequantizes. Per token and layer the cache takes `minite.ref.kv_quant.bytes_per_token`: at
head_dim 128 and the bf16 model dtype, 512 bytes per kv head (bf16), 264 (fp8), 152 (nvfp4), so the
same memory holds 1.94x (fp8) and 3.37x (nvfp4) the tokens.

`BlockManager` owns the block ids: `allocate` takes free blocks (reference count 1), `share` adds a
reference (the n samples of a request share their prompt's full blocks), `free` drops one reference
and returns a block to the free list when none is left.
"""

from __future__ import annotations

from collections import deque

import torch

from minite.execution import DEFAULT, Execution
from minite.nn.kv_quant import quantize_kv
from minite.ref.kv_quant import QuantizedKV, bytes_per_token, check_format, zeros

CPU_DEFAULT_TOKENS = 16384


class BlockManager:
    """Reference-counted allocator of `num_blocks` KV blocks."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_ids)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_ids):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self.free_ids)} free")
        blocks = [self.free_ids.popleft() for _ in range(n)]
        for b in blocks:
            self.ref[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref[b] <= 0:
                raise RuntimeError(f"cannot share KV block {b}: it is not allocated")
            self.ref[b] += 1

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref[b] <= 0:
                raise RuntimeError(f"KV block {b} freed more often than allocated")
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free_ids.append(b)


class KVCache:
    """Key and value blocks of every layer: `k`, `v` `[L, num_blocks + 1, block_size, Hkv, D]` in the
    model dtype (`kv_format` bf16), or `QuantizedKV` of that shape (fp8 / nvfp4; `execution` picks
    the quantizer of `write`)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device, kv_format: str = "bf16", execution: Execution = DEFAULT):
        check_format(kv_format)
        shape = (num_layers, num_blocks + 1, block_size, num_kv_heads, head_dim)
        if kv_format == "bf16":
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
        else:
            self.k = zeros(kv_format, shape[:3], num_kv_heads, head_dim, device)
            self.v = zeros(kv_format, shape[:3], num_kv_heads, head_dim, device)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.scratch_block = num_blocks
        self.kv_format, self.dtype, self.execution = kv_format, dtype, execution

    @property
    def device(self) -> torch.device:
        return self.k.device

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype, kv_format: str = "bf16") -> int:
        """Bytes of one block in every layer: per token and layer `bytes_per_token` (bf16: 4 * Hkv * D
        for a 2-byte dtype; fp8: 2 * Hkv * (D + 4); nvfp4: 2 * Hkv * (D / 2 + D / 16 + 4))."""
        return num_layers * block_size * bytes_per_token(kv_format, num_kv_heads, head_dim, dtype)

    def rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | tuple[QuantizedKV, QuantizedKV]:
        """Layer `layer`'s k and v slots `[slots, Hkv, D]` (views; `QuantizedKV` for a quantized format),
        written in place by the attention layer's norm and rotation (`minite.nn.qk_norm_rope`)."""
        if self.kv_format != "bf16":
            return self.k[layer].flatten(0, 1), self.v[layer].flatten(0, 1)
        flat = (-1, *self.k.shape[-2:])
        return self.k[layer].view(flat), self.v[layer].view(flat)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v `[N, Hkv, D]` at flat slots `[N]` of layer `layer` (quantized for fp8 / nvfp4)."""
        for x, rows in zip((k, v), self.rows(layer)):
            if self.kv_format != "bf16":
                quantize_kv(x, self.kv_format, self.execution, out=rows, slots=slots)
            else:
                rows[slots] = x

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """block_tables `[B, W]` -> k, v `[B, W * block_size, Hkv, D]` in position order (quantized
        formats: dequantized to the model dtype)."""
        B, W = block_tables.shape
        k, v = self.k[layer][block_tables], self.v[layer][block_tables]
        if self.kv_format != "bf16":
            k, v = k.dequantize(self.dtype), v.dequantize(self.dtype)
        return (k.view(B, W * self.block_size, *self.k.shape[-2:]),
                v.view(B, W * self.block_size, *self.v.shape[-2:]))


def num_kv_blocks(config, block_size: int, dtype: torch.dtype, device: torch.device,
                  kv_cache_tokens: int | None, memory_fraction: float, kv_format: str = "bf16") -> int:
    """Blocks for `kv_cache_tokens` tokens, or (None) `memory_fraction` of the free GPU memory (blocks
    of `kv_format`: a quantized format fits more), or a fixed CPU default of CPU_DEFAULT_TOKENS tokens."""
    if kv_cache_tokens is not None:
        if kv_cache_tokens < block_size:
            raise ValueError(f"kv_cache_tokens={kv_cache_tokens} is below one block ({block_size} tokens)")
        return kv_cache_tokens // block_size
    if device.type != "cuda":
        return CPU_DEFAULT_TOKENS // block_size
    free, _ = torch.cuda.mem_get_info(device)
    per_block = KVCache.bytes_per_block(config.num_hidden_layers, block_size, config.num_key_value_heads,
                                        config.head_dim, dtype, kv_format)
    blocks = int(free * memory_fraction) // per_block - 1
    if blocks < 1:
        raise RuntimeError(f"not enough free GPU memory for one KV block ({free} bytes free, "
                           f"{per_block} bytes per block at memory_fraction={memory_fraction})")
    return blocks
