"""Rewards served over HTTP (`reward.type: remote | judge`, trainingrun/rollout/reward_services.py) against real HTTP
servers on 127.0.0.1 (the standard library's http.server in this process): a reward service that answers 500, hangs,
trickles, returns the wrong number of rewards, NaN, not JSON, closes the connection, refuses a request (4xx); a judge
whose answer does not match the pattern. Each failure fails its samples with its reason and failedReward, the rest
are scored, and nothing raises: the rollout never stops for a reward. The scorer is built as the rollout builds it
(`RewardConfig.of(RewardSpec)` → `RewardScorer`), Secret headers from the environment."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from trainingrun.api.spec.rollout import RewardSpec, header_env
from trainingrun.contract.errors import ConfigError
from trainingrun.rollout.reward_services import SAMPLE_FIELDS, retry_delay
from trainingrun.rollout.rewards import AnswerLog, RewardConfig, RewardSample, RewardScorer, token_match


class Requests:
    """What a test server saw: the parsed bodies, headers, and the most requests it held at once."""

    def __init__(self):
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()


Behaviour = Callable[[BaseHTTPRequestHandler, dict, int], None]  # (handler, body, request number) -> answer it


@contextmanager
def server(behaviour: Behaviour):
    """A real HTTP server on 127.0.0.1 answering each POST with `behaviour`; yields (url, Requests)."""
    seen = Requests()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        counted = False  # the request being handled is in seen.in_flight

        def do_POST(self):  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with seen.lock:
                n = len(seen.bodies)
                seen.bodies.append(body)
                seen.headers.append(dict(self.headers))
                seen.in_flight += 1
                seen.max_in_flight = max(seen.max_in_flight, seen.in_flight)
                self.counted = True
            try:
                behaviour(self, body, n)
            finally:
                self.answered()

        def send_response(self, code, message=None):
            self.answered()  # the answer begins: from here the client may send its next request
            super().send_response(code, message)

        def answered(self):
            """The request leaves the in-flight count once, when its answer begins (or its handler ends without one):
            counted at the handler's end, a client's next request could arrive while this thread still ran."""
            with seen.lock:
                if self.counted:
                    seen.in_flight -= 1
                    self.counted = False

        def log_message(self, *args):
            pass

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        block_on_close = False

        def handle_error(self, request, client_address):  # a client that hung up (our timeout): not a failure here
            pass

    srv = Server(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", seen
    finally:
        srv.shutdown()
        srv.server_close()


def answer(handler: BaseHTTPRequestHandler, obj, status: int = 200, raw: bytes | None = None) -> None:
    data = raw if raw is not None else json.dumps(obj).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def token_match_service(handler, body, n) -> None:
    """The user's reward service: token_match of each sample (what the demo's built-in reward computes)."""
    answer(handler, {"rewards": [token_match(s["response"], s["reference"]) for s in body["samples"]]})


def samples(n: int = 5) -> list[RewardSample]:
    """Token samples of the synthetic copy task: sample i answers [3, 4, 2] with i positions right (of 3)."""
    ref = [3, 4, 2]
    out = []
    for i in range(n):
        resp = ref[: i % 4] + [7] * (3 - i % 4)
        out.append(RewardSample(prompt=None, prompt_tokens=[3, 4, 1], response=resp, response_tokens=resp,
                                reference=ref, meta={"i": i}, index=i))
    return out


def remote_scorer(url: str, *, timeout: float = 2.0, failed_reward: float = -1.0, **remote) -> RewardScorer:
    spec = RewardSpec.model_validate({"type": "remote", "remote": {"url": url, **remote}, "timeoutSeconds": timeout,
                                      "failedReward": failed_reward})
    return RewardScorer(RewardConfig.of(spec), timeout=timeout, failed_reward=failed_reward)


def test_a_reward_service_scores_batches_with_their_prompts_and_secret_headers(monkeypatch):
    monkeypatch.setenv(header_env("reward", "Authorization"), "Bearer s3cret")
    gate = threading.Barrier(2, timeout=5)

    def slow(handler, body, n):
        if n < 2:  # the first two requests meet: both were in flight at once
            gate.wait()
            time.sleep(0.2)  # and stay so: a third request, had the client sent one, would arrive meanwhile
        token_match_service(handler, body, n)
        if n < 2:  # their threads linger after answering, as a server's may: the third request is sent meanwhile
            time.sleep(0.3)

    with server(slow) as (url, seen):
        scorer = remote_scorer(f"{url}/score", batchSize=2, concurrency=2,
                               headers={"Authorization": {"name": "rm", "key": "token"}})
        try:
            items = samples(5)
            scored = scorer.score(items)
        finally:
            scorer.close()
    assert scored.rewards == [token_match(s.response, s.reference) for s in items]
    assert scored.failed == [None] * 5 and scored.counts() == {"error": 0, "timeout": 0, "nan": 0}
    assert sorted(len(b["samples"]) for b in seen.bodies) == [1, 2, 2]  # batchSize 2: 2 + 2 + 1
    assert seen.max_in_flight == 2  # concurrency 2, reached and never passed
    first = next(b for b in seen.bodies if b["samples"][0]["meta"] == {"i": 0})
    assert set(first["samples"][0]) == set(SAMPLE_FIELDS)  # the contract's fields, nothing else
    assert first["samples"][0] == {"prompt": None, "prompt_tokens": [3, 4, 1], "response": [7, 7, 7],
                                   "response_tokens": [7, 7, 7], "reference": [3, 4, 2], "meta": {"i": 0}}
    assert all(h["Authorization"] == "Bearer s3cret" for h in seen.headers)
    assert "s3cret" not in repr(scorer.fn.scorer.service)  # the value never shows in a repr (a log line)


def test_5xx_and_closed_connections_are_retried_with_backoff_then_fail():
    def flaky(handler, body, n):
        if n == 0:
            answer(handler, {"error": "busy"}, status=503)  # once: the retry scores the batch
        else:
            token_match_service(handler, body, n)

    with server(flaky) as (url, seen):
        scorer = remote_scorer(url, batchSize=8, retries=2)
        t0 = time.monotonic()
        scored = scorer.score(samples(4))
        took = time.monotonic() - t0
        scorer.close()
    assert scored.failed == [None] * 4 and len(seen.bodies) == 2
    assert took >= retry_delay(0)  # backed off before the retry

    def always_500(handler, body, n):
        answer(handler, {"error": "the model is down"}, status=500)

    with server(always_500) as (url, seen):
        scorer = remote_scorer(url, batchSize=8, retries=2)
        scored = scorer.score(samples(3))
        scorer.close()
    assert len(seen.bodies) == 3  # the first try and 2 retries
    assert scored.failed == ["http"] * 3 and scored.rewards == [-1.0] * 3
    assert "HTTP 500" in scored.messages[0] and "the model is down" in scored.messages[0] \
        and "after 3 tries" in scored.messages[0]
    assert scored.counts() == {"error": 0, "timeout": 0, "nan": 0, "http": 3}

    def hang_up(handler, body, n):
        handler.close_connection = True
        handler.connection.shutdown(socket.SHUT_RDWR)  # closes without a word

    with server(hang_up) as (url, seen):
        scorer = remote_scorer(url, batchSize=8, retries=1)
        scored = scorer.score(samples(2))
        scorer.close()
    assert len(seen.bodies) == 2 and scored.failed == ["unreachable"] * 2, scored.messages


def test_a_4xx_fails_at_once_and_an_unreachable_service_is_named():
    def refuse(handler, body, n):
        answer(handler, {"detail": "bad samples"}, status=422)

    with server(refuse) as (url, seen):
        scorer = remote_scorer(url, retries=3)
        scored = scorer.score(samples(2))
        scorer.close()
    assert len(seen.bodies) == 1 and scored.failed == ["http"] * 2  # not retried
    assert "HTTP 422" in scored.messages[0] and "bad samples" in scored.messages[0]

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    scorer = remote_scorer(f"http://127.0.0.1:{port}/score", retries=1)
    scored = scorer.score(samples(2))
    scorer.close()
    assert scored.failed == ["unreachable"] * 2 and f"127.0.0.1:{port}" in scored.messages[0]


def test_a_hanging_or_trickling_service_times_out_and_is_not_retried():
    release = threading.Event()

    def hang(handler, body, n):
        if n == 0:
            release.wait(30)  # the first batch never gets an answer in time
        token_match_service(handler, body, n)

    with server(hang) as (url, seen):
        scorer = remote_scorer(url, timeout=0.5, batchSize=2, concurrency=2, retries=2)
        t0 = time.monotonic()
        scored = scorer.score(samples(4))
        took = time.monotonic() - t0
        release.set()
        scorer.close()
    assert len(seen.bodies) == 2  # the timed-out batch was not sent again
    hung = [i for i, f in enumerate(scored.failed) if f == "timeout"]
    assert len(hung) == 2 and all(scored.rewards[i] == -1.0 for i in hung)
    assert [f for f in scored.failed if f != "timeout"] == [None, None]  # the other batch scored
    assert 0.4 < took < 5, took
    assert "no answer within 0.5s" in scored.messages[0]

    def trickle(handler, body, n):
        handler.send_response(200)
        handler.send_header("Content-Length", "1000")
        handler.end_headers()
        for _ in range(30):
            handler.wfile.write(b" ")
            handler.wfile.flush()
            time.sleep(0.1)

    with server(trickle) as (url, seen):
        scorer = remote_scorer(url, timeout=0.6)
        t0 = time.monotonic()
        scored = scorer.score(samples(1))
        took = time.monotonic() - t0
        scorer.close()
    assert scored.failed == ["timeout"] and took < 2.0, took  # cut when the time was up, not after 3 s


@pytest.mark.parametrize("reply,reason,message", [
    ({"rewards": [1.0]}, "invalid", "1 rewards for 3 samples"),
    ({"scores": [1.0, 1.0, 1.0]}, "invalid", "no list 'rewards'"),
    (b"<html>oops</html>", "invalid", "not JSON"),
])
def test_an_answer_that_breaks_the_contract_fails_the_batch(reply, reason, message):
    def bad(handler, body, n):
        answer(handler, None, raw=reply) if isinstance(reply, bytes) else answer(handler, reply)

    with server(bad) as (url, _):
        scorer = remote_scorer(url)
        scored = scorer.score(samples(3))
        scorer.close()
    assert scored.failed == [reason] * 3 and message in scored.messages[0], scored.messages


def test_non_finite_rewards_fail_only_their_samples():
    def nan(handler, body, n):  # JSON's NaN and Infinity literals (Python's json writes them), a string, a null
        answer(handler, None, raw=b'{"rewards": [0.5, NaN, Infinity, "1", null, true]}')

    with server(nan) as (url, _):
        scorer = remote_scorer(url, failed_reward=0.0)
        scored = scorer.score(samples(6))
        scorer.close()
    assert scored.rewards == [0.5, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert scored.failed == [None, "nan", "nan", "nan", "nan", "nan"]


def test_a_header_whose_variable_is_unset_is_a_config_error_naming_it(monkeypatch):
    var = header_env("reward", "X-Api-Key")
    monkeypatch.delenv(var, raising=False)
    spec = RewardSpec.model_validate({"type": "remote", "remote": {"url": "http://127.0.0.1:9/x", "headers": {
        "X-Api-Key": {"name": "rm-secret", "key": "key"}}}})
    with pytest.raises(ConfigError) as err:
        RewardScorer(RewardConfig.of(spec), timeout=1.0, failed_reward=0.0)
    text = str(err.value)
    assert "rollout.source.generate.reward.remote.headers.X-Api-Key" in text and var in text and "rm-secret" in text
    assert header_env("eval", "X-Api-Key") == "TRAININGRUN_EVAL_HEADER_X_API_KEY" != var


# ------------------------------------------------------------------------------------------------------ the judge
def judge_scorer(url: str, **judge) -> RewardScorer:
    spec = RewardSpec.model_validate({"type": "judge", "timeoutSeconds": 2.0, "failedReward": -1.0, "judge": {
        "url": url, "model": "judge-7b", "template": "Q: {prompt}\nA: {response}\nRef: {reference}",
        "pattern": r"Score:\s*(\d+)", "scale": 10.0, **judge}})
    return RewardScorer(RewardConfig.of(spec), timeout=2.0, failed_reward=-1.0)


def chat(handler, text: str) -> None:
    answer(handler, {"id": "c", "object": "chat.completion", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]})


def test_a_judge_scores_each_sample_and_one_whose_answer_does_not_match_fails(tmp_path):
    def judge(handler, body, n):
        content = body["messages"][0]["content"]
        assert handler.path == "/v1/chat/completions" and body["model"] == "judge-7b"
        if "A: wrong" in content:
            chat(handler, "I cannot rate this.")  # no score: the pattern does not match
        else:
            chat(handler, f"Looks fine.\nScore: {len(content) % 10}")

    text = [RewardSample(prompt=f"what is {i}+{i}?", prompt_tokens=[5, 6], response=r, response_tokens=[7],
                         reference=str(2 * i), index=i)
            for i, r in enumerate(["0", "wrong", "4", "6"])]
    with server(judge) as (url, seen):
        scorer = judge_scorer(f"{url}/v1")
        try:
            scored = scorer.score(text)
        finally:
            scorer.close()
    contents = [b["messages"][0]["content"] for b in seen.bodies]
    assert "Q: what is 2+2?\nA: 4\nRef: 4" in contents  # the template, filled
    expected = {i: (len(f"Q: {s.prompt}\nA: {s.response}\nRef: {s.reference}") % 10) / 10 for i, s in enumerate(text)}
    assert scored.failed == [None, "invalid", None, None]
    assert [scored.rewards[i] for i in (0, 2, 3)] == [expected[i] for i in (0, 2, 3)] and scored.rewards[1] == -1.0
    assert "does not match pattern" in scored.messages[0] and "I cannot rate this." in scored.messages[0]
    assert scored.raw[1] == "I cannot rate this." and scored.raw[0].endswith(f"Score: {int(expected[0] * 10)}")

    # the first keepAnswers answers of a rollout, kept for inspection; rewritten by the next process that writes it
    log = AnswerLog(tmp_path / "judge", keep=3, say=print)
    log.add("rollout-0", text[:2], type(scored)(scored.rewards[:2], scored.failed[:2], raw=scored.raw[:2]))
    log.add("rollout-0", text[2:], type(scored)(scored.rewards[2:], scored.failed[2:], raw=scored.raw[2:]))
    lines = [json.loads(x) for x in (tmp_path / "judge" / "rollout-0.jsonl").read_text().splitlines()]
    assert [x["response"] for x in lines] == ["0", "wrong", "4"]  # 3 kept, in order
    assert lines[1] == {"prompt": "what is 1+1?", "response": "wrong", "reference": "2",
                        "answer": "I cannot rate this.", "reward": -1.0, "failed": "invalid"}
    AnswerLog(tmp_path / "judge", keep=3, say=print).add("rollout-0", text[3:], type(scored)(
        scored.rewards[3:], scored.failed[3:], raw=scored.raw[3:]))
    assert len((tmp_path / "judge" / "rollout-0.jsonl").read_text().splitlines()) == 1


def test_a_judge_that_fails_is_counted_by_reason():
    def broken(handler, body, n):
        if "A: 1" in body["messages"][0]["content"]:
            answer(handler, {"choices": []})  # no choice
        elif "A: 2" in body["messages"][0]["content"]:
            chat(handler, "Score: 99999999999999999999999999999999999999999999999999" + "9" * 400)  # inf
        else:
            answer(handler, {"error": "overloaded"}, status=503)

    items = [RewardSample(prompt="p", prompt_tokens=[1], response=str(i), response_tokens=[1], reference="r")
             for i in range(3)]
    with server(broken) as (url, seen):
        scorer = judge_scorer(url, retries=1)
        scored = scorer.score(items)
        scorer.close()
    assert scored.failed == ["http", "invalid", "nan"], scored.messages
    assert scored.counts() == {"error": 0, "timeout": 0, "nan": 1, "http": 1, "invalid": 1}
