"""The shipped math rewards, on hand-written answers, loaded as ``reward.function`` loads them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from rlhf_paro.config import ConfigError
from rlhf_paro import usercode
from rlhf_paro.ppo import rewards

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

CASES = [
    # (response, reference answer, score, has_answer)
    ("so the total is \\boxed{72}.", "72", 1.0, 1.0),
    ("It costs 1,000 dollars.", "1000.0", 1.0, 1.0),  # thousands separator, exact number
    ("half: \\boxed{\\frac{1}{2}}", "0.5", 1.0, 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "3/4", 1.0, 1.0),
    ("first 3, then \\boxed{4}, finally 5", "4", 1.0, 1.0),  # the box wins over the last number
    ("\\boxed{1} and later \\boxed{2}", "1", 0.0, 1.0),  # the last box is the answer
    ("5 - 3 leaves 2", "2", 1.0, 1.0),
    ("10-3", "3", 1.0, 1.0),  # a subtraction: the last number is 3, not -3
    ("it drops by -3", "-3", 1.0, 1.0),
    ("the answer is 7", "Natalia sold 48 + 24 = 72 clips.\n#### 72", 0.0, 1.0),
    ("48 + 24 = 72", "Natalia sold 48 + 24 = 72 clips.\n#### 72", 1.0, 1.0),
    ("\\boxed{x = -3}", "-3", 1.0, 1.0),
    ("\\boxed{\\text{Monday}}", "monday", 1.0, 1.0),  # not numbers: compared as text
    ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)", 1.0, 1.0),
    ("I do not know.", "4", 0.0, 0.0),
    ("cut off at \\boxed{12", "12", 1.0, 1.0),  # an unclosed box: the last number
    ("\\boxed{1e999999999}", "1", 0.0, 1.0),  # an exponent is text, never a huge number
    ("\\boxed{1/0}", "1/0", 1.0, 1.0),  # no number, the same text
]


def test_the_stdlib_math_reward_scores_and_flags_an_answer():
    score = usercode.load_function(f"{EXAMPLES}/math_reward.py:score")
    responses, answers, expected = [c[0] for c in CASES], [c[1] for c in CASES], CASES
    out = rewards.call_function(score, "math_reward.py:score", 1, ["q"] * len(CASES), responses,
                                {"answer": answers, "level": ["easy"] * len(CASES)})
    for case, got, has in zip(expected, out.scores, out.extras["has_answer"]):
        assert (got, has) == case[2:], case


@pytest.mark.skipif(importlib.util.find_spec("math_verify") is not None,
                    reason="math-verify is installed")
def test_the_math_verify_reward_without_the_package_is_one_line_at_load():
    with pytest.raises(ConfigError, match=r"math_verify_reward\.py fails on import: ImportError: "
                                          r"needs the optional package math-verify: pip install"):
        usercode.load_function(f"{EXAMPLES}/math_verify_reward.py:score")


def test_the_math_verify_reward_judges_as_mathematics():
    pytest.importorskip("math_verify")
    score = usercode.load_function(f"{EXAMPLES}/math_verify_reward.py:score")
    out = rewards.call_function(
        score, "math_verify_reward.py:score", 1, ["q"] * 4,
        ["so \\boxed{2(x+1)}", "\\boxed{\\frac{1}{2}}", "It is \\boxed{999}", "no idea"],
        {"answer": ["2x+2", "0.5", "sum #### 1,000", "3"]})
    assert out.scores == [1.0, 1.0, 0.0, 0.0]
    assert out.extras == {"has_answer": [1.0, 1.0, 1.0, 0.0]}
