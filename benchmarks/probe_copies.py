"""Which ops copy tensors in one learner forward + backward (tiny Qwen3 on CUDA, bf16 vs aligned):
each copy / clone / cast / cat dispatched, with where in minite it came from and its shape."""

import collections
import sys
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minite.models import Qwen3, tiny_qwen3
from minite.nn import refresh_quantized_weights
from minite.recipe import get_recipe


class CopyLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.hits = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if any(k in name for k in ("copy", "clone", "contiguous", "cat", "stack")):
            frames = [f for f in traceback.extract_stack() if "/minite/" in f.filename]
            where = " <- ".join(f"{f.filename.split('/minite/')[-1]}:{f.lineno}" for f in frames[-3:][::-1])
            a0 = args[0] if args and isinstance(args[0], torch.Tensor) else None
            shape = f"{tuple(a0.shape)} {a0.dtype} {a0.stride()}" if a0 is not None else ""
            self.hits[(name, where or "(autograd engine)", shape)] += 1
        return func(*args, **(kwargs or {}))


def main():
    for recipe in sys.argv[1:] or ["bf16", "aligned"]:
        r = "bf16" if recipe == "bf16" else get_recipe(recipe, backend="triton")
        cfg = tiny_qwen3(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=64)
        model = Qwen3(cfg, recipe=r).to(device="cuda", dtype=torch.bfloat16)
        model.init_weights(std=0.02, generator=torch.Generator().manual_seed(0))
        if recipe != "bf16":
            refresh_quantized_weights(model)
        ids = torch.randint(0, 100, (1, 512), device="cuda")
        cu = torch.tensor([0, 256, 512], device="cuda")
        model.hidden_states(ids, cu_seqlens=cu).float().square().sum().backward()
        with CopyLog() as log:
            model.hidden_states(ids, cu_seqlens=cu).float().square().sum().backward()
        print(f"== {recipe}: {sum(log.hits.values())} copies, {cfg.num_hidden_layers} layers")
        for (name, where, shape), n in log.hits.most_common(40):
            print(f"{n:4d} {name:28s} {shape:40s} {where}")


if __name__ == "__main__":
    main()
