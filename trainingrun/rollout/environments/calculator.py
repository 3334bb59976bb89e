"""`environment.type: calculator`: a tool-use task. The model may call a calculator any number of times, then answers.

    model turn "<calc>12 + 7 * 3</calc>"   a tool call: the environment evaluates the expression and answers with its
                                            value ("33"; a bad expression gets "error: ..."), role "tool"
    model turn "the answer is 33"           no call: the final answer; reward 1.0 if its last number equals the
                                            prompt's reference (within 1e-6), else 0.0; the episode is done

The closing tag may be missing (a turn that stopped at a stop token, or at maxNewTokens). Expressions: numbers,
+ - * / // % **, unary signs, parentheses — evaluated on the syntax tree, nothing else (no names, no calls), with
bounds so no expression can hang or flood the worker (at most 256 characters, exponents up to 64, magnitudes up to
1e15). A tool error is the model's mistake, not the environment's: counted as `tool_errors`, the episode goes on.

Settings (`environment.config`): `calls` (most tool calls per episode; later calls get "error: no calls left"),
`instructions` (text put before the prompt in the first observation, default none).
"""

from __future__ import annotations

import ast
import math
import operator
import re
from typing import Any

from trainingrun.rollout.environments.base import StepResult

CALL = re.compile(r"<calc>(.*?)(?:</calc>|$)", re.DOTALL)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
MAX_EXPRESSION = 256
MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e15
BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
          ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalcError(ValueError):
    pass


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression (see the module docstring); CalcError saying what is wrong."""
    text = expression.strip()
    if not text:
        raise CalcError("empty expression")
    if len(text) > MAX_EXPRESSION:
        raise CalcError(f"expression longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise CalcError(f"cannot parse {text!r}") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return _bounded(UNARY[type(node.op)](_value(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalcError(f"exponent {right} out of range (at most {MAX_EXPONENT})")
        try:
            return _bounded(BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalcError("division by zero") from None
        except (OverflowError, TypeError):  # TypeError: a negative number to a fractional power is complex
            raise CalcError("result out of range") from None
    raise CalcError(f"not arithmetic: {ast.unparse(node)[:40]!r}")


def _bounded(x: int | float) -> int | float:
    if isinstance(x, complex) or not math.isfinite(x) or abs(x) > MAX_MAGNITUDE:
        raise CalcError("result out of range")
    return x


def format_number(x: int | float) -> str:
    if isinstance(x, float) and x.is_integer():
        x = int(x)
    return str(x) if isinstance(x, int) else f"{x:.10g}"


def answer_matches(turn: str, reference: Any) -> bool:
    """The turn's last number equals the reference (a number or its text) within 1e-6."""
    numbers = NUMBER.findall(turn)
    try:
        want = float(str(reference).strip())
    except ValueError:
        return False
    return bool(numbers) and abs(float(numbers[-1]) - want) <= 1e-6


class Calculator:
    """See the module docstring."""

    def __init__(self, calls: int = 8, instructions: str = ""):
        if isinstance(calls, bool) or not isinstance(calls, int) or calls < 0:
            raise ValueError(f"calculator: calls must be a non-negative int, got {calls!r}")
        self.calls_left = calls
        self.instructions = str(instructions)
        self.reference: Any = None

    def reset(self, prompt: dict[str, Any]) -> str:
        text = prompt.get("text")
        if not text:
            raise ValueError("calculator: the prompt has no text (use reasoningGym or jsonl prompts)")
        self.reference = prompt.get("reference")
        return f"{self.instructions}{text}"

    def step(self, turn: str) -> StepResult:
        call = CALL.search(turn)
        if call is None:
            reward = 1.0 if answer_matches(turn, self.reference) else 0.0
            return StepResult(observation=None, reward=reward, done=True)
        if self.calls_left <= 0:
            return StepResult(observation="error: no calls left", reward=0.0, done=False, tool_calls=1,
                              tool_errors=1, role="tool")
        self.calls_left -= 1
        try:
            observation, errors = format_number(evaluate(call.group(1))), 0
        except CalcError as exc:
            observation, errors = f"error: {exc}", 1
        return StepResult(observation=observation, reward=0.0, done=False, tool_calls=1, tool_errors=errors,
                          role="tool")
