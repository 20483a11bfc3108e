"""The math reward of ``math_reward.py``, judged by the optional math-verify package, which
compares answers as mathematics (``2x+2`` is ``2(x+1)``, ``{1,2}`` is ``{2,1}``):

    pip install 'rlhf_paro[math]'        # or: pip install math-verify
    python -m rlhf_paro.train ... reward.function=examples/math_verify_reward.py:score

The rows' ``answer`` column holds the reference (LaTeX or plain; a GSM8K solution's ``#### 72``
works too). Each response scores ``{"score": 1.0 or 0.0, "has_answer": 1.0 or 0.0}``, as in
``math_reward.py``. Without math-verify the run stops at the start with one line saying so.
"""

from __future__ import annotations

import threading

try:
    from math_verify import parse, verify
except ImportError:
    raise ImportError("needs the optional package math-verify: pip install 'rlhf_paro[math]'"
                      ) from None

TIMEOUT_S = 5


def score(prompts: list[str], responses: list[str], answer: list, **columns
          ) -> list[dict[str, float]]:
    # math-verify bounds its time with SIGALRM, which only the main thread may set: a threaded
    # caller (the reward server) goes without the bound.
    timeout = TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    out = []
    for response, reference in zip(responses, answer):
        reference = str(reference).rpartition("####")[2].strip()
        if "$" not in reference and "\\boxed" not in reference:
            reference = f"${reference}$"  # what math-verify reads a plain LaTeX answer in
        gold = parse(reference, parsing_timeout=timeout)
        found = parse(response, parsing_timeout=timeout)
        right = bool(found) and verify(gold, found, timeout_seconds=timeout)
        out.append({"score": float(right), "has_answer": float(bool(found))})
    return out
