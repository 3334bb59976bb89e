"""An agent program for the gateway's tests (rollout/agents.py, command mode): standard library only, it speaks HTTP to
OPENAI_BASE_URL with OPENAI_API_KEY and ends with {"reward": R}. What it does is its task's `meta.behaviour`:

    calc       the calculator loop: a turn with "<calc> EXPR </calc>" gets a tool message with "ok", until an answer
               or 3 turns; reward 1 if the answer is the task's answer
    rewrite    two turns, the second with the first answer edited (history rewritten), then a third that continues
    hang       sleeps far past any timeout
    flood      requests as fast as it can (continuing its conversation) until the gateway refuses
    silent     one turn, then exits 0 without a reward line
    crash      one turn, then exits 3
    badreward  prints {"reward": "high"}
    wrongkey   one request with a key of no episode (401), then the calc loop with its own
    greedy     asks for max_tokens 1000000
    malformed  messages is not a list
    stream     the calc loop with stream true, content as text parts and a GET /v1/models first
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request

BASE, KEY = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
TASK = json.loads(os.environ["TRAININGRUN_TASK"])


def post(body, key=KEY):
    req = urllib.request.Request(f"{BASE}/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def chat(messages, **extra):
    status, text = post({"model": "policy", "messages": messages, **extra})
    if status != 200:
        print(f"gateway answered {status}: {text}", file=sys.stderr)
        sys.exit(5)
    if extra.get("stream"):
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events
        return "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1])
    return json.loads(text)["choices"][0]["message"]["content"]


def calc(**extra):
    messages = [{"role": "user", "content": TASK["prompt"]}]
    reply = ""
    for _ in range(3):
        reply = chat(messages, **extra)
        messages.append({"role": "assistant", "content": reply})
        if "<calc>" not in reply:
            break
        content = [{"type": "text", "text": "ok"}] if extra.get("stream") else "ok"
        messages.append({"role": "tool", "content": content})
    return 1.0 if reply.strip() == str(TASK["answer"]) else 0.0


def main() -> None:
    assert json.loads(sys.stdin.readline()) == TASK  # the task on stdin too
    behaviour = TASK["meta"].get("behaviour", "calc")
    reward = 0.0
    if behaviour == "calc":
        reward = calc()
    elif behaviour == "rewrite":
        messages = [{"role": "user", "content": TASK["prompt"]}]
        first = chat(messages)
        messages += [{"role": "assistant", "content": first + " edited"}, {"role": "user", "content": "again"}]
        second = chat(messages)
        messages += [{"role": "assistant", "content": second}, {"role": "tool", "content": "ok"}]
        chat(messages)
    elif behaviour == "hang":
        time.sleep(3600)
    elif behaviour == "flood":
        messages = [{"role": "user", "content": TASK["prompt"]}]
        while True:
            status, text = post({"messages": messages})
            if status != 200:
                print(f"refused: {status}", file=sys.stderr)
                sys.exit(0)  # and no reward line
            messages += [{"role": "assistant", "content": json.loads(text)["choices"][0]["message"]["content"]},
                         {"role": "user", "content": "more"}]
    elif behaviour == "silent":
        chat([{"role": "user", "content": TASK["prompt"]}])
        return
    elif behaviour == "crash":
        chat([{"role": "user", "content": TASK["prompt"]}])
        print("agent: giving up", file=sys.stderr)
        sys.exit(3)
    elif behaviour == "badreward":
        print(json.dumps({"reward": "high"}))
        return
    elif behaviour == "wrongkey":
        status, _ = post({"messages": [{"role": "user", "content": TASK["prompt"]}]}, key="sk-not-an-episode")
        assert status == 401, status
        reward = calc()
    elif behaviour == "greedy":
        chat([{"role": "user", "content": TASK["prompt"]}], max_tokens=1_000_000)
    elif behaviour == "malformed":
        post({"messages": {"role": "user", "content": TASK["prompt"]}})
    elif behaviour == "stream":
        req = urllib.request.Request(f"{BASE}/models", headers={"Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert json.loads(r.read())["data"][0]["object"] == "model"
        reward = calc(stream=True)
    print("a line before the reward")
    print(json.dumps({"reward": reward}))


if __name__ == "__main__":
    main()
