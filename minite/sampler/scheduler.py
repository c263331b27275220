"""Continuous batching with prompt-prefix sharing and preemption by recompute.

Each engine step is either a prefill or a decode step:

- prefill: admit waiting sequences in FIFO order while there are free sequence slots
  (`max_num_seqs`), token budget (`max_num_batched_tokens`; the first one always fits) and KV blocks.
  A sequence computes all of its tokens (prompt, plus what it generated before a preemption), except
  the prompt's full blocks its group already holds in the cache: those it shares by reference. The
  first sample of a group to be admitted publishes its first `(P - 1) // block_size` blocks (P =
  prompt length) as the group's shared blocks; the partial last block (and at least the last prompt
  token) is recomputed by every sample, so each gets its own logits and writes only its own blocks.
- decode: every running sequence feeds its last token; one that crosses a block boundary gets a new
  block. When none is free the newest running sequence is preempted (blocks freed, re-queued at the
  front to be re-prefilled with prompt + tokens so far), until the step fits.

A request that cannot fit in the whole cache even alone is rejected when it is added.
"""

from __future__ import annotations

from collections import deque

from minite.sampler.kv_cache import BlockManager
from minite.sampler.sequence import Group, Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    def __init__(self, blocks: BlockManager, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 prefix_sharing: bool = True):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.blocks, self.block_size = blocks, block_size
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.prefix_sharing = prefix_sharing
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Blocks kept free for running sequences' growth when admitting more prefills.
        self.watermark = max(1, blocks.num_blocks // 100)

    def add(self, group: Group) -> None:
        worst = len(group.prompt) + group.params.max_tokens - 1  # positions that ever need a KV slot
        if cdiv(worst, self.block_size) > self.blocks.num_blocks:
            raise ValueError(
                f"request {group.index} needs up to {worst} KV slots (prompt {len(group.prompt)} + "
                f"max_tokens {group.params.max_tokens} - 1) but the whole cache holds "
                f"{self.blocks.num_blocks * self.block_size}: raise kv_cache_tokens or lower max_tokens")
        self.waiting.extend(group.seqs)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[str, list[Sequence], list[int]]:
        """("prefill", seqs, first computed position per seq) or ("decode", seqs, [])."""
        seqs, starts, tokens = [], [], 0
        while self.waiting and len(self.running) + len(seqs) < self.max_num_seqs:
            seq = self.waiting[0]
            shared = self._shared_prefix(seq)
            start = len(shared) * self.block_size
            new_tokens = len(seq.tokens) - start
            needed = cdiv(len(seq.tokens), self.block_size) - len(shared)
            reserve = self.watermark if (self.running or seqs) else 0
            if seqs and tokens + new_tokens > self.max_num_batched_tokens:
                break
            if needed + reserve > self.blocks.num_free:
                break
            self.waiting.popleft()
            self.blocks.share(shared)
            seq.block_table = shared + self.blocks.allocate(needed)
            if self.prefix_sharing and seq.group.shared_blocks is None and len(seq.group.seqs) > 1:
                seq.group.shared_blocks = seq.block_table[:(seq.num_prompt - 1) // self.block_size]
            seqs.append(seq)
            starts.append(start)
            tokens += new_tokens
        if seqs:
            self.running.extend(seqs)
            return "prefill", seqs, starts
        return "decode", self._grow_for_decode(), []

    def _shared_prefix(self, seq: Sequence) -> list[int]:
        shared = seq.group.shared_blocks
        return list(shared) if self.prefix_sharing and shared else []

    def _grow_for_decode(self) -> list[Sequence]:
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if len(seq.block_table) * self.block_size < len(seq.tokens):
                while self.blocks.num_free == 0 and self.running[-1] is not seq:
                    self.preempt(self.running.pop())
                if self.blocks.num_free == 0:
                    self.preempt(self.running.pop())
                    break
                seq.block_table += self.blocks.allocate(1)
            i += 1
        return list(self.running)

    def preempt(self, seq: Sequence) -> None:
        self._release(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a running sequence, or a preempted one (lookahead decode finds a stop token late)."""
        seq.finish_reason = reason
        (self.running if seq in self.running else self.waiting).remove(seq)
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        self.blocks.free(seq.block_table)
        seq.block_table = []
        shared = seq.group.shared_blocks
        if shared and self.blocks.ref[shared[0]] == 0:
            seq.group.shared_blocks = None
