"""`minite export`: a model's NVFP4 weights as a ModelOpt or compressed-tensors checkpoint.

    minite export runs/20261201-120000 --format modelopt --out served/      the run's latest checkpoint
    minite export path/to/qwen3 --format compressed-tensors --recipe vllm --fused-scale shared --out out/

SRC is a Hugging Face directory (config.json + safetensors), a run folder of `minite train` (its
latest checkpoint, under the run's recipe unless --recipe is given) or one checkpoint of it
(`checkpoints/step_N`). The weights are quantized under the recipe exactly as the model computes with
them and written as they are (`minite.models.export_nvfp4`); a recipe with static activation scales
(`vllm`) is calibrated first on random prompts, as `minite agreement` calibrates it.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

from minite.commands.args import positive_int
from minite.files import check_output_dir
from minite.recipe import FUSED_SCALES, RECIPES, get_recipe

HELP = "write a model's NVFP4 weights as a ModelOpt or compressed-tensors checkpoint (vLLM, SGLang)"


def add_parser(sub, name):
    p = sub.add_parser(name, help=HELP, description=HELP)
    p.add_argument("src", metavar="SRC", help="a Hugging Face directory, a run folder or a checkpoint")
    p.add_argument("--format", required=True, choices=["modelopt", "compressed-tensors"])
    p.add_argument("--out", required=True, help="the checkpoint directory to write")
    p.add_argument("--recipe", choices=[r for r in RECIPES if r != "bf16"],
                   help="the NVFP4 recipe (default: a run's own, else aligned)")
    p.add_argument("--fused-scale", choices=FUSED_SCALES,
                   help="one weight global scale per q/k/v and gate/up group ('shared': what serving "
                        "engines decode with) or one per projection (default: the recipe's)")
    p.add_argument("--calibration-prompts", type=positive_int, default=16,
                   help="random prompts that calibrate a static recipe's input scales")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")


def run(args) -> int:
    check_output_dir(args.out)
    if Path(args.out).exists() and not args.overwrite:
        raise FileExistsError(f"--out {args.out} exists; pass --overwrite to replace it")
    model_dir, run_recipe = resolve_source(Path(args.src))
    name, overrides = (args.recipe, {}) if args.recipe else run_recipe
    if args.fused_scale:
        overrides = {**overrides, "fused_scale": args.fused_scale}
    recipe = get_recipe(name, **overrides)
    if not recipe.fp4:
        raise ValueError(f"recipe {recipe.name!r} quantizes nothing; pass an NVFP4 --recipe")
    from minite.diagnostics.agreement import calibrate_if_static, random_prompts
    from minite.models import load_pretrained
    from minite.models.export_nvfp4 import export_nvfp4

    print(f"loading {model_dir} under recipe {recipe.name} (fused_scale={recipe.fused_scale})",
          file=sys.stderr)
    model = load_pretrained(model_dir, recipe=recipe)
    prompts = random_prompts(args.calibration_prompts, 32, model.config.vocab_size, seed=0)
    if calibrate_if_static(model, prompts):
        print(f"calibrated static input scales on {len(prompts)} random prompts", file=sys.stderr)
    out = export_nvfp4(model, args.out, args.format, overwrite=args.overwrite)
    size = sum(f.stat().st_size for f in out.iterdir() if f.suffix == ".safetensors")
    print(f"wrote {out} ({args.format}, {size / 2**20:.1f} MiB)")
    return 0


def resolve_source(src: Path) -> tuple[Path, tuple[str, dict]]:
    """(the model directory, the run's (recipe name, overrides), default aligned) of SRC."""
    if not src.is_dir():
        raise FileNotFoundError(f"{src} does not exist" if not src.exists() else f"{src} is not a folder")
    if (src / "config.json").is_file():
        return src, _run_recipe(src.parent.parent.parent / "config.toml" if src.name == "model" else None)
    if (src / "checkpoints").is_dir():
        from minite.rl.checkpointing import latest_checkpoint

        ckpt = latest_checkpoint(src / "checkpoints")
        if ckpt is None:
            raise ValueError(f"run folder {src} has no finished checkpoint yet")
        return ckpt / "model", _run_recipe(src / "config.toml")
    if (src / "model" / "config.json").is_file():  # one checkpoint: runs/<run>/checkpoints/step_N
        return src / "model", _run_recipe(src.parent.parent / "config.toml")
    raise ValueError(f"{src} is neither a Hugging Face model directory (config.json), a run folder "
                     "(checkpoints/) nor a checkpoint (model/)")


def _run_recipe(config: Path | None) -> tuple[str, dict]:
    if config is None or not config.is_file():
        return "aligned", {}
    recipe = tomllib.loads(config.read_text()).get("recipe", {})
    return recipe.get("name", "aligned"), dict(recipe.get("overrides", {}))
