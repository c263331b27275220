import sys
import threading
from fractions import Fraction

import pytest

from minite.rl.rewards import (
    answers_match,
    countdown_reward,
    evaluate_countdown,
    exact_match_reward,
    extract_answer,
    last_boxed,
    math_verify_available,
    math_verify_reward,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("9", "9"),
        ("3+4+2=9", "9"),
        ("7*3=21\n12+21=33\n#### 33", "33"),
        ("so #### 1,240 dollars", "1,240"),
        ("The answer is -12.", "-12"),
        ("Answer: 7 apples", "7"),
        ("first 3 then \\boxed{\\frac{3}{4}} and 5", "\\frac{3}{4}"),
        ("no digits here", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_last_boxed_nested_and_unclosed():
    assert last_boxed("\\boxed{1} then \\boxed{\\sqrt{2}}") == "\\sqrt{2}"
    assert last_boxed("\\boxed{12") is None
    assert last_boxed("nothing") is None


def test_answers_match_numbers_and_strings():
    assert answers_match("1,240", "1240")
    assert answers_match("42.0", "42")
    assert answers_match("$42", "42")
    assert answers_match("1/2", "0.5")
    assert not answers_match("41", "42")
    assert not answers_match(None, "42")
    assert answers_match("x  + 1", "x + 1")


@pytest.mark.parametrize(
    "completion, reward",
    [
        ("9", 1.0),  # correct, answer only
        (" 9\n", 1.0),
        ("2+7=9", 1.0),  # extra work before the answer
        ("The answer is 9.", 1.0),  # extra text
        ("8", 0.0),  # wrong
        ("9 or maybe 10", 0.0),  # the last number counts
        ("nine", 0.0),  # malformed
        ("", 0.0),
    ],
)
def test_exact_match_reward(completion, reward):
    assert exact_match_reward(completion, "9") == reward


NUMS, TARGET = [3, 5, 7], 22


@pytest.mark.parametrize(
    "completion, reward",
    [
        ("<answer>3 * 5 + 7</answer>", 1.0),
        ("let me think... <answer>(7 + 5) * 3 - 14</answer>", 0.1),  # 14 is not available
        ("<answer>7 * 3 + 1</answer>", 0.1),  # 1 is not available
        ("<answer>5 * 5 - 3</answer>", 0.1),  # 5 used twice
        ("<answer>3 * 5 + 7 = 22</answer>", 1.0),  # "= target" tail is tolerated
        ("<answer>3 * 5</answer>", 0.1),  # valid but wrong value
        ("<answer>7 / (5 - 5) + 3</answer>", 0.1),  # division by zero (and 5 twice)
        ("<answer>3 ** 5</answer>", 0.1),  # power is not allowed
        ("<answer>import os</answer>", 0.1),  # not an equation
        ("<answer></answer>", 0.1),  # empty
        ("3 * 5 + 7", 0.0),  # no answer tag
        ("<answer>3 * 5 + 7", 0.0),  # unclosed tag
        ("<answer>1 + 1</answer> <answer>3 * 5 + 7</answer>", 1.0),  # the last tag counts
        ("<answer>-3 + 25</answer>", 0.1),  # unary minus / unavailable number
    ],
)
def test_countdown_reward(completion, reward):
    assert countdown_reward(completion, NUMS, TARGET) == reward


def test_countdown_division_by_zero_and_non_integer_steps():
    assert countdown_reward("<answer>8 / (4 - 4)</answer>", [8, 4, 4], 2) == 0.1
    with pytest.raises(ValueError, match="division by zero"):
        evaluate_countdown("8 / (4 - 4)", [8, 4, 4])
    # (7 / 2) * 4 = 14 exactly, through the non-integer 7/2.
    assert evaluate_countdown("7 / 2 * 4", [7, 2, 4]) == Fraction(14)
    assert countdown_reward("<answer>7 / 2 * 4</answer>", [7, 2, 4], 14) == 1.0
    assert countdown_reward("<answer>7 / 2 * 4</answer>", [7, 2, 4], 14, integer_steps=True) == 0.1
    # 1/3 * 3 is exactly 1 (no float rounding).
    assert countdown_reward("<answer>1 / 3 * 3</answer>", [1, 3, 3], 1) == 1.0
    assert countdown_reward("<answer>7 / 2</answer>", [7, 2], 3) == 0.1


def test_countdown_use_all_and_custom_scores():
    assert countdown_reward("<answer>3 * 5 + 7</answer>", [3, 5, 7, 1], 22) == 1.0
    assert countdown_reward("<answer>3 * 5 + 7</answer>", [3, 5, 7, 1], 22, use_all=True) == 0.1
    assert countdown_reward("<answer>5 * 5</answer>", [5, 5], 25, use_all=True) == 1.0
    assert countdown_reward("<answer>3</answer>", [3], 4, format_score=0.0) == 0.0
    assert countdown_reward("<answer>3</answer>", [3], 3, correct_score=2.0) == 2.0


def test_math_verify_missing_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)
    assert not math_verify_available()
    with pytest.raises(ImportError, match="pip install math-verify"):
        math_verify_reward("\\boxed{2}", "2")


# MATH-style golds as datasets store them (bare LaTeX); each scores 1 against its own boxed answer
MATH_GOLDS = ["\\frac{1}{2}", "\\dfrac{1}{2}", "\\sqrt{2}", "2\\sqrt{3}", "\\pi", "(1,2)", "[0,1)",
              "(-\\infty, 3]", "\\{1,2\\}", "\\infty", "-\\frac{3}{4}", "42", "-7", "B", "\\text{(C)}"]


@pytest.mark.skipif(not math_verify_available(), reason="math-verify is not installed")
@pytest.mark.parametrize("gold", MATH_GOLDS)
def test_math_verify_scores_the_verbatim_boxed_answer(gold):
    assert math_verify_reward(f"The answer is $\\boxed{{{gold}}}$.", gold) == 1.0
    assert math_verify_reward("The answer is $\\boxed{1000}$.", gold) == 0.0


@pytest.mark.skipif(not math_verify_available(), reason="math-verify is not installed")
def test_math_verify_reward_in_and_off_main_thread():
    assert math_verify_reward("so the answer is $\\boxed{\\frac{1}{2}}$", "$0.5$") == 1.0
    assert math_verify_reward("$\\boxed{3}$", "$2$") == 0.0
    out = []
    t = threading.Thread(target=lambda: out.append(math_verify_reward("$\\boxed{2}$", "$2$")))
    t.start()
    t.join()
    assert out == [1.0]
