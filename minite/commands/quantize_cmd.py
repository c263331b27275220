"""`minite quantize`: quantize a tensor or a safetensors weight file under a recipe and report.

A file from an NVFP4 checkpoint (ModelOpt or compressed-tensors, `minite.models.nvfp4_formats`) has
its quantized linears reported as stored (code use, scale extremes, global scale; no SQNR: there is
no original), their scale tensors not quantized again; its other tensors are quantized as usual.
"""

import fnmatch
import json
import sys

import torch

from minite.diagnostics.quant_stats import code_stats, quant_stats, quantize_with_spec
from minite.recipe import RECIPES, QuantSpec, get_recipe

HELP = "quantize a random tensor or a safetensors file under a recipe; report SQNR, codes, scales"


def add_parser(sub, name):
    p = sub.add_parser(name, help=HELP, description=HELP)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--file", help="a .safetensors file (each floating-point tensor is quantized; the "
                     "linears of an NVFP4 checkpoint are reported as stored)")
    src.add_argument("--random", metavar="R,K", help="a random tensor of this shape, e.g. 4096,4096")
    p.add_argument("--dist", choices=["gaussian", "heavy"], default="gaussian",
                   help="random data: gaussian, or heavy-tailed (x^3 with rare 50x outliers)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--recipe", default="aligned", choices=[r for r in RECIPES if r != "bf16"])
    p.add_argument("--operand", choices=["weight", "activation"], default="weight",
                   help="quantize as the recipe's weight or activation operand")
    p.add_argument("--chain", choices=["te", "vllm", "torchao"], help="override the recipe's chain")
    p.add_argument("--rounding", choices=["rne", "stochastic"], help="override the recipe's rounding")
    p.add_argument("--hadamard", action="store_true", help="apply the 16-point RHT first")
    p.add_argument("--name", default="*", help="only tensors whose name matches this glob")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args) -> int:
    spec = _spec(args)
    rows, skipped = [], []
    stored, owned = _stored(args.file) if args.file else ([], set())
    rows += [r for r in stored if fnmatch.fnmatch(r["name"], args.name)]
    for name, x in _tensors(args, owned):
        if x.numel() == 0:  # nothing to quantize or to measure: a row saying so, not a crash
            skipped.append({"name": name, "shape": list(x.shape), "reason": "0 elements"})
            continue
        q = quantize_with_spec(x, spec)
        rows.append({"name": name, **quant_stats(x, q)})
    if not rows:
        raise ValueError(_nothing_to_quantize(args, skipped))
    report = {"recipe": args.recipe, "operand": args.operand, "spec": spec.kwargs(), "tensors": rows,
              "skipped": skipped}
    if args.json:
        json.dump(report, sys.stdout, indent=1)
        print()
    else:
        _print_table(report)
    return 0


def _nothing_to_quantize(args, skipped: list[dict]) -> str:
    if not skipped:
        return f"no floating-point tensor matches --name {args.name!r}"
    empty = ", ".join(f"{r['name']} (shape {_shape(r['shape'])})" for r in skipped)
    return f"every floating-point tensor matching --name {args.name!r} is empty: {empty}"


def _spec(args) -> QuantSpec:
    recipe = get_recipe(args.recipe)
    spec = recipe.weight if args.operand == "weight" else recipe.activation
    changes = {k: v for k, v in (("chain", args.chain), ("rounding", args.rounding)) if v}
    if args.hadamard:
        changes["hadamard"] = True
    return QuantSpec(**{**spec.kwargs(), **changes})


def _stored(file: str) -> tuple[list[dict], set[str]]:
    """(a row per NVFP4 linear stored in `file`, the tensor names they own)."""
    from minite.models.checkpoint import open_safetensors
    from minite.models.nvfp4_formats import FIELDS, global_from_file
    from minite.nvfp4 import NVFP4Tensor

    rows, owned = [], set()
    with open_safetensors(file) as f:
        names = set(f.keys())  # noqa: SIM118
        for fmt, (codes_f, scales_f, glob_f, inp_f) in FIELDS.items():
            for name in sorted(n.removesuffix(f".{glob_f}") for n in names if n.endswith(f".{glob_f}")):
                codes, sb = f.get_tensor(f"{name}.{codes_f}"), f.get_tensor(f"{name}.{scales_f}")
                if codes.dtype != torch.uint8 or sb.dtype != torch.float8_e4m3fn:
                    continue
                s_dec = global_from_file(fmt, f.get_tensor(f"{name}.{glob_f}"))
                shape = (*codes.shape[:-1], 2 * codes.shape[-1])
                q = NVFP4Tensor(codes, sb, s_dec, s_dec * 2688.0, shape)
                rows.append({"name": name, "stored": fmt, "shape": list(shape), **code_stats(q)})
                owned |= {f"{name}.{s}" for s in (codes_f, scales_f, glob_f, inp_f)}
    return rows, owned


def _tensors(args, skip: set[str] = frozenset()):
    if args.random:
        try:
            shape = tuple(int(s) for s in args.random.split(","))
        except ValueError:
            shape = ()
        if not shape or min(shape) < 1:
            raise ValueError(f"--random expects a shape of positive sizes like 4096,4096, got "
                             f"{args.random!r}")
        g = torch.Generator().manual_seed(args.seed)
        x = torch.randn(shape, generator=g)
        if args.dist == "heavy":
            outliers = torch.rand(shape, generator=g) < 1e-3
            x = x**3 * torch.where(outliers, 50.0, 1.0)
        yield f"random_{args.dist}", x
        return
    from minite.models.checkpoint import open_safetensors

    with open_safetensors(args.file) as f:  # a truncated or corrupt file is refused before any work
        for name in f.keys():  # noqa: SIM118 (a safetensors handle is not a mapping)
            if name in skip or not fnmatch.fnmatch(name, args.name):
                continue
            x = f.get_tensor(name)
            if x.is_floating_point() and x.ndim >= 1:
                if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                    x = x.float()
                yield name, x


def _shape(shape) -> str:
    return "x".join(map(str, shape))


def _print_table(report):
    s = report["spec"]
    print(f"recipe {report['recipe']} ({report['operand']}): scaling={s['scaling']} block={s['block']} "
          f"rounding={s['rounding']} chain={s['chain']} hadamard={s['hadamard']}")
    head = f"{'tensor':40s} {'shape':>14s} {'SQNR dB':>8s} {'rel err':>8s} {'scale=0':>8s} {'=448':>7s}"
    print(head)
    for r in report["tensors"]:
        error = f"{'stored':>8s} {'':>8s}" if "stored" in r else f"{r['sqnr_db']:8.2f} {r['rel_error']:8.4f}"
        print(f"{r['name'][:40]:40s} {_shape(r['shape']):>14s} {error} "
              f"{100 * r['blocks_at_scale_0']:7.2f}% {100 * r['blocks_at_scale_448']:6.2f}%")
    for r in report["skipped"]:
        print(f"{r['name'][:40]:40s} {_shape(r['shape']):>14s} skipped: {r['reason']}")
    hist = {}
    for r in report["tensors"]:
        for v, f in r["code_histogram"].items():
            hist[v] = hist.get(v, 0.0) + f / len(report["tensors"])
    print("E2M1 magnitude use: " + "  ".join(f"{v}:{100 * f:.1f}%" for v, f in hist.items()))
