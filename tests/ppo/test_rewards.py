"""What a reward function may return, and the one line that refuses anything else."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rlhf_paro.config import ConfigError
from rlhf_paro import usercode
from rlhf_paro.ppo import rewards
from rlhf_paro.ppo.rewards import RewardFunctionError, RewardOutput

SPEC = "my/fns.py:score"
PROMPTS = ["p0", "p1", "p2", "p3"]
RESPONSES = ["r0", "r1", "r2", "r3"]
WHERE = f"reward function {SPEC} at step 7"
ITEM = "expected a number or a dict with a numeric 'score'"
FINITE32 = "a finite real number within float32's range (|x| <= 3.403e+38)"
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def call(returned):
    """``call_function`` on a function that returns ``returned`` for the four responses."""
    return rewards.call_function(lambda prompts, responses, **columns: returned, SPEC, 7,
                                 PROMPTS, RESPONSES, {"answer": ["a"] * 4})


def items(second):
    """Four items, ``second`` the one at index 1."""
    return [1.0, second, 1.0, 1.0]


REFUSED = [
    # Before, a dict was read as its keys and a string as its characters: both now refused.
    ({0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}, "returned a dict; expected a list of 4 numbers or dicts "
                                        "with a numeric 'score'"),
    ("1111", "returned a str; expected a list of 4 numbers"),
    (None, "returned None; expected a list of 4"),
    ({1.0, 2.0, 3.0, 4.0}, "returned a set"),  # no order to match the responses by
    (np.ones((2, 2)), "returned a 2-D ndarray of float64"),
    (torch.tensor(1.0), "returned a 0-D Tensor of torch.float32"),
    ([1.0] * 3, "returned 3 values for 4 responses"),
    (items(None), f": item 1 is None; {ITEM}"),
    (items(True), f": item 1 is a bool; {ITEM}"),
    (np.array([True, False, True, True]), f": item 0 is a bool; {ITEM}"),
    (items(torch.tensor(True)), f": item 1 is a 0-D Tensor of torch.bool; {ITEM}"),
    (items("0.5"), f": item 1 is a str; {ITEM}"),
    (items([1.0]), f": item 1 is a list; {ITEM}"),
    (items(1j), f": item 1 is a complex; {ITEM}"),
    (items({"value": 1.0}), ": item 1 is a dict without a numeric 'score'"),
    (items({"score": "1"}), ": item 1 is a dict without a numeric 'score'"),
    (items({"score": False}), ": item 1 is a dict without a numeric 'score'"),
    (items({"score": 1.0, "ok": "yes"}), ": item 1's extra 'ok' is a str; expected a number"),
    (items({"score": 1.0, "a/b": 1.0}), ": item 1 has an extra named 'a/b'; allowed: letters, "
                                        "digits and _"),
    (items(math.nan), f": item 1 is nan; allowed: {FINITE32}"),
    (np.array([1.0, 2.0, -np.inf, 0.0]), ": item 2 is -inf; allowed: a finite real number"),
    (items(10**400), ": item 1 is inf; allowed"),
    (items({"score": math.inf}), ": item 1's score is inf; allowed"),
    (items({"score": 1.0, "x": math.nan}), ": item 1's 'x' is nan; allowed"),
    # Finite in float64, inf in the scores' float32 tensor: every step's loss was NaN, exit 0.
    (items(1e300), f": item 1 is 1e+300; allowed: {FINITE32}"),
    (items(-3.5e38), ": item 1 is -3.5e+38; allowed"),
    (items({"score": 1e39}), ": item 1's score is 1e+39; allowed"),
    (items({"score": 1.0, "x": 1e300}), ": item 1's 'x' is 1e+300; allowed"),
    (np.array([1.0, 2.0, 1e300, 0.0]), ": item 2 is 1e+300; allowed"),
    (items(np.float64(1e300)), ": item 1 is 1e+300; allowed"),
    (items(10**39), ": item 1 is 1e+39; allowed"),
]


@pytest.mark.parametrize("returned, message", REFUSED, ids=range(len(REFUSED)))
def test_every_refused_return_names_the_function_the_step_and_what_was_wrong(returned, message):
    with pytest.raises(RewardFunctionError) as err:
        call(returned)
    line = str(err.value)
    assert line.startswith(WHERE) and message in line, line
    assert "\n" not in line


ACCEPTED = [
    ([1, 0.5, -2, 3.0], [1.0, 0.5, -2.0, 3.0]),
    ((1, 0.5, -2, 3.0), [1.0, 0.5, -2.0, 3.0]),
    (np.array([1, 0.5, -2, 3], dtype=np.float32), [1.0, 0.5, -2.0, 3.0]),
    (np.array([1, 0, -2, 3]), [1.0, 0.0, -2.0, 3.0]),
    (torch.tensor([1, 0.5, -2, 3], dtype=torch.bfloat16), [1.0, 0.5, -2.0, 3.0]),
    ([np.float64(1), np.int64(0), torch.tensor(-2.0), torch.tensor(3)], [1.0, 0.0, -2.0, 3.0]),
    # float32's largest number is held, at either sign.
    ([FLOAT32_MAX, -FLOAT32_MAX, np.float32(3e38), 0], [FLOAT32_MAX, -FLOAT32_MAX,
                                                        float(np.float32(3e38)), 0.0]),
]


@pytest.mark.parametrize("returned, scores", ACCEPTED, ids=range(len(ACCEPTED)))
def test_numbers_in_a_list_tuple_array_or_tensor_are_the_scores(returned, scores):
    out = call(returned)
    assert out == RewardOutput(scores, {})
    assert all(type(s) is float for s in out.scores)
    # As the reward worker holds them: a float32 tensor, where each is still finite.
    assert torch.tensor(out.scores).isfinite().all()


def test_dicts_give_the_score_and_named_extras_with_none_where_an_item_lacks_one():
    out = call([{"score": 1, "has_answer": 1.0}, 0.25,
                {"score": np.float32(0.5), "has_answer": 0, "length": torch.tensor(7)},
                {"score": -1.0, "has_answer": None}])
    assert out.scores == [1.0, 0.25, 0.5, -1.0]
    assert out.extras == {"has_answer": [1.0, None, 0.0, None], "length": [None, None, 7.0, None]}
    # Back to items (what the reward server answers): an item without extras is a number.
    assert out.items() == [{"score": 1.0, "has_answer": 1.0}, 0.25,
                           {"score": 0.5, "has_answer": 0.0, "length": 7.0}, -1.0]


def test_a_function_that_raises_is_one_line_with_its_first_line():
    def broken(prompts, responses, **columns):
        raise ValueError("no score for you\nand more detail")

    with pytest.raises(RewardFunctionError) as err:
        rewards.call_function(broken, SPEC, 3, PROMPTS, RESPONSES, {})
    assert str(err.value) == f"reward function {SPEC} at step 3 raised ValueError: no score for you"


def test_a_file_that_exits_or_raises_on_import_is_a_config_error_naming_it(tmp_path):
    for body, said in [("raise SystemExit(0)", "SystemExit: 0"),
                       ("import sys\nsys.exit('bye')", "SystemExit: bye"),
                       ("1 / 0", "ZeroDivisionError: division by zero")]:
        file = tmp_path / "fails.py"
        file.write_text(body + "\n\ndef score(prompts, responses):\n    return [1.0]\n")
        with pytest.raises(ConfigError) as err:
            usercode.load_function(f"{file}:score")
        assert str(err.value) == f"reward.function: {file} fails on import: {said}"
    # Ctrl-C while a file loads still stops the program.
    file.write_text("raise KeyboardInterrupt\n")
    with pytest.raises(KeyboardInterrupt):
        usercode.load_function(f"{file}:score")


def test_load_function_checks_the_spec_and_the_name(tmp_path):
    file = tmp_path / "fns.py"
    file.write_text("def score(prompts, responses):\n    return [1.0]\n")
    assert usercode.load_function(f"{file}:score")(["p"], ["r"]) == [1.0]
    with pytest.raises(ConfigError, match=r"^spec: got 'fns\.py'; allowed: path/to/file\.py:"):
        usercode.load_function("fns.py", "spec")
    with pytest.raises(ConfigError, match=r"has no class or function 'nope'; allowed: function "
                                          r"score$"):
        usercode.load_function(f"{file}:nope")


def test_a_function_that_empties_its_lists_is_checked_against_the_lists_as_given():
    prompts, responses, columns = list(PROMPTS), list(RESPONSES), {"answer": ["a"] * 4}

    def greedy(prompts, responses, answer):
        prompts.clear(), responses.clear(), answer.clear()
        return []

    with pytest.raises(RewardFunctionError) as err:
        rewards.call_function(greedy, SPEC, 7, prompts, responses, columns)
    assert str(err.value) == f"{WHERE} returned 0 values for 4 responses"
    # It emptied copies: the caller's lists are as they were.
    assert (prompts, responses, columns) == (PROMPTS, RESPONSES, {"answer": ["a"] * 4})


@pytest.mark.parametrize("body, said", [
    ("raise KeyboardInterrupt", "KeyboardInterrupt"),
    ("raise SystemExit(3)", "SystemExit: 3"),
    ("import sys; sys.exit('no more')", "SystemExit: no more"),
], ids=["keyboard_interrupt", "exit_3", "exit_message"])
def test_a_function_that_exits_or_interrupts_is_one_line_naming_it_and_the_step(body, said):
    # On a worker these would read as a Ctrl-C of the run or the worker's own exit.
    namespace: dict = {}
    exec(f"def leaving(prompts, responses, **columns):\n    {body}\n", namespace)
    with pytest.raises(RewardFunctionError) as err:
        rewards.call_function(namespace["leaving"], SPEC, 7, PROMPTS, RESPONSES, {})
    assert str(err.value) == f"{WHERE} raised {said}"


@pytest.mark.parametrize("value", ["tok\n", "  tok\r\n", "\ttok "])
def test_a_token_is_read_without_the_whitespace_around_it(value):
    assert rewards.clean_token(value, "NAME", "reward.token_env") == "tok"


@pytest.mark.parametrize("value, said", [
    (" \n", "the environment variable NAME holds only whitespace"),
    ("t\nok", "the value of the environment variable NAME holds a control character or one "
              "outside Latin-1 (the value is not shown)"),
    ("t\x7fok", "the value of the environment variable NAME holds a control character"),
    ("t\u0100ok", "the value of the environment variable NAME holds a control character"),
])
def test_a_token_no_header_can_carry_is_refused_without_showing_it(value, said):
    with pytest.raises(ConfigError) as err:
        rewards.clean_token(value, "NAME", "reward.token_env")
    assert str(err.value).startswith(f"reward.token_env: {said}"), str(err.value)
    line = str(err.value)
    assert "\n" not in line and (not value.strip() or value.strip() not in line)
    # Latin-1 letters are header text: a token may hold them.
    assert rewards.clean_token("t\u00e9ok", "NAME", "reward.token_env") == "t\u00e9ok"
