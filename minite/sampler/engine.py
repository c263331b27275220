"""`Sampler`: the rollout engine. `generate(prompts, params)` returns, per request, `n` samples with
their tokens, sampler log-probs and finish reasons.

One engine step = schedule (prefill or decode, see `scheduler`), a cached forward of the model
(`runner.cached_forward`, or a captured CUDA graph of it for decode steps on the GPU), one draw per
sequence (`sample`), then bookkeeping: a stop token ends a sample with "stop" (the token is kept),
reaching `max_tokens` with "length"; finished samples free their blocks and leave the batch.

Lookahead decode (`async_decode`, on by default with CUDA graphs): a decode step is launched before
the previous step's tokens are read back. Each sequence then holds a placeholder (`PENDING`) for its
last token; the next step feeds the sampled token straight from the GPU, and the host reads a step's
tokens while the GPU runs the following one, so scheduling and bookkeeping overlap the forward
instead of leaving the GPU idle. A sequence that drew a stop token is found one step late: the extra
step's token is discarded (its KV write lands in the sequence's own blocks before they are freed, in
stream order). Tokens and log-probs are those of the synchronous engine, up to the effect of batch
shapes (a stopped sequence rides along one extra step) on paths that are not batch invariant.

Memory between rollouts (`release`): an idle sampler can give its KV cache, and the decode graphs
that point into it, back to the allocator (a colocated learner phase then has that memory); the
next `generate` makes a cache of the same number of blocks again (`stats["kv_remakes"]`,
`stats["kv_remake_s"]`: the cost).

Randomness: sample s of request r draws its t-th token from the uniform `rng.uniforms(key, t)` with
`key = sample_key(seed, r, s)`; r is the request's index in the `generate` call. The tokens therefore
do not depend on batch composition, scheduling or preemption (up to the floating-point effect of
batch shapes on the logits, which in fp32 stays far below the draw's resolution). `seed=None` draws
a seed from torch's global CPU generator.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from minite.sampler.graphs import DecodeGraphs, bucket_rows, bucket_width
from minite.sampler.kv_cache import BlockManager, KVCache, num_kv_blocks
from minite.sampler.rng import key_tensor, sample_key
from minite.sampler.runner import build_batch, build_decode_batch, cached_forward, to_device
from minite.sampler.sample import sample
from minite.sampler.scheduler import Scheduler, cdiv
from minite.sampler.sequence import PENDING, Group, RequestOutput, Sequence, request_output
from minite.sampling import SamplingParams


class _Launched:
    """A decode step whose tokens are still on the GPU: `seqs[i]` gets `new[i]` at `index[i]`. On CUDA
    the tokens and log-probs are copied to pinned host memory as soon as they are drawn, behind an
    event: reading them back waits for this step only, not for the step launched after it (a plain
    device-to-host copy would wait for everything queued on the stream and leave the GPU idle)."""

    def __init__(self, seqs: list[Sequence], new: torch.Tensor, logprobs: torch.Tensor):
        self.seqs, self.new, self.logprobs = seqs, new, logprobs
        self.index = [len(s.tokens) for s in seqs]
        self.row = {id(s): i for i, s in enumerate(seqs)}
        self.ready = None
        if new.is_cuda:
            self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                         for t in (new, logprobs)]
            self.ready = torch.cuda.Event()
            self.ready.record()

    def read(self) -> tuple[list[int], list[float]]:
        """The drawn tokens and their log-probs on the host."""
        if self.ready is None:
            return self.new.tolist(), self.logprobs.tolist()
        self.ready.synchronize()
        return self.host[0].tolist(), self.host[1].tolist()


class Sampler:
    """Rollout engine over a `minite.models.Qwen3` (any recipe; weights shared, not copied).

    max_num_seqs: sequences decoded together; kv_cache_tokens: KV slots (None: `kv_memory_fraction` of
    free GPU memory, or a fixed default on CPU); block_size: tokens per KV block;
    max_num_batched_tokens: prefill token budget per step; prefix_sharing: share a group's prompt
    blocks; cuda_graphs: None = on for CUDA models whose decode step can be captured (every module
    `graph_safe()`: bf16 layers, NVFP4 layers and MoE experts on the Triton backend; the reference
    NVFP4 path and the padded MoE grouping of bf16 experts synchronize), False = off, True = on
    (error on CPU); async_decode: lookahead decode (see the module doc), None = on with CUDA graphs.
    """

    def __init__(self, model, max_num_seqs: int = 256, kv_cache_tokens: int | None = None,
                 block_size: int = 16, max_num_batched_tokens: int = 8192, prefix_sharing: bool = True,
                 cuda_graphs: bool | None = None, kv_memory_fraction: float = 0.8,
                 async_decode: bool | None = None):
        param = next(model.parameters())
        self.model, self.device, self.dtype = model, param.device, param.dtype
        recipe = model.recipe  # kv_cache: the cache's format (the learner's forward quantizes alike)
        self.kv_format = recipe.kv_cache
        num_blocks = num_kv_blocks(model.config, block_size, self.dtype, self.device, kv_cache_tokens,
                                   kv_memory_fraction, self.kv_format)
        self.cache: KVCache | None = self._make_cache(num_blocks, block_size)
        self.blocks = BlockManager(num_blocks)
        self.scheduler = Scheduler(self.blocks, block_size, max_num_seqs, max_num_batched_tokens,
                                   prefix_sharing)
        self.block_size, self.max_num_seqs = block_size, max_num_seqs
        self.use_graphs = self._want_graphs(cuda_graphs)
        self.async_decode = self.use_graphs if async_decode is None else async_decode
        self._launched: _Launched | None = None
        self.graphs: DecodeGraphs | None = None
        self._weights_seen = None
        self.stats = dict(steps=0, prefill_steps=0, decode_steps=0, graph_steps=0, peak_blocks_used=0,
                          kv_remakes=0, kv_remake_s=0.0)

    def _make_cache(self, num_blocks: int, block_size: int) -> KVCache:
        cfg = self.model.config
        return KVCache(cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim,
                       self.dtype, self.device, self.kv_format, self.model.recipe.execution)

    def release(self) -> None:
        """Give the KV cache and the decode graphs back to the allocator (and, on CUDA, the freed
        memory to the device); the next `generate` makes them again. Only between rollouts."""
        if self.has_unfinished():
            raise RuntimeError("release() needs an idle sampler: requests are still running")
        if self.cache is None:
            return
        self.cache = self.graphs = self._weights_seen = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def released(self) -> bool:
        return self.cache is None

    def _ensure_cache(self) -> None:
        """The KV cache again after `release`: the same number of blocks, all free."""
        if self.cache is not None:
            return
        start = time.perf_counter()
        self.cache = self._make_cache(self.blocks.num_blocks, self.block_size)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stats["kv_remakes"] += 1
        self.stats["kv_remake_s"] += time.perf_counter() - start

    def _want_graphs(self, flag: bool | None) -> bool:
        if self.device.type != "cuda":
            if flag:
                raise ValueError("cuda_graphs=True needs a model on a CUDA device")
            return False
        if flag is None:
            # Capture only when no module synchronizes with the host in a decode step: Linear and
            # MoEExperts report it (`graph_safe`); everything else in the decode step is sync-free.
            return all(m.graph_safe() for m in self.model.modules() if hasattr(m, "graph_safe"))
        return flag

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def add_request(self, prompt: list[int], params: SamplingParams, index: int) -> Group:
        """Queue one request (`n` samples); `index` enters the samples' random keys."""
        self._ensure_cache()
        prompt = [int(t) for t in prompt]
        vocab = self.model.config.vocab_size
        if not prompt:
            raise ValueError(f"request {index}: empty prompt")
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"request {index}: token ids must be in [0, {vocab})")
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, ()).item())
        group = Group(index, prompt, params)
        group.seqs = [Sequence(group, s, sample_key(seed, index, s), list(prompt), len(prompt))
                      for s in range(params.n)]
        self.scheduler.add(group)
        return group

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._launched is not None

    @torch.no_grad()
    def step(self) -> list[Sequence]:
        """One prefill or decode step; returns the sequences found finished in it (with lookahead, a
        stop is found one step after it was drawn)."""
        finished = []
        # Prefill (waiting sequences) needs every token on the host; so does the end of the run.
        if self._launched is not None and (self.scheduler.waiting or not self.scheduler.running):
            finished = self._read_back()
            if not self.scheduler.has_unfinished():
                return finished
        kind, seqs, starts = self.scheduler.schedule()
        self.stats["steps"] += 1
        self.stats["peak_blocks_used"] = max(self.stats["peak_blocks_used"], self.blocks.num_used)
        if not seqs:
            if not self.scheduler.waiting:
                raise RuntimeError("sampler step with nothing to run")
            return []
        self.stats[f"{kind}_steps"] += 1
        logits = self._forward(kind, seqs, starts)
        keys = key_tensor([s.key for s in seqs], self.device)
        steps = key_tensor([s.num_generated for s in seqs], self.device)
        new, logprobs = sample(logits, [s.params for s in seqs], keys, steps, self.model.recipe.execution)
        if kind == "decode" and self.async_decode:
            return finished + self._launch(seqs, new, logprobs)
        for seq, token, logprob in zip(seqs, new.tolist(), logprobs.tolist()):
            seq.tokens.append(token)
            seq.logprobs.append(logprob)
            if token in seq.params.stop_token_ids:
                self.scheduler.finish(seq, "stop")
            elif seq.num_generated >= seq.params.max_tokens:
                self.scheduler.finish(seq, "length")
            else:
                continue
            finished.append(seq)
        return finished

    def _launch(self, seqs: list[Sequence], new: torch.Tensor, logprobs: torch.Tensor) -> list[Sequence]:
        """Lookahead: placeholders now, `max_tokens` decided now; the previous step read back."""
        previous, self._launched = self._launched, _Launched(seqs, new, logprobs)
        finished = []
        for seq in seqs:
            seq.tokens.append(PENDING)
            seq.logprobs.append(float("nan"))
            if seq.num_generated >= seq.params.max_tokens:
                self.scheduler.finish(seq, "length")
                finished.append(seq)
        if previous is not None:
            finished += self._read_back(previous)
        return finished

    def _read_back(self, launched: _Launched | None = None) -> list[Sequence]:
        """Fill a launched step's placeholders; a stop token ends its sequence there (dropping the
        placeholder of a later step) and outranks a "length" finish decided at launch."""
        if launched is None:
            launched, self._launched = self._launched, None
        finished = []
        for seq, i, token, logprob in zip(launched.seqs, launched.index, *launched.read()):
            if i >= len(seq.tokens):  # cut off by a stop token found earlier
                continue
            seq.tokens[i], seq.logprobs[i - seq.num_prompt] = token, logprob
            if token in seq.params.stop_token_ids:
                del seq.tokens[i + 1:], seq.logprobs[i + 1 - seq.num_prompt:]
                if seq.finish_reason is None:
                    self.scheduler.finish(seq, "stop")
                    finished.append(seq)
                seq.finish_reason = "stop"
        return finished

    def _pending_ids(self, seqs: list[Sequence], rows: int) -> torch.Tensor | None:
        """Input tokens `[rows]` on the device for a decode step whose last tokens may be placeholders:
        those come from the launched step's samples, without a host round trip."""
        launched = self._launched
        if launched is None or all(s.tokens[-1] != PENDING for s in seqs):
            return None
        src = np.full(rows, -1, dtype=np.int64)
        host = np.zeros(rows, dtype=np.int64)
        for i, s in enumerate(seqs):
            if s.tokens[-1] == PENDING:
                src[i] = launched.row[id(s)]
            else:
                host[i] = s.tokens[-1]
        src_t, host_t = to_device(src, self.device), to_device(host, self.device)
        return torch.where(src_t >= 0, launched.new[src_t.clamp(min=0)], host_t)

    def _forward(self, kind: str, seqs: list[Sequence], starts: list[int]) -> torch.Tensor:
        """Logits `[B, V]` at each sequence's last token, after computing its tokens from `starts`."""
        tokens = [s.tokens for s in seqs]
        tables = [s.block_table for s in seqs]
        if kind == "decode":
            starts = [len(t) - 1 for t in tokens]
            if self.graphs is not None and self.graphs.fits(len(seqs), max(map(len, tables))):
                self.stats["graph_steps"] += 1
                rows = bucket_rows(len(seqs))
                return self.graphs.run(tokens, tables, ids=self._pending_ids(seqs, rows))
        rows = width = None
        if kind == "decode" and self.device.type == "cuda":
            # The graphs' padded shapes, so that graphed and eager decode compute the same numbers.
            rows, width = bucket_rows(len(seqs)), bucket_width(max(map(len, tables)))
        if kind == "decode":
            batch = build_decode_batch(tokens, tables, self.block_size, self.cache.scratch_block, self.device,
                                       width=width, rows=rows)
            ids = self._pending_ids(seqs, batch.input_ids.shape[0])
            if ids is not None:
                batch.input_ids = ids
        else:
            batch = build_batch(tokens, starts, tables, self.block_size, self.cache.scratch_block,
                                self.device, width=width, rows=rows)
        return cached_forward(self.model, self.cache, batch)[: len(seqs)]

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 first_index: int = 0) -> list[RequestOutput]:
        """Generate for every prompt; `params` is one SamplingParams for all or one per prompt. Prompt i
        is request `first_index + i` (its samples' random keys): a share of a larger batch draws the
        tokens the whole batch would."""
        if self.has_unfinished():
            raise RuntimeError("generate() needs an idle sampler; finish the requests added by hand first")
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        self._ensure_cache()
        self._prepare_graphs(prompts, params)
        groups = [self.add_request(p, sp, first_index + i) for i, (p, sp) in enumerate(zip(prompts, params))]
        while self.has_unfinished():
            self.step()
        return [request_output(g) for g in groups]

    def _prepare_graphs(self, prompts, params) -> None:
        """(Re)build the decode graphs when the weights changed or longer sequences come."""
        if not self.use_graphs or not prompts:
            return
        seen = (self.model.recipe, *((p.data_ptr(), p._version) for p in self.model.parameters()))
        width = max(cdiv(len(p) + sp.max_tokens, self.block_size) for p, sp in zip(prompts, params))
        if self.graphs is None or seen != self._weights_seen or not self.graphs.fits(1, width):
            self.graphs = DecodeGraphs(self.model, self.cache, self.max_num_seqs, width)
            self._weights_seen = seen
