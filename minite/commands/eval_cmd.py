"""`minite eval`: accuracy of a Hugging Face model directory on question/answer files.

    minite eval --model=runs/20261201-120000/final --data=gsm8k_test.jsonl --n=8
    minite eval --model=DIR --data=math500.jsonl --data=gsm8k.jsonl --n=4 --reward=math_verify --json

Per file: greedy accuracy, pass@k (unbiased, k = 1, 2, 4, ..., n), avg@n and maj@n over `--n` samples
(`minite.rl.evaluation`). The model brings its tokenizer, chat template and generation_config stop ids,
as in `minite train --model.path`.
"""

import json
import sys
from pathlib import Path

import torch

from minite.commands.args import nonnegative_int, positive_int
from minite.config import DTYPES, parse_value
from minite.devices import check_device
from minite.recipe import RECIPES, get_recipe

HELP = "evaluate a model directory on question/answer files: greedy accuracy, pass@k, avg@k, maj@k"


def add_parser(sub, name):
    p = sub.add_parser(name, help=HELP, description=HELP)
    p.add_argument("--model", metavar="DIR", required=True, help="a Hugging Face Qwen3 / Qwen3-MoE directory")
    p.add_argument("--data", metavar="FILE", action="append", required=True,
                   help="a JSONL / JSON / parquet file of questions and answers (GSM8K '####' or MATH "
                        "'\\boxed{}' answers); repeat for several")
    p.add_argument("--n", type=nonnegative_int, default=4, help="samples per question (0: greedy only)")
    p.add_argument("--reward", default="auto", help="exact, math_verify, or module:function (default auto: "
                   "math_verify when installed, else exact)")
    p.add_argument("--max-tokens", type=positive_int, default=1024)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=nonnegative_int, default=0)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeat for several)")
    p.add_argument("--limit", type=positive_int, default=None, help="the first N questions of each file")
    p.add_argument("--question-key", help="question column (default: question, problem or prompt)")
    p.add_argument("--answer-key", help="answer column (default: answer, solution or gold)")
    p.add_argument("--prompt-template", default="{question}", help="str.format template with {question}")
    p.add_argument("--system-prompt", default="")
    p.add_argument("--no-chat-template", action="store_true", help="encode the prompt text as it is")
    p.add_argument("--chat-template-kwargs", default="{}",
                   help="a TOML table, e.g. '{enable_thinking = false}'")
    p.add_argument("--recipe", default="aligned", choices=sorted(RECIPES), help="the sampler's numerics")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="default: config.json's")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _reward_kind(spec: str) -> str:
    from minite.rl.rewards import math_verify_available

    if spec == "auto":
        return "math_verify" if math_verify_available() else "exact"
    if spec not in ("exact", "math_verify") and ":" not in spec:
        raise ValueError(f"--reward {spec!r}: choose exact, math_verify or module:function")
    return spec


def run(args) -> int:
    from minite.models import load_pretrained
    from minite.rl.evaluation import evaluate_examples, read_eval_file
    from minite.rl.prompts import PromptFormat, stop_token_ids
    from minite.rl.reward_import import WeightedRewards
    from minite.rl.tokenizer import load_tokenizer
    from minite.sampler import Sampler

    check_device(args.device, "--device")
    kwargs = parse_value(args.chat_template_kwargs)
    if not isinstance(kwargs, dict):
        raise ValueError(f"--chat-template-kwargs {args.chat_template_kwargs!r} must be a TOML table "
                         "such as '{enable_thinking = false}'")
    reward = _reward_kind(args.reward)
    custom = WeightedRewards([reward]) if ":" in reward else None
    sets = [(path, *read_eval_file(path, args.question_key, args.answer_key,
                                   "exact" if custom else reward, args.prompt_template))
            for path in args.data]
    tokenizer = load_tokenizer(args.model)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    model = load_pretrained(args.model, recipe=get_recipe(args.recipe), dtype=dtype, device=args.device)
    sampler = Sampler(model)
    fmt = PromptFormat(not args.no_chat_template, args.system_prompt, kwargs)
    stops = stop_token_ids(tokenizer, args.model)
    results = {}
    for path, examples, task in sets:
        examples = examples[:args.limit] if args.limit else examples
        print(f"minite eval: {path}: {len(examples)} questions x ({args.n} samples + greedy)",
              file=sys.stderr, flush=True)
        results[path] = evaluate_examples(sampler, tokenizer, examples, custom or task.reward, n=args.n,
                                          max_tokens=args.max_tokens, stop_token_ids=stops, prompt_format=fmt,
                                          stop=args.stop, temperature=args.temperature, top_p=args.top_p,
                                          top_k=args.top_k, seed=args.seed)
    if args.json:
        print(json.dumps({"model": args.model, "n": args.n, "reward": reward, "recipe": args.recipe,
                          "chat_template": fmt.uses_template(tokenizer), "files": results}))
    else:
        print(table(results, args.model, reward))
    return 0


def table(results: dict[str, dict], model: str, reward: str) -> str:
    keys = [k for k in next(iter(results.values())) if k == "greedy_accuracy" or "@" in k]
    rows = [["file", "size", *keys]] + [[Path(path).name, f"{int(m['size'])}", *(f"{m[k]:.3f}" for k in keys)]
                                        for path, m in results.items()]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"model {model}, reward {reward}"]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)
