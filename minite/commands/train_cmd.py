"""`minite train`: RL of a model on a task (GRPO + corrections/TRIAGE) under an NVFP4 recipe.

    minite train                                  the embedded default (= configs/tiny_cpu.toml): a tiny
                                                  char model, warm start, RL on arithmetic, on the CPU
    minite train --config configs/gpu_arith.toml  a preset
    minite train --rl.lr=1e-4 --rl.correction.name triage   dotted overrides (TOML values)
    minite train --model.path=DIR --task.name=file ...      a model directory of one's own (docs/guide.md)
    minite train --dry-run ...                    print the resolved config and exit
    minite train --resume runs/20260101-120000    continue a run from its latest checkpoint
"""

import argparse
import sys
from pathlib import Path

from minite import distributed
from minite.commands.args import collect_overrides
from minite.config import ConfigError, load_config, to_toml

INTERRUPTED = 130  # the shell's exit status of a process stopped by SIGINT
HELP = "train a model with RL (warm start, GRPO, corrections, TRIAGE); writes a run folder"


def add_parser(sub, name):
    p = sub.add_parser(name, help=HELP, description=HELP, epilog="Any --section.key=value (or "
                       "--section.key value) overrides that config key, e.g. --rl.lr=1e-4 "
                       "--sampling.temperature 0.8",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="a TOML preset (default: the embedded CPU default)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue this run folder from its latest checkpoint")
    p.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    collect_overrides(p)


def resolve(args):
    """The config a `minite train` invocation runs: --resume reads the run's config.toml."""
    if args.resume:
        if args.config:
            raise ConfigError("--resume reads the run's own config.toml; do not pass --config with it")
        path = Path(args.resume) / "config.toml"
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist; --resume needs a run folder of minite train")
        return load_config(path, args.overrides)
    return load_config(args.config, args.overrides)


def run(args) -> int:
    cfg = resolve(args)
    if args.dry_run:
        sys.stdout.write(to_toml(cfg))
        return 0
    from minite.rl.trainer import Trainer

    try:
        trainer = Trainer(cfg, run_dir=args.resume, resume=bool(args.resume))
        if trainer.is_main:  # across processes (torchrun) rank 0 alone speaks
            print(f"minite train: run folder {trainer.run_dir}", flush=True)
        summary = trainer.run()
        distributed.close()  # on an error the process ends instead (torchrun then stops the others)
    except KeyboardInterrupt as e:
        # Ctrl-C: one line saying what was saved and how to go on, no traceback; 130 = 128 + SIGINT
        print(f"\nminite train: {e or 'interrupted before training started; nothing was saved'}",
              file=sys.stderr, flush=True)
        return INTERRUPTED
    if not trainer.is_main:
        return 0
    keys = ("reward_first_fifth_mean", "reward_last_fifth_mean", "eval_accuracy_first", "eval_accuracy_last",
            "wall_seconds")
    print("summary: " + ", ".join(f"{k}={summary[k]:.3f}" for k in keys if k in summary))
    if summary.get("warnings"):
        count = len(summary["warnings"])
        print(f"minite train: {count} warning(s), listed in {trainer.run_dir}/summary.json", file=sys.stderr)
    return 0
