"""A verifiable task generated in code: small integer arithmetic with a strict answer format.

The reply's first line must be just the result, optionally after the restated sum and an "Answer:"
prefix: "7", "3 + 4 = 7", "Answer: 7". Anything else on that line (a sentence, a derivation cut off
by max_tokens) is ill-formed and earns nothing. Reward = 1 for the right number in that format plus a
small bonus for the format alone; held-out problems are a fixed, seeded split disjoint from training,
so accuracy on them measures learning, not memorisation of the prompts it was trained on.

Honest note: the embedded SmolLM2-135M-Instruct mostly knows small sums but often wraps them in prose
("To add 6 and 10, you ..."), so much of what RL buys on this task is the terse format.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

FORMAT_REWARD = 0.1
SYSTEM = "You are a calculator. Reply with only the result."
_LINE = re.compile(r"^\s*(?:Answer:\s*)?(?:\d+\s*[-+]\s*\d+\s*=\s*)?(-?\d+)\s*\.?\s*$")


@dataclass(frozen=True)
class Problem:
    a: int
    b: int
    op: str

    @property
    def answer(self) -> int:
        return self.a + self.b if self.op == "+" else self.a - self.b

    @property
    def question(self) -> str:
        return f"What is {self.a} {self.op} {self.b}?"

    def messages(self) -> list[dict]:
        """The chat prompt (a short system line keeps prompts short and states the format)."""
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": self.question}]

    def to_metadata(self) -> dict:
        return {"a": self.a, "b": self.b, "op": self.op, "answer": self.answer}


def all_problems(max_operand: int = 12, ops: str = "+-") -> list[Problem]:
    """Every a op b with 0 <= a, b <= max_operand (subtraction only where the result is >= 0)."""
    out = [Problem(a, b, op) for op in ops for a in range(max_operand + 1) for b in range(max_operand + 1)
           if op == "+" or a >= b]
    if not out:
        raise ValueError(f"no problems for max_operand={max_operand}, ops={ops!r}")
    return out


def split(heldout_size: int = 64, max_operand: int = 12, ops: str = "+-", seed: int = 0
          ) -> tuple[list[Problem], list[Problem]]:
    """(train, heldout): a fixed seeded shuffle, the first `heldout_size` problems held out."""
    problems = all_problems(max_operand, ops)
    if not 0 < heldout_size < len(problems):
        raise ValueError(f"heldout_size={heldout_size} must be in (0, {len(problems)})")
    random.Random(seed).shuffle(problems)
    return problems[heldout_size:], problems[:heldout_size]


def parse_answer(text: str) -> int | None:
    """The result on the reply's first line when that line is well-formed, else None."""
    m = _LINE.match(text.split("\n", 1)[0])
    return int(m.group(1)) if m else None


def reward(text: str, answer: int) -> float:
    """1 + FORMAT_REWARD for a correct, well-formed reply; FORMAT_REWARD for a well-formed wrong one; 0 else."""
    got = parse_answer(text)
    if got is None:
        return 0.0
    return FORMAT_REWARD + (1.0 if got == answer else 0.0)


def is_correct(text: str, answer: int) -> bool:
    return parse_answer(text) == answer


class ProblemSampler:
    """Draws training problems without replacement (reshuffling each epoch), reproducibly from a seed."""

    def __init__(self, problems: list[Problem], seed: int = 0):
        if not problems:
            raise ValueError("ProblemSampler needs at least one problem")
        self.problems = list(problems)
        self.rng = random.Random(seed)
        self._order: list[Problem] = []

    def sample(self, k: int) -> list[Problem]:
        out = []
        while len(out) < k:
            if not self._order:
                self._order = self.rng.sample(self.problems, len(self.problems))
            out.append(self._order.pop())
        return out
