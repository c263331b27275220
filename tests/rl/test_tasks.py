import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from minite.rl.rewards import evaluate_countdown
from minite.rl.tasks import Example, make_task, split_of
from minite.rl.tasks_builtin import ArithmeticTask, CountdownTask, worked_steps
from minite.rl.tasks_files import QATask, load_records

DATA = Path(__file__).resolve().parents[1] / "data"
GSM8K = DATA / "gsm8k_sample.jsonl"
MATH = DATA / "math_sample.jsonl"


def _prompts(task, split, n):
    return [ex.prompt for ex in task.batch(split, 0, n)]


@pytest.mark.parametrize("name, kwargs", [
    ("arithmetic", {}),
    ("arithmetic", {"worked": True, "operands": (3, 5), "digits": (1, 3), "ops": "+-*"}),
    ("countdown", {}),
])
def test_generated_tasks_are_deterministic_under_seed(name, kwargs):
    a, b = make_task(name, seed=1, **kwargs), make_task(name, seed=1, **kwargs)
    assert a.batch("train", 5, 40) == b.batch("train", 5, 40)
    assert a.batch("test", 0, 10) == b.batch("test", 0, 10)
    assert a.example("train", 17) == b.batch("train", 17, 1)[0]  # random access, no hidden state
    assert _prompts(a, "train", 40) != _prompts(make_task(name, seed=2, **kwargs), "train", 40)


@pytest.mark.parametrize("task", [
    ArithmeticTask(operands=(2, 2)),  # only 100 distinct problems
    ArithmeticTask(operands=(2, 3), ops="+-"),
    CountdownTask(n_numbers=(2, 3), num_range=(1, 9), target_range=(1, 30)),
])
def test_splits_never_overlap(task):
    key = (lambda ex: ex.meta["key"]) if isinstance(task, CountdownTask) else (lambda ex: ex.prompt)
    train = {key(ex) for ex in task.batch("train", 0, 1500)}
    test = {key(ex) for ex in task.batch("test", 0, 300)}
    assert train and test
    assert not train & test
    # The split of a problem does not depend on the seed.
    other = type(task)(**{**vars(task), "seed": 7})
    assert not {key(ex) for ex in other.batch("train", 0, 1500)} & test


def test_heldout_is_distinct_and_fixed():
    task = ArithmeticTask(operands=(2, 2))
    held = task.heldout(1000)
    prompts = [ex.prompt for ex in held]
    assert len(prompts) == len(set(prompts))
    assert 5 <= len(held) < 60  # about 20 % of the 100 single-digit sums, all found
    assert all(split_of(ex.meta["expr"], 0.2, "arithmetic") == "test" for ex in held)
    assert task.heldout(5) == held[:5]


def test_tiny_arithmetic_format():
    task = ArithmeticTask(operands=(2, 3), digits=(1, 1), ops="+")
    for ex in task.batch("train", 0, 200):
        assert ex.prompt.endswith("=")
        terms = ex.prompt[:-1].split("+")
        assert 2 <= len(terms) <= 3 and all(len(t) == 1 for t in terms)
        assert ex.answer == str(sum(map(int, terms))) == ex.solution
        assert task.reward(ex.solution, ex) == 1.0
        assert task.reward(str(int(ex.answer) + 1), ex) == 0.0


def test_worked_arithmetic():
    assert worked_steps([12, 7, 3, 4], ["+", "*", "-"]) == (["7*3=21", "12+21=33", "33-4=29"], 29)
    assert worked_steps([2, 3, 4], ["*", "*"]) == (["2*3=6", "6*4=24"], 24)
    assert worked_steps([9, 5], ["-"]) == (["9-5=4"], 4)
    task = ArithmeticTask(worked=True, operands=(3, 4), digits=(1, 2), ops="+-*")
    for ex in task.batch("train", 0, 100):
        assert ex.prompt.endswith("=?\n")
        assert ex.solution.endswith(f"#### {ex.answer}")
        n_operands = len(re.split(r"[-+*]", ex.meta["expr"]))
        assert len(ex.solution.splitlines()) == n_operands  # one line per operation, then the answer
        assert task.reward(ex.solution, ex) == 1.0
        assert task.reward(ex.solution.replace(f"#### {ex.answer}", "#### 99999"), ex) == 0.0


