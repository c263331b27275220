"""Memory per deployment: the learner's and the sampler's weights and the learner's state, by kind.

Deployments (random weights of real Qwen3 shapes):
- `bf16`: one bf16 model serves both engines; the learner's fp32 masters and AdamW moments;
- `aligned` (colocated): one model serves both engines: its bf16 parameters, each NVFP4 weight's bf16
  copy, codes and scales and (for the sampler's decode steps) decode layout; nothing duplicated;
- `naive te+vllm`: a `te` learner (bf16 parameters, bf16 copies, codes) and the sampler's own
  sampler-only `vllm` model (codes, scales, decode layouts; bf16 embeddings, norms, router, LM head);
- `aligned sampler-only`: a sampler alone (the rollout benchmark's `--sampler-only`).

Each row gives the bytes by kind (`minite.nn.memory`) of the learner side and of the sampler's own
model (0 where the sampler runs the learner's model), in GB, and the KV cache's bytes per token (bf16 K
and V of every layer). `--computed` computes them from the shapes on the meta device (nothing
allocated, any machine); otherwise the models are built on the device and their tensors counted
(`memory_by_kind`; on CUDA also the allocator's peak); a deployment that does not fit is reported so.
The learner's state is what one step holds: masters, AdamW moments, the gradients. `--tiny`: tiny
models on the CPU.

    python -m benchmarks.e2e.bench_memory --computed --out OUT.json
    python -m benchmarks.e2e.bench_memory --models dense,moe --out OUT.json        # on the GPU
"""

from __future__ import annotations

import argparse
import gc

import torch

from benchmarks.common import report, write_json
from minite.learner.optimizer import MasterAdamW
from minite.models import ModelConfig, Qwen3, tiny_qwen3, tiny_qwen3_moe
from minite.models.presets import qwen3_1_7b, qwen3_30b_a3b
from minite.models.sampler_model import build_sampler_model, random_fill, state_fill
from minite.nn.memory import GB, KINDS, memory_by_kind, memory_from_shapes, quantized_weights_held
from minite.nn.nvfp4_matmul import use_kernels
from minite.nn.refresh import refresh_quantized_weights

DEPLOYMENTS = ("bf16", "aligned", "naive te+vllm", "aligned sampler-only")
STATE_KINDS = ("fp32_masters", "optimizer_state", "gradients")
WEIGHT_KINDS = tuple(k for k in KINDS if k not in STATE_KINDS)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="JSON file to write")
    p.add_argument("--tiny", action="store_true", help="tiny models on the CPU")
    p.add_argument("--computed", action="store_true", help="computed from the shapes (meta device)")
    p.add_argument("--models", default="dense,moe")
    p.add_argument("--deployments", default=",".join(DEPLOYMENTS))
    p.add_argument("--dense-layers", type=int, default=28)
    p.add_argument("--moe-layers", type=int, default=48)
    return p.parse_args(argv)


def model_config(kind: str, args) -> ModelConfig:
    if args.tiny:
        return tiny_qwen3() if kind == "dense" else tiny_qwen3_moe()
    if kind == "dense":
        return qwen3_1_7b(num_hidden_layers=args.dense_layers)
    return qwen3_30b_a3b(num_hidden_layers=args.moe_layers)


def kv_bytes_per_token(config: ModelConfig) -> int:
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2


def sides(deployment: str) -> tuple[str | None, str | None]:
    """(the learner's recipe, the sampler's own model's recipe); None: no such model."""
    return {"bf16": ("bf16", None), "aligned": ("aligned", None), "naive te+vllm": ("te", "vllm"),
            "aligned sampler-only": (None, "aligned")}[deployment]


def computed(config: ModelConfig, deployment: str, decode: bool = True) -> dict:
    learner, sampler = sides(deployment)
    out = {}
    with torch.device("meta"):
        if learner is not None:
            model = Qwen3(config, learner).to(torch.bfloat16)
            # the colocated aligned model also serves the sampler's decode steps
            out["learner"] = memory_from_shapes(model, learner=True, decode=decode and learner == "aligned")
        if sampler is not None:
            model = Qwen3(config, sampler).to(torch.bfloat16)
            out["sampler"] = memory_from_shapes(model, sampler_only=True, decode=decode)
    return out


