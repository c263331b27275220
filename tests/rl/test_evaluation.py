"""pass@k against its definition (every k-subset), avg and majority vote, the eval file reader."""

import itertools
import json

import pytest

from minite.rl.evaluation import ks, majority_correct, pass_at_k, read_eval_file, sample_metrics


@pytest.mark.parametrize("n,c,k", [(4, 0, 1), (4, 1, 1), (4, 1, 4), (5, 2, 2), (8, 3, 4), (6, 6, 3)])
def test_pass_at_k_is_the_share_of_k_subsets_holding_a_correct_sample(n, c, k):
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(samples, k))
    assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets), abs=1e-12)


def test_pass_at_k_refuses_k_above_n():
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(2, 1, 3)


def test_ks_are_powers_of_two_and_n():
    assert ks(1) == [1] and ks(4) == [1, 2, 4] and ks(6) == [1, 2, 4, 6]


def test_majority_vote_and_sample_metrics():
    # answers 7, 7, 9, none: the vote is 7, which is correct
    assert majority_correct(["= 7", "so 7", "9", "no idea"], [True, True, False, False])
    assert not majority_correct(["9", "9", "7"], [False, False, True])
    m = sample_metrics([["7", "7", "9", "x"], ["1", "2", "3", "4"]], [[1, 1, 0, 0], [0, 0, 0, 1]])
    assert m["pass@1"] == pytest.approx((0.5 + 0.25) / 2) == m["avg@4"]
    assert m["pass@4"] == 1.0 and m["maj@4"] == 0.5


def test_eval_files_of_both_styles(tmp_path):
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text(json.dumps({"question": "1+1?", "answer": "1+1=2\n#### 2"}) + "\n")
    math = tmp_path / "math.jsonl"
    math.write_text(json.dumps({"problem": "Half?", "solution": "It is $\\boxed{\\frac{1}{2}}$."}) + "\n")
    (ex,), task = read_eval_file(gsm)
    assert (ex.prompt, ex.answer) == ("1+1?", "2") and task.reward("so #### 2", ex) == 1.0
    (ex,), task = read_eval_file(math, reward="math_verify")
    assert ex.answer == "\\frac{1}{2}" and task.reward("$\\boxed{0.5}$", ex) == 1.0
    with pytest.raises(ValueError, match="no question column"):
        read_eval_file(_write(tmp_path / "bad.jsonl", {"q": "x", "answer": "1"}))


def _write(path, row):
    path.write_text(json.dumps(row) + "\n")
    return path