def test_arithmetic_strict_reward():
    task = ArithmeticTask(strict=True)
    ex = Example("3+4=", "7", "7")
    assert task.reward(" 7\n", ex) == 1.0
    assert task.reward("The answer is 7", ex) == 0.0
    assert ArithmeticTask().reward("The answer is 7", ex) == 1.0


def test_arithmetic_bad_arguments():
    with pytest.raises(ValueError, match="operands"):
        ArithmeticTask(operands=(1, 2))
    with pytest.raises(ValueError, match="ops"):
        ArithmeticTask(ops="+^")
    with pytest.raises(ValueError, match="split must be"):
        ArithmeticTask().example("validation", 0)


def test_countdown_problems_are_solvable_and_in_range():
    task = CountdownTask(n_numbers=(3, 4), num_range=(1, 99), target_range=(1, 100))
    for ex in task.batch("train", 0, 150):
        nums, target = ex.meta["nums"], ex.meta["target"]
        assert 3 <= len(nums) <= 4 and all(1 <= n <= 99 for n in nums)
        assert 1 <= target <= 100
        assert str(nums) in ex.prompt and str(target) in ex.prompt
        assert evaluate_countdown(ex.answer, nums, use_all=True, integer_steps=True) == target
        assert task.reward(ex.solution, ex) == 1.0
        assert task.reward("<answer>0</answer>", ex) == 0.1
        assert task.reward("no tag", ex) == 0.0


def test_qa_task_gsm8k_jsonl():
    task = QATask.from_files(GSM8K, heldout_fraction=0.5)
    rows = [task.example("train", i) for i in range(task.size("train"))] + task.heldout(100)
    assert sorted(ex.answer for ex in rows) == sorted(["27", "135", "8", "82", "1,240", "42"])
    assert task.size("train") + task.size("test") == 6 and task.size("test") > 0
    assert {ex.prompt for ex in task.heldout(100)}.isdisjoint(ex.prompt for ex in rows[: task.size("train")])
    ex = next(ex for ex in rows if ex.answer == "1,240")
    assert "<<" not in ex.solution and ex.solution.endswith("#### 1,240")
    assert task.reward(ex.solution, ex) == 1.0
    assert task.reward("They spend 1240 dollars. #### 1240", ex) == 1.0
    assert task.reward("#### 1241", ex) == 0.0


def test_qa_task_train_order_is_seeded_and_wraps():
    task = QATask.from_files(GSM8K, seed=3, heldout_fraction=0.01)
    n = task.size("train")
    epoch0 = [task.example("train", i).prompt for i in range(n)]
    epoch1 = [task.example("train", n + i).prompt for i in range(n)]
    assert sorted(epoch0) == sorted(epoch1) and len(set(epoch0)) == n
    again = QATask.from_files(GSM8K, seed=3, heldout_fraction=0.01)
    assert [again.example("train", i).prompt for i in range(2 * n)] == epoch0 + epoch1


def test_qa_task_configurable_columns_and_boxed_answers():
    task = QATask.from_files(MATH, question_key="problem", answer_key="solution", heldout_fraction=0.01,
                             prompt_template="Problem: {question}\nSolution:")
    by_answer = {ex.answer: ex for ex in task.batch("train", 0, task.size("train"))}
    assert sorted(by_answer) == sorted(["25", "\\frac{3}{4}", "121"])
    ex = by_answer["\\frac{3}{4}"]
    assert ex.prompt.startswith("Problem: Simplify") and ex.prompt.endswith("Solution:")
    assert task.reward("so it is \\boxed{\\frac{3}{4}}", ex) == 1.0
    assert task.reward("so it is \\boxed{\\frac{4}{3}}", ex) == 0.0