def learner_model(config: ModelConfig, recipe: str, device, dtype) -> tuple[Qwen3, MasterAdamW]:
    """The learner's model after a weight refresh, with an optimizer holding what one step holds."""
    with torch.device(device):
        model = Qwen3(config, recipe).to(dtype)
    model.init_weights(generator=torch.Generator(device).manual_seed(0))
    refresh_quantized_weights(model)
    opt = MasterAdamW(model.parameters(), lr=0.0)
    for p, m in zip(opt.params, opt.masters):
        p.grad = torch.zeros_like(p)
        m.grad = torch.zeros_like(m) if m is not p else p.grad
    opt.optimizer.step()  # AdamW's moments exist from the first step
    if recipe == "aligned":  # colocated: the sampler's decode layouts on the same weights
        for qw in quantized_weights_held(model):
            if use_kernels(model.recipe, torch.device(device)) and qw.shape[-1] % 32 == 0:
                qw.decode_weight(model.embed_tokens.weight.dtype if device.type == "cuda" else torch.float16)
    return model, opt


def measured(config: ModelConfig, deployment: str, device, dtype) -> dict:
    learner, sampler = sides(deployment)
    out = {}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model = opt = None
    if learner is not None:
        model, opt = learner_model(config, learner, device, dtype)
        out["learner"] = memory_by_kind(model, opt)
    if sampler is not None:
        if model is not None:
            fill = state_fill(dict(model.named_parameters()))
        else:
            fill = random_fill(0, device=device)
        lean = build_sampler_model(config, sampler, fill, device=device, dtype=dtype)
        out["sampler"] = memory_by_kind(lean)
        del lean
    if device.type == "cuda":
        out["allocated_gb"] = torch.cuda.memory_allocated() / GB
        out["peak_gb"] = torch.cuda.max_memory_allocated() / GB
    del model, opt
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def row(kind: str, config: ModelConfig, deployment: str, sizes: dict, how: str) -> dict:
    r = dict(model=kind, layers=config.num_hidden_layers, deployment=deployment, how=how)
    learner, sampler = sizes.get("learner"), sizes.get("sampler")
    r["learner_weights_gb"] = sum(learner[k] for k in WEIGHT_KINDS) / GB if learner else 0.0
    r["learner_state_gb"] = sum(learner[k] for k in STATE_KINDS) / GB if learner else 0.0
    r["sampler_own_weights_gb"] = sum(sampler[k] for k in WEIGHT_KINDS) / GB if sampler else 0.0
    r["total_gb"] = r["learner_weights_gb"] + r["learner_state_gb"] + r["sampler_own_weights_gb"]
    r["kv_bytes_per_token"] = kv_bytes_per_token(config)
    for side in ("learner", "sampler"):
        if sizes.get(side):
            r[f"{side}_by_kind_gb"] = {k: v / GB for k, v in sizes[side].items() if v and k != "total"}
    for k in ("allocated_gb", "peak_gb", "error"):
        if k in sizes:
            r[k] = sizes[k]
    return r


def main(argv=None):
    args = parse_args(argv)
    device = torch.device("cpu" if args.tiny or args.computed or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" and not args.computed else torch.bfloat16
    rows = []
    for kind in args.models.split(","):
        config = model_config(kind, args)
        for deployment in args.deployments.split(","):
            if args.computed:
                sizes, how = computed(config, deployment), "computed from shapes"
            else:
                how = f"measured ({device.type})"
                try:
                    sizes = measured(config, deployment, device, dtype)
                except torch.cuda.OutOfMemoryError as e:
                    sizes = {"error": f"out of memory: {str(e).splitlines()[0]}"}
                    gc.collect()
                    torch.cuda.empty_cache()
            rows.append(row(kind, config, deployment, sizes, how))
            print({k: v for k, v in rows[-1].items() if not k.endswith("by_kind_gb")}, flush=True)
    report("memory", [{k: v for k, v in r.items() if not k.endswith("by_kind_gb")} for r in rows], None)
    if args.out:  # the rows with their kinds
        write_json(args.out, dict(benchmark="memory", rows=rows,
                                  workload=dict(device=str(device), tiny=args.tiny, computed=args.computed)))
    return rows


if __name__ == "__main__":
    main()
