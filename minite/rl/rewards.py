"""Reward functions: answer extraction, exact match, Countdown, and optional `math-verify`.

All rewards take the raw completion text (what the sampler produced, decoded, without the prompt) and
return a Python float.

- `extract_answer(text)`: the final answer of a completion, looked for in this order: the content of
  the last `\\boxed{...}`, the text after the last `####` (GSM8K), the text after the last
  "answer is" / "answer:", and finally the last number anywhere in the text.
- `exact_match_reward(completion, gold)`: 1.0 when the extracted answer equals the gold answer,
  compared as exact rationals when both parse as numbers ("1,000" == "1000" == "1000.0"), else as
  whitespace-normalized strings; 0.0 otherwise.
- `countdown_reward(completion, nums, target)`: TinyZero's scheme. The equation is the content of the
  last `<answer>...</answer>`. No answer tag: 0.0. A tag whose content is not a valid equation over
  the given numbers, or whose value differs from the target: `format_score` (0.1). A valid equation
  whose exact value equals the target: `correct_score` (1.0, not 1.1). Valid means: only integers,
  `+ - * /` and parentheses; every number one of `nums`, each used at most once (all of them when
  `use_all`); no division by zero; with `integer_steps`, no non-integer intermediate result.
  Evaluation is exact (fractions), never `eval`.
- `math_verify_reward(completion, gold)`: `math_verify.verify(parse(gold), parse(completion))`,
  gold first, the gold parsed inside `\\boxed{}` (as verl and TRL do: a bare LaTeX gold parses to
  nothing). Needs `pip install math-verify`. Its timeouts use SIGALRM, which works only in the
  main thread; elsewhere this function turns the timeouts off rather than crash.
"""

import ast
import re
import threading
from fractions import Fraction

_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?|-?\.\d+")
_ANSWER_IS = re.compile(r"answer(?:\s+is|\s*:)\s*", re.IGNORECASE)
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_MAX_EQUATION_CHARS = 200


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced; None if absent."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
    return None


def last_number(text: str) -> str | None:
    """The last number in `text` (sign, thousands commas and decimals kept), or None."""
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def extract_answer(text: str) -> str | None:
    """The final answer of a completion (see the module docstring for the order); None if none."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        number = _NUMBER.match(tail)
        if number:
            return number.group(0)
        return tail.splitlines()[0].strip() if tail else None
    matches = list(_ANSWER_IS.finditer(text))
    if matches:
        tail = text[matches[-1].end() :]
        number = _NUMBER.match(tail.lstrip("$ "))
        if number:
            return number.group(0)
    return last_number(text)


def to_number(text: str) -> Fraction | None:
    """`text` as an exact rational if it is a plain number ("$1,000.50", "-3", "2/4"), else None."""
    s = text.strip().rstrip(".").replace(",", "").replace("$", "").replace(" ", "")
    if s.endswith("%"):
        s = s[:-1]
    if not s:
        return None
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(pred: str | None, gold: str) -> bool:
    """True when `pred` equals `gold` as numbers (exactly) or as whitespace-normalized strings."""
    if pred is None:
        return False
    a, b = to_number(pred), to_number(gold)
    if a is not None and b is not None:
        return a == b
    return " ".join(pred.split()) == " ".join(gold.split())


def exact_match_reward(completion: str, gold: str) -> float:
    """1.0 when the answer extracted from `completion` matches `gold`, else 0.0."""
    return 1.0 if answers_match(extract_answer(completion), gold) else 0.0


def _eval_node(node: ast.AST, used: list[int], integer_steps: bool) -> Fraction:
    """Exact value of a Countdown expression node; raises ValueError when it is not allowed."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
        a = _eval_node(node.left, used, integer_steps)
        b = _eval_node(node.right, used, integer_steps)
        if isinstance(node.op, ast.Add):
            out = a + b
        elif isinstance(node.op, ast.Sub):
            out = a - b
        elif isinstance(node.op, ast.Mult):
            out = a * b
        else:
            if b == 0:
                raise ValueError("division by zero")
            out = a / b
        if integer_steps and out.denominator != 1:
            raise ValueError(f"non-integer intermediate result {out}")
        return out
    raise ValueError(f"not allowed in a Countdown equation: {ast.dump(node)}")


def evaluate_countdown(equation: str, nums: list[int], use_all: bool = False,
                       integer_steps: bool = False) -> Fraction:
    """Exact value of `equation` over `nums`; ValueError if it is not a valid Countdown equation."""
    equation = equation.strip()
    if "=" in equation:
        equation = equation.split("=", 1)[0].strip()
    if not equation or len(equation) > _MAX_EQUATION_CHARS:
        raise ValueError("empty or overlong equation")
    if not re.fullmatch(r"[\d+\-*/() ]+", equation):
        raise ValueError(f"equation has characters other than digits, + - * / ( ): {equation!r}")
    try:
        tree = ast.parse(equation, mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an expression: {equation!r}") from e
    used: list[int] = []
    value = _eval_node(tree.body, used, integer_steps)
    pool = list(nums)
    for n in used:
        if n not in pool:
            raise ValueError(f"{n} is not available (numbers {nums}, each usable once)")
        pool.remove(n)
    if use_all and pool:
        raise ValueError(f"numbers {pool} are unused")
    return value


def countdown_reward(completion: str, nums: list[int], target: int, format_score: float = 0.1,
                     correct_score: float = 1.0, use_all: bool = False,
                     integer_steps: bool = False) -> float:
    """TinyZero's Countdown reward (see the module docstring)."""
    tags = _ANSWER_TAG.findall(completion)
    if not tags:
        return 0.0
    try:
        value = evaluate_countdown(tags[-1], nums, use_all=use_all, integer_steps=integer_steps)
    except ValueError:
        return format_score
    return correct_score if value == target else format_score


def math_verify_available() -> bool:
    """True when the optional `math-verify` package can be imported."""
    try:
        import math_verify  # noqa: F401
    except ImportError:
        return False
    return True


def _boxed(gold: str) -> str:
    """The gold answer as math-verify reads LaTeX: inside `\\boxed{}` (bare, `\\dfrac{1}{2}`, `\\sqrt{2}`,
    `\\pi`, `(1,2)` parse to nothing, `2\\sqrt{3}` to 2), unless it is boxed or delimited already."""
    return gold if "\\boxed" in gold or "$" in gold else f"\\boxed{{{gold}}}"


def math_verify_reward(completion: str, gold: str) -> float:
    """1.0 when `math-verify` judges the completion's answer equal to `gold`, else 0.0."""
    try:
        from math_verify import parse, verify
    except ImportError as e:
        raise ImportError(
            "reward 'math_verify' needs the optional math-verify package: "
            "pip install math-verify (or pip install 'minite[math]')"
        ) from e
    try:
        from math_verify.errors import TimeoutException
    except ImportError:
        TimeoutException = Exception
    # math-verify's timeouts are SIGALRM based and raise outside the main thread.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    try:
        gold_parsed = parse(_boxed(gold), parsing_timeout=timeout)
        pred_parsed = parse(completion, parsing_timeout=timeout)
        return 1.0 if verify(gold_parsed, pred_parsed, timeout_seconds=timeout) else 0.0
    except (Exception, TimeoutException):
        return 0.0