def test_qa_task_missing_column_is_named():
    with pytest.raises(KeyError, match=r"question column 'prompt' not found.*\['answer', 'question'\]"):
        QATask.from_files(GSM8K, question_key="prompt")
    with pytest.raises(KeyError, match="answer column 'final'"):
        QATask.from_files(MATH, question_key="problem", answer_key="final")
    with pytest.raises(ValueError, match="no '####'"):
        QATask.from_files(MATH, question_key="problem", answer_key="solution", answer_format="gsm8k")


def test_qa_task_separate_test_file_drops_overlap(tmp_path):
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines()]
    train, test = tmp_path / "train.jsonl", tmp_path / "test.json"
    train.write_text("\n".join(json.dumps(r) for r in rows[:5]) + "\n")
    test.write_text(json.dumps(rows[4:]))
    task = make_task("file", train_path=str(train), test_path=str(test))
    assert (task.size("train"), task.size("test")) == (4, 2)
    train_q = {task.example("train", i).meta["question"] for i in range(4)}
    assert train_q.isdisjoint(ex.meta["question"] for ex in task.heldout(10))


def test_load_records_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "a", "answer": "1"}\n{oops\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_records(bad)
    with pytest.raises(FileNotFoundError):
        load_records(tmp_path / "missing.jsonl")
    (tmp_path / "x.csv").write_text("q,a\n")
    with pytest.raises(ValueError, match="unsupported"):
        load_records(tmp_path / "x.csv")


@pytest.mark.skipif(importlib.util.find_spec("pyarrow") is None, reason="pyarrow is not installed")
def test_qa_task_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in GSM8K.read_text().splitlines()]
    path = tmp_path / "gsm8k.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    task = QATask.from_files(path, heldout_fraction=0.5)
    examples = [task.example(s, i) for s in ("train", "test") for i in range(task.size(s))]
    assert len(examples) == len(rows) and "27" in {ex.answer for ex in examples}


@pytest.mark.skipif(importlib.util.find_spec("datasets") is not None, reason="datasets is installed")
def test_hf_task_without_datasets_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match="pip install datasets"):
        make_task("hf", path="openai/gsm8k", config="main")


def test_make_task_unknown_name():
    with pytest.raises(ValueError, match="unknown task 'gsm9k'"):
        make_task("gsm9k")


def test_math_verify_reward_requires_the_package():
    if importlib.util.find_spec("math_verify") is not None:
        pytest.skip("math-verify is installed")
    with pytest.raises(ImportError, match="pip install math-verify"):
        QATask.from_files(GSM8K, reward="math_verify")


def test_a_task_class_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "my_tasks.py").write_text(
        "from minite.rl.tasks import Example, Task\n\n"
        "class Echo(Task):\n"
        "    def __init__(self, word='hi', seed=0):\n"
        "        self.word, self.seed = word, seed\n"
        "    def example(self, split, index):\n"
        "        return Example(f'{split} {index}: say {self.word}', self.word)\n"
        "    def size(self, split):\n"
        "        return None\n"
        "    def reward(self, completion, example):\n"
        "        return float(completion.strip() == example.answer)\n\n"
        "class NotATask:\n"
        "    pass\n")
    monkeypatch.chdir(tmp_path)
    task = make_task(f"{tmp_path / 'my_tasks.py'}:Echo", seed=3, word="yes")
    assert task.seed == 3 and task.example("test", 2).prompt == "test 2: say yes"
    assert task.reward(" yes", task.example("train", 0)) == 1.0
    with pytest.raises(ValueError, match="not a subclass"):
        make_task("my_tasks.py:NotATask")
    with pytest.raises(ValueError, match="has no class 'Nope'"):
        make_task("my_tasks.py:Nope")
