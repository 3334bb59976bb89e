"""A calculator agent that knows nothing of trainingrun: it talks to an OpenAI-compatible endpoint, runs its own tool,
and reports how the episode went. examples/agent-gateway.yaml trains the model behind the endpoint with it.

    OPENAI_BASE_URL=... OPENAI_API_KEY=... TRAININGRUN_TASK='{"prompt": "...", "answer": "7", "meta": {}}' \\
        python3 calculator_agent.py [--calls 2] [--turns 3]

The conversation: the task's prompt as the user's message; each answer of the model that holds "<calc> EXPR </calc>"
(the closing tag may be missing: the run stops the turn at it) is a tool call — the agent evaluates EXPR (numbers,
+ - * / and parentheses) and sends the value back as a `tool` message ("error: ..." for a bad expression or once the
calls are used up); an answer without a call is the final one. The reward is 1 if the final answer's last number is
the task's answer, else 0 (also when the turns run out), printed as the last stdout line: {"reward": R}.

Standard library only. With the `openai` package installed it uses its client (`OpenAI()` reads OPENAI_BASE_URL and
OPENAI_API_KEY); otherwise urllib, the same requests by hand.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import urllib.request

CALL = re.compile(r"<calc>(.*?)(?:</calc>|$)", re.DOTALL)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
       ast.Div: lambda a, b: a / b}


def calculate(text: str) -> str:
    """The value of an arithmetic expression as text, or "error: ..."."""
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError("not arithmetic")

    try:
        if len(text) > 200:
            raise ValueError("too long")
        result = value(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as exc:
        return f"error: {exc}"
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


def client():
    """chat(messages) -> the answer's text, through the openai client if it is installed, else urllib."""
    try:
        from openai import OpenAI  # optional
    except ImportError:
        OpenAI = None
    if OpenAI is not None:
        api = OpenAI()

        def chat_openai(messages):
            return api.chat.completions.create(model="policy", messages=messages).choices[0].message.content
        return chat_openai

    base, key = os.environ["OPENAI_BASE_URL"].rstrip("/"), os.environ["OPENAI_API_KEY"]

    def chat(messages):
        request = urllib.request.Request(f"{base}/chat/completions",
                                         data=json.dumps({"model": "policy", "messages": messages}).encode(),
                                         headers={"Authorization": f"Bearer {key}",
                                                  "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as r:
            return json.loads(r.read())["choices"][0]["message"]["content"]
    return chat


def main() -> None:
    p = argparse.ArgumentParser(description="a calculator agent (see the module docstring)")
    p.add_argument("--calls", type=int, default=2, help="tool calls per episode")
    p.add_argument("--turns", type=int, default=3, help="model turns per episode")
    args = p.parse_args()
    task = json.loads(os.environ["TRAININGRUN_TASK"])
    chat = client()
    messages = [{"role": "user", "content": task["prompt"]}]
    calls, reward = args.calls, 0.0
    for _ in range(args.turns):
        answer = chat(messages) or ""
        messages.append({"role": "assistant", "content": answer})
        call = CALL.search(answer)
        if call is None:  # the final answer
            numbers = NUMBER.findall(answer)
            reward = float(bool(numbers) and abs(float(numbers[-1]) - float(task["answer"])) < 1e-6)
            break
        result = calculate(call.group(1)) if calls > 0 else "error: no calls left"
        calls -= 1
        messages.append({"role": "tool", "content": result})
    print(json.dumps({"reward": reward}))


if __name__ == "__main__":
    main()
