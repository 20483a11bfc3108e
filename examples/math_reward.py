r"""A verifiable reward for math answers, standard library only:

    python -m rlhf_paro.train actor.path=DIR data.train_files=math.jsonl \
        reward.function=examples/math_reward.py:score

Each prompt's row holds its reference answer in the column ``answer`` (a GSM8K solution that ends
in ``#### 72`` works too: what follows the last ``####`` is the answer). A response's final answer
is its last ``\boxed{...}``, else its last number. It scores 1.0 when it equals the reference,
exactly as numbers when both read as one (``1,000`` = ``1000.0``, ``\frac{1}{2}`` = ``0.5`` =
``1/2``), else as text (lower case, without spaces, ``$``, ``\left``/``\right`` and a leading
``x =``), and 0.0 otherwise. ``has_answer`` says whether a final answer was found at all and is
logged as ``reward/has_answer``.

``math_verify_reward.py`` beside this file judges with the optional math-verify package instead,
which also knows that ``2x+2`` is ``2(x+1)``.
"""

from __future__ import annotations

import re
from fractions import Fraction

# A number in running text: 72, -3, 1,000 (thousands only), 0.5, 3/4. A minus sign right after
# a word or a closing bracket is a subtraction (5-3), not part of the number.
NUMBER = re.compile(r"(?:(?<![\w)\]])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?")
# What Fraction is given: no exponent, so a response's 1e999999999 cannot cost a huge integer.
PLAIN_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")
FRAC = re.compile(r"^(-?)\\[dt]?frac\{(\d+)\}\{(\d+)\}$")
TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")


def score(prompts: list[str], responses: list[str], answer: list, **columns
          ) -> list[dict[str, float]]:
    """One ``{"score": 1.0 or 0.0, "has_answer": 1.0 or 0.0}`` per response."""
    out = []
    for response, reference in zip(responses, answer):
        found = final_answer(response)
        right = found is not None and same_answer(found, reference_answer(str(reference)))
        out.append({"score": float(right), "has_answer": float(found is not None)})
    return out


def final_answer(response: str) -> str | None:
    """The last ``\\boxed{...}`` of ``response``, else its last number, else None."""
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed
    numbers = NUMBER.findall(response)
    return numbers[-1] if numbers else None


def reference_answer(reference: str) -> str:
    """The answer in a reference: after the last ``####``, or its last ``\\boxed{...}``, or all
    of it."""
    if "####" in reference:
        return reference.rpartition("####")[2]
    boxed = last_boxed(reference)
    return boxed if boxed is not None else reference


def last_boxed(text: str) -> str | None:
    """What the last ``\\boxed{...}`` holds, braces inside it kept; None when there is none or
    it is cut off (a response stopped at its length limit)."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    opening = start + len("\\boxed")
    while opening < len(text) and text[opening] == " ":
        opening += 1
    if text[opening:opening + 1] != "{":
        return None
    depth = 0
    for i in range(opening, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[opening + 1:i]
    return None


def same_answer(found: str, reference: str) -> bool:
    a, b = normalise(found), normalise(reference)
    x, y = as_number(a), as_number(b)
    if x is not None and y is not None:
        return x == y
    return a == b


def normalise(answer: str) -> str:
    text = TEXT.sub(r"\1", answer)
    for noise in ("$", "\\left", "\\right", "\\!", "\\,", "\\;", " "):
        text = text.replace(noise, "")
    text = text.strip().rstrip(".").lower()
    # "x=5" answers 5: keep the right side of a single variable's assignment.
    return re.sub(r"^[a-z]\w*=(?!.*=)", "", text)


def as_number(text: str) -> Fraction | None:
    """``text`` (normalised) as an exact number, or None if it is not one."""
    frac = FRAC.match(text)
    if frac:
        text = f"{frac[1]}{frac[2]}/{frac[3]}"
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", text):
        text = text.replace(",", "")
    if not PLAIN_NUMBER.fullmatch(text):
        return None
    try:
        return Fraction(text)
    except ZeroDivisionError:  # 1/0
        return None
