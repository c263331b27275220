"""Inputs shared by the kernel tests: adversarial NVFP4 tensors and a device choice."""

import torch

# E2M1 ties and grid points (at unit element scale) and E4M3 ties (block amax / 6 on a midpoint)
E2M1_TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 5.5, 7.0)
E4M3_TIES = (1.0625, 1.1875, 2.125, 3.75, 0.5625, 0.017578125, 2.0**-10, 3 * 2.0**-10, 240.0, 464.0)


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def adversarial(rows: int, k: int, seed: int = 0) -> torch.Tensor:
    """fp32 [rows, k] (rows >= 8, k >= 64, both multiples of 16): heavy-tailed random rows plus rows
    with zeros, tiny (subnormal) amax, exact E2M1 ties at unit scale (a 2688 entry makes the row's
    S_enc = 1), block amaxes on E4M3 midpoints, and one huge outlier."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) ** 3
    x[torch.rand(rows, k, generator=g) < 0.002] *= 50.0
    x[0] = 0.0
    x[1] = torch.randn(k, generator=g) * 1e-39
    ties = torch.tensor(E2M1_TIES)
    x[2, :16] = ties * torch.where(torch.arange(16) % 2 == 0, 1.0, -1.0)
    x[2, 16:32] = 2688.0
    x[3, :16] = -0.0
    for j, t in enumerate(E4M3_TIES):
        if 16 * (j + 2) <= k:
            x[3, 16 * (j + 1): 16 * (j + 2)] = torch.linspace(-6 * t, 6 * t, 16)
    x[3, -16:] = 2688.0
    x[4, 5] = 3.0e4
    x[5] = torch.linspace(-1.0, 1.0, k)
    return x


def model_through_fused_kernels(monkeypatch, module, name: str):
    """A tiny fp32 Qwen3's output with the fused kernels off and on, and how many times `module.name`
    ran while on: (plain, fused, calls)."""
    from minite.models import Qwen3, tiny_qwen3
    from minite.recipe import get_recipe

    model = Qwen3(tiny_qwen3(), recipe="bf16").float()
    model.init_weights(std=0.2, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    want = model(ids)
    calls = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a: calls.append(1) or real(*a))
    model.set_recipe(get_recipe("bf16").with_execution(elementwise="triton"))
    got = model(ids)
    return want, got, len(calls), model.config.num_hidden_layers


def moe_through_fused_kernels(monkeypatch, module, name: str):
    """A tiny fp32 MoE layer (the sorted path: torch._grouped_mm experts) run with the element-wise
    kernels off, then on: for each, (output, routed experts, input gradient, parameter gradients)
    of a fixed loss; and how many times `module.name` ran while on."""
    from minite.nn import MoEExperts
    from minite.recipe import get_recipe

    moe = MoEExperts(8, 32, 16, 2, recipe="bf16")
    x, g = torch.randn(3, 11, 32), torch.randn(3, 11, 32)
    calls, runs = [], []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a: calls.append(1) or real(*a))
    for elementwise in ("ref", "triton"):
        moe.set_recipe(get_recipe("bf16").with_execution(elementwise=elementwise, grouped_mm=True))
        xi = x.clone().requires_grad_()
        y, r = moe(xi, return_router=True)
        y.backward(g)
        runs.append((y.detach(), r.experts, xi.grad, [p.grad.clone() for p in moe.parameters()]))
        moe.zero_grad()
    return runs[0], runs[1], len(calls)


class ZeroFills:
    """Counts the zero-filled tensors made while active (autograd materializing the gradients of
    outputs that took no part in the loss dispatches `zeros_like` / `zeros` / `zero_` / `fill_`)."""

    NAMES = ("zeros_like", "zeros", "zero_", "fill_", "new_zeros")

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.__name__.split(".")[0] in outer.NAMES:
                    outer.count += 1
                return func(*args, **(kwargs or {}))

        self.count, self._mode = 0, _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
