"""An example Environment for multi-turn episodes: the arithmetic tasks (rollout_service/examples/tasks.py) with a
calculator tool.

The model may write `<calc>EXPR</calc>`; sampled with `stop=STOP`, its turn ends there and the environment
answers `<result>VALUE</result>` as raw text, so the model goes on in the same assistant turn. EXPR is
numbers, + - * / and parentheses, evaluated from its syntax tree (never eval). A turn without a tool call
is the final answer: the last non-empty line is scored as tasks.reward scores a reply (1 + format bonus
for the right number, the bonus alone for a well-formed wrong one) and the episode is done.
"""
from __future__ import annotations

import ast
import math
import operator
import re
from fractions import Fraction
from typing import Any

from rollout_service.examples import tasks

STOP = ["</calc>"]  # the turn's stop string: sample with SamplingParams(stop=STOP)
SYSTEM = ("You are a calculator. To compute, write <calc>EXPR</calc> with numbers, + - * / and parentheses; "
          "the result comes back as <result>VALUE</result>. End with only the final result on the last line.")
MAX_EXPR_CHARS = 200
_CALL = re.compile(r"<calc>(.*?)</calc>", re.S)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def evaluate(expr: str) -> Fraction:
    """The value of an arithmetic expression: numbers, + - * / and parentheses (exact, as a Fraction).
    ValueError naming what is not allowed, a syntax error or a division by zero."""
    if not isinstance(expr, str):
        raise ValueError(f"expected an expression string, got {type(expr).__name__}")
    if len(expr) > MAX_EXPR_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expr.strip()[:40]!r}") from None
    return _value(tree.body)


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if not math.isfinite(node.value):
            raise ValueError(f"number {node.value!r} is out of range")
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        v = _value(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ValueError("division by zero")
        return _OPS[type(node.op)](left, right)
    what = type(node.op).__name__ if isinstance(node, (ast.BinOp, ast.UnaryOp)) else type(node).__name__
    raise ValueError(f"{what} is not allowed: only numbers, + - * / and parentheses")


def format_value(v: Fraction) -> str:
    """An integer as itself, anything else as a decimal of up to 10 significant digits."""
    if v.denominator == 1:
        return str(v.numerator)
    try:
        return f"{float(v):.10g}"
    except OverflowError:
        raise ValueError("result out of range") from None


def tool_answer(expr: str) -> str:
    """What the environment appends for a tool call: `<result>VALUE</result>` or `<result>error: ...</result>`."""
    try:
        return f"<result>{format_value(evaluate(expr))}</result>"
    except ValueError as e:
        return f"<result>error: {e}</result>"


class CalculatorEnv:
    """One arithmetic problem with the calculator tool. `problem`: a tasks.Problem, or None to take it from
    reset's metadata ({"a", "b", "op"}, as Problem.to_metadata() gives)."""

    def __init__(self, problem: tasks.Problem | None = None):
        self.problem = problem
        self.calls = 0

    def reset(self, metadata: Any) -> list[dict]:
        if metadata is not None:
            self.problem = tasks.Problem(metadata["a"], metadata["b"], metadata["op"])
        if self.problem is None:
            raise ValueError("CalculatorEnv: no problem (give one, or {'a', 'b', 'op'} as the metadata)")
        self.calls = 0
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": self.problem.question}]

    def step(self, assistant_text: str) -> tuple[str, float, bool]:
        calls = _CALL.findall(assistant_text)
        if calls:
            self.calls += 1
            return tool_answer(calls[-1]), 0.0, False
        lines = [ln for ln in assistant_text.splitlines() if ln.strip()]
        return "", tasks.reward(lines[-1] if lines else "", self.problem.answer), True
