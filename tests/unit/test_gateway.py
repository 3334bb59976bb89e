"""The agents' gateway in parts (rollout/gateway.py, sessions.py, agents.py; the whole: tests/integration/
test_agent_gateway.py): chat requests checked field by field, the reward line, messages after a turn rendered as the
template renders them, the HTTP answers to a wrong key, a wrong route, an oversized or unreadable body, an episode's
samples per token sequence, the records and metrics of agents, the local launcher's agent paths."""

from __future__ import annotations

import http.client
import json
import threading
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from trainingrun.contract.engine import Completion, Sampling
from trainingrun.contract.published import AGENT_FAILURE_REASONS, EpisodeCounts
from trainingrun.metrics.rollout import RolloutMetrics
from trainingrun.modeling.tokenizer import RunTokenizer, run_tokenizer
from trainingrun.rollout.agents import agent_environment, parse_reward
from trainingrun.rollout.episodes import Episode, EpisodeRules, TurnCodec, build_group
from trainingrun.rollout.gateway import Gateway, parse_chat
from trainingrun.rollout.sessions import AgentFailure, EngineGate, Limits, Session

ROOT = Path(__file__).resolve().parents[2]
TOK = run_tokenizer(ROOT / "examples" / "data" / "agent-model")
Q = [{"role": "user", "content": "State the final answer"}]


@pytest.mark.parametrize("body,field", [
    ([], "body"), ({}, "messages"), ({"messages": []}, "messages"), ({"messages": {"role": "user"}}, "messages"),
    ({"messages": ["hi"]}, r"messages\[0\]"), ({"messages": [{"role": "robot", "content": "x"}]}, r"messages\[0\].role"),
    ({"messages": [{"role": "user", "content": 3}]}, r"messages\[0\].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, r"messages\[0\].content"),
    ({"messages": [{"role": "tool", "content": "1", "tool_call_id": 7}]}, r"messages\[0\].tool_call_id"),
    ({"messages": Q, "max_tokens": 0}, "max_tokens"), ({"messages": Q, "max_tokens": True}, "max_tokens"),
    ({"messages": Q, "max_completion_tokens": "8"}, "max_tokens"), ({"messages": Q, "temperature": "hot"}, "temperature"),
    ({"messages": Q, "top_p": -1}, "top_p"), ({"messages": Q, "n": 2}, "n"), ({"messages": Q, "stop": [""]}, "stop"),
    ({"messages": Q, "stop": ["a", "b", "c", "d", "e"]}, "stop"), ({"messages": Q, "stream": "yes"}, "stream"),
    ({"messages": Q, "tools": {"type": "function"}}, "tools"),
])
def test_a_malformed_request_is_refused_naming_the_field(body, field):
    with pytest.raises(AgentFailure, match=field) as exc:
        parse_chat(body)
    assert exc.value.reason == "invalid" and exc.value.status == 400


def test_a_request_is_normalised_to_what_the_sessions_compare():
    r = parse_chat({"model": "any", "user": "u", "seed": 1, "temperature": 0.2, "max_completion_tokens": 5,
                    "stop": "</calc>", "messages": [
                        {"role": "user", "content": [{"type": "text", "text": "a "}, {"type": "text", "text": "b"}]},
                        {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}], "refusal": None},
                        {"role": "tool", "content": "3", "tool_call_id": "1", "name": None}]})
    assert r.messages == ({"role": "user", "content": "a b"},
                          {"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]},
                          {"role": "tool", "content": "3", "tool_call_id": "1"})
    assert (r.max_tokens, r.stop, r.stream, r.tools) == (5, ("</calc>",), False, None)


@pytest.mark.parametrize("stdout,reward", [
    (b'{"reward": 1}\n', 1.0), (b'log line\n{"reward": -0.5}\n\n', -0.5), (b'{"reward": 2.5, "info": {}}', 2.5),
    (b"", None), (b'{"reward": 1}\nbye\n', None), (b'{"reward": "1"}\n', None), (b'{"reward": true}\n', None),
    (b'{"reward": NaN}\n', None), (b'{"reward": Infinity}\n', None), (b"[1]\n", None), (b"\xff\xfe\n", None),
])
def test_the_reward_is_the_last_stdout_line(stdout, reward):
    got, why = parse_reward(stdout)
    assert got == reward and (why == "") == (reward is not None)


def test_the_agents_environment_holds_the_contract_and_not_the_rollouts_own(monkeypatch):
    monkeypatch.setenv("TRAININGRUN_STORE_URL", "redis://secret")
    env = agent_environment("http://127.0.0.1:1/v1", "tr-key", '{"prompt": "p"}')
    assert (env["OPENAI_BASE_URL"], env["OPENAI_API_KEY"], env["TRAININGRUN_TASK"], env["OMP_NUM_THREADS"]) == (
        "http://127.0.0.1:1/v1", "tr-key", '{"prompt": "p"}', "1")
    assert "TRAININGRUN_STORE_URL" not in env and env["PATH"]


def test_messages_after_a_turn_render_as_the_template_renders_them():
    codec = TurnCodec(TOK, chat=True, eos_id=TOK.eos_id)
    one = [{"role": "tool", "content": "5"}]
    assert codec.messages(one, after_eos=True).tolist() == codec.observation("5", "tool", after_eos=True).tolist()
    two = [{"role": "tool", "content": "5"}, {"role": "user", "content": "State 7"}]
    assert TOK.decode(codec.messages(two, after_eos=False).tolist()) == \
        "</s> tool : 5 </s> user : State 7 </s> assistant :"
    # the whole conversation, as the first request of a sequence
    full = codec.conversation([*Q, {"role": "assistant", "content": "7"}, *one])
    assert TOK.decode(full.tolist()) == "user : State the final answer </s> assistant : 7 </s> tool : 5 </s> assistant :"


def test_a_template_that_rewrites_earlier_turns_cannot_continue_them():
    """A template that renders an assistant turn differently once it is not the last (as reasoning templates drop
    earlier thinking) cannot extend the tokens: `messages` refuses, and the session starts a new sequence."""
    template = ("{% for m in messages %}{{ m['role'] }} : {% if m['role'] == 'assistant' and not loop.last %}[old]"
                "{% else %}{{ m['content'] }}{% endif %} </s> {% endfor %}{% if add_generation_prompt %}assistant : "
                "{% endif %}")
    tok = RunTokenizer(tokenizer=TOK.tokenizer, chat_template=template, special=TOK.special, eos_id=TOK.eos_id,
                       source="test")
    with pytest.raises(ValueError, match="differently"):  # environments: a configuration error
        TurnCodec(tok, chat=True, eos_id=tok.eos_id)
    codec = TurnCodec(tok, chat=True, eos_id=tok.eos_id, probe_roles=False)  # agents
    with pytest.raises(ValueError, match="differently"):
        codec.messages([{"role": "tool", "content": "5"}], after_eos=False)


class Answers:
    """A grouped engine answering every context with the same words."""

    name, weight_version = "answers", 0

    def generate_groups(self, requests, sampling, *, on_group=None):
        ids = TOK.encode("7") + [2]
        return [[Completion(np.asarray(ids, np.int32), np.full(len(ids), -0.5, np.float32), "stop")]
                for _ in requests]


def serving(engine) -> EngineGate:
    """An engine gate whose calls run in a thread of their own (the rollout's thread in a run)."""
    gate = EngineGate(engine, Sampling(max_new_tokens=8, stop_token_ids=(2,)), live=lambda: 1, seeds=lambda: 0)
    threading.Thread(target=gate.serve, args=(threading.Event(),), daemon=True).start()
    return gate


def gateway_with_a_session(max_turns: int = 3):
    gate = serving(Answers())
    e = Episode(key=0, group=0, member=0)
    s = Session(e, "tr-good", codec=TurnCodec(TOK, chat=True, eos_id=2), gate=gate,
                limits=Limits(max_turns=max_turns, cap=96, max_new_tokens=8, stop_ids=(2,), stops=()), seed=1)
    g = Gateway(host="127.0.0.1", port=0, advertise="127.0.0.1", model="agent-model").start()
    g.open(s.key, s)
    return g, s


def request(g: Gateway, method: str, path: str, body: bytes | None = None, key: str = "tr-good",
            headers: dict | None = None):
    """(status, JSON answer); a `Content-Length` in `headers` is sent as it is, with `body` (a client that lies)."""
    c = http.client.HTTPConnection("127.0.0.1", g.port, timeout=30)
    try:
        if headers and "Content-Length" in headers:
            c.putrequest(method, path)
            for k, v in {"Authorization": f"Bearer {key}", **headers}.items():
                c.putheader(k, v)
            c.endheaders(body)
        else:
            c.request(method, path, body=body, headers={"Authorization": f"Bearer {key}", **(headers or {})})
        r = c.getresponse()
        return r.status, json.loads(r.read() or b"null")
    finally:
        c.close()


def test_the_gateway_answers_by_key_and_counts_the_wrong_ones():
    g, s = gateway_with_a_session()
    try:
        status, body = request(g, "GET", "/v1/models")
        assert status == 200 and body["data"][0]["id"] == "agent-model"
        chat = json.dumps({"messages": Q}).encode()
        status, body = request(g, "POST", "/v1/chat/completions", chat)
        assert status == 200 and body["choices"][0]["message"] == {"role": "assistant", "content": "7"}
        assert body["usage"]["completion_tokens"] == 2 and body["choices"][0]["finish_reason"] == "stop"
        for key in ("tr-bad", ""):
            status, body = request(g, "POST", "/v1/chat/completions", chat, key=key)
            assert status == 401 and body["error"]["code"] == "invalid_api_key"
        status, _ = request(g, "GET", "/v1/models", key="nope")
        assert status == 401
        assert g.take_unauthorized() == 3 and g.take_unauthorized() == 0
        assert request(g, "POST", "/v1/completions", chat)[0] == 404
        assert s.episode.end is None and len(s.episode.turns) == 1  # nothing of that touched the episode
        assert s.requests == 1 and len(s.latencies) == 1
    finally:
        g.close()


@pytest.mark.parametrize("body,headers,status,reason", [
    (b"{", {"Content-Length": str(8 * 1024 * 1024 + 1)}, 413, "limit"),
    (b"{}", {"Content-Length": "two"}, 411, "invalid"),
    (b"{not json", {}, 400, "invalid"),
    (json.dumps({"messages": Q, "max_tokens": 1_000_000}).encode(), {}, 400, "limit"),
])
def test_a_request_past_the_limits_or_unreadable_fails_its_episode(body, headers, status, reason):
    g, s = gateway_with_a_session()
    try:
        got, answer = request(g, "POST", "/v1/chat/completions", body, headers=headers)
        assert got == status and answer["error"]["code"] == reason
        assert (s.episode.end, s.episode.failure) == ("failed", reason) and s.wake.is_set()
        got, _ = request(g, "POST", "/v1/chat/completions", json.dumps({"messages": Q}).encode())
        assert got == 401  # the episode is over: its key opens nothing
    finally:
        g.close()


def test_turns_past_max_turns_fail_the_episode_and_keep_its_tokens():
    g, s = gateway_with_a_session(max_turns=2)
    try:
        msgs = list(Q)
        for _ in range(2):
            status, body = request(g, "POST", "/v1/chat/completions", json.dumps({"messages": msgs}).encode())
            assert status == 200
            msgs += [body["choices"][0]["message"], {"role": "user", "content": "again"}]
        status, body = request(g, "POST", "/v1/chat/completions", json.dumps({"messages": msgs}).encode())
        assert status == 400 and "maxTurns 2" in body["error"]["message"]
        e = s.episode
        assert (e.end, e.failure, len(e.turns), len(e.sequences())) == ("failed", "limit", 2, 1)
    finally:
        g.close()


def episode(segments: list[tuple[list[int], bool]], starts: list[int], member: int, end: str = "done") -> Episode:
    e = Episode(key=member, group=0, member=member, starts=starts)
    for toks, turn in segments:
        t = np.asarray(toks, np.int32)
        e.segments.append((t, -np.arange(1, len(t) + 1, dtype=np.float32) if turn else None))
    e.rewards.append(1.0)
    e.finish(end, "limit" if end == "failed" else None)
    return e


def test_an_agents_episode_trains_one_sample_per_token_sequence_or_per_turn():
    two = episode([([1, 2], False), ([3], True), ([4, 5, 6], False), ([7, 8], True), ([9], False), ([10], True)],
                  starts=[0, 2], member=1)
    one = episode([([1, 2], False), ([3, 4], True)], starts=[0], member=0, end="failed")
    rules = EpisodeRules(samples="episode", max_turns=4, failed_reward=-1.0, episode_reward="final",
                         sequence_ids=True)
    g = build_group(5, [one, two], rules, version=3, group_size=2)
    assert g.sample_ids.tolist() == [(5 * 2 + 0) * 4, (5 * 2 + 1) * 4, (5 * 2 + 1) * 4 + 1]
    assert [t.tolist() for t in g.tokens] == [[1, 2, 3, 4], [1, 2, 3], [4, 5, 6, 7, 8, 9, 10]]
    assert [m.tolist() for m in g.loss_masks] == [[0, 0, 1, 1], [0, 0, 1], [0, 0, 0, 1, 1, 0, 1]]
    assert g.rewards.tolist() == [-1.0, 1.0, 1.0] and g.versions.tolist() == [3, 3, 3]
    turns = build_group(5, [two], EpisodeRules(samples="turn", max_turns=4, failed_reward=0.0, sequence_ids=True),
                        version=3, group_size=2)
    assert [t.tolist() for t in turns.tokens] == [[1, 2, 3], [4, 5, 6, 7, 8], [4, 5, 6, 7, 8, 9, 10]]
    assert [m.tolist() for m in turns.loss_masks] == [[0, 0, 1], [0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 0, 1]]
    assert turns.sample_ids.tolist() == [(5 * 2 + 1) * 4 + t for t in range(3)]


AGENT_COUNTS = EpisodeCounts(episodes=4, turns=6, response_tokens=18, failures={"timeout": 1, "limit": 2},
                             reward=1.0, agent=True, requests=9, request_seconds=4.5, unauthorized=2, rewrites=1)


def test_an_agents_record_names_its_failures_by_reason_and_the_gateways_counts():
    r = AGENT_COUNTS.record()
    assert r["turns_per_episode"] == 1.5 and r["agent_failure_rate"] == 0.75 and r["rewrites_per_episode"] == 0.25
    assert r["gateway_request_seconds"] == 0.5 and r["episode_reward_mean"] == 0.25
    assert (r["agent_failures"], r["agent_failures_timeout"], r["agent_failures_limit"], r["gateway_requests"],
            r["gateway_unauthorized"]) == (3, 1, 2, 9, 2)
    assert {f"agent_failures_{x}" for x in AGENT_FAILURE_REASONS} <= set(r)
    assert not any(k.startswith(("env_", "tool_", "truncated")) for k in r)  # an environment's fields are not an agent's
    assert EpisodeCounts.from_json(AGENT_COUNTS.to_json()) == AGENT_COUNTS
    env = EpisodeCounts(episodes=1, turns=1)
    assert "agent" not in env.to_json() and EpisodeCounts.from_json(env.to_json()) == env
    for bad in ({**AGENT_COUNTS.to_json(), "agent": "yes"}, {**AGENT_COUNTS.to_json(), "requests": None},
                {k: v for k, v in AGENT_COUNTS.to_json().items() if k != "request_seconds"}):
        with pytest.raises(ValueError, match="episodes"):
            EpisodeCounts.from_json(bad)


def test_the_rollouts_prometheus_metrics_of_agents():
    m = RolloutMetrics("r")
    m.observe_episodes(AGENT_COUNTS)
    for seconds in (0.02, 0.3, 7.0):
        m.gateway_seconds.observe(seconds)
    values = {(s.name, s.labels.get("reason"), s.labels.get("le")): s.value
              for fam in text_string_to_metric_families(generate_latest(m.registry).decode()) for s in fam.samples}
    assert values[("trainingrun_rollout_agent_failures_total", "limit", None)] == 2
    assert ("trainingrun_rollout_environment_failures_total", "limit", None) not in values
    assert values[("trainingrun_rollout_gateway_unauthorized_total", None, None)] == 2
    assert values[("trainingrun_rollout_agent_failure_rate_sum", None, None)] == 3
    assert values[("trainingrun_rollout_agent_failure_rate_count", None, None)] == 4
    assert values[("trainingrun_rollout_gateway_request_seconds_count", None, None)] == 3
    assert values[("trainingrun_rollout_gateway_request_seconds_bucket", None, "0.5")] == 2


def test_the_local_launcher_makes_the_agents_script_path_absolute(tmp_path):
    from trainingrun.api import parse_trainingrun
    from trainingrun.local.main import resolve_input_paths

    (tmp_path / "agents").mkdir()
    (tmp_path / "agents" / "a.py").write_text("")
    doc = {"apiVersion": "trainingrun.dev/v1alpha1", "kind": "TrainingRun", "metadata": {"name": "a"},
           "spec": {"model": {"hf": str(ROOT / "examples" / "data" / "agent-model")},
                    "trainer": {"maxTokensPerGPU": 64},
                    "rollout": {"source": {"type": "generate", "generate": {
                        "prompts": {"type": "jsonl", "jsonl": {"path": "p.jsonl"}},
                        "agent": {"command": ["python3", "agents/a.py", "--calls", "2", "/abs/x"]}}}}}}
    run = resolve_input_paths(parse_trainingrun(doc), tmp_path)
    assert run.spec.rollout.source.generate.agent.command == [
        "python3", str(tmp_path / "agents" / "a.py"), "--calls", "2", "/abs/x"]


def test_tools_reach_the_template_and_changing_them_starts_a_new_sequence():
    template = ("{% if tools %}tool : {{ tools | length }} </s> {% endif %}{% for m in messages %}{{ m['role'] }} : "
                "{{ m['content'] }} </s> {% endfor %}{% if add_generation_prompt %}assistant : {% endif %}")
    tok = RunTokenizer(tokenizer=TOK.tokenizer, chat_template=template, special=TOK.special, eos_id=TOK.eos_id,
                       source="test")
    codec = TurnCodec(tok, chat=True, eos_id=tok.eos_id, probe_roles=False)
    assert TOK.decode(codec.conversation(Q, tools=[{"type": "function"}] * 3).tolist()).startswith("tool : 3 </s> user")
    gate = serving(Answers())
    s = Session(Episode(key=0, group=0, member=0), "k", codec=codec, gate=gate,
                limits=Limits(max_turns=4, cap=96, max_new_tokens=8, stop_ids=(2,), stops=()), seed=1)
    tools = ({"type": "function", "function": {"name": "calc"}},)
    msgs = list(Q)
    for i, t in enumerate([tools, tools, None]):  # the same tools continue; dropping them is a new sequence
        s.complete(parse_chat({"messages": msgs, **({"tools": list(t)} if t else {})}))
        msgs += [{"role": "assistant", "content": "7"}, {"role": "user", "content": "again"}]
        assert len(s.episode.sequences()) == (1 if i < 2 else 2)
    assert s.rewrites == 1


def test_the_example_agent_uses_the_openai_client_where_it_is_installed(tmp_path):
    """examples/agents/calculator_agent.py with a stand-in `openai` package first on its path: the client's
    chat.completions.create is what it calls (urllib otherwise: the e2e test)."""
    import subprocess
    import sys

    fake = tmp_path / "openai"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "import json, os, types\n"
        "class OpenAI:\n"
        "    def __init__(self):\n"
        "        self.chat = types.SimpleNamespace(completions=self)\n"
        "        self.log = open(os.environ['CALLS'], 'a')\n"
        "    def create(self, model, messages):\n"
        "        self.log.write(json.dumps(messages) + '\\n'); self.log.flush()\n"
        "        text = '<calc> 2 + 3 </calc>' if len(messages) == 1 else '5'\n"
        "        msg = types.SimpleNamespace(content=text)\n"
        "        return types.SimpleNamespace(choices=[types.SimpleNamespace(message=msg)])\n")
    calls = tmp_path / "calls.jsonl"
    env = {"PYTHONPATH": str(tmp_path), "CALLS": str(calls), "OPENAI_BASE_URL": "http://127.0.0.1:9/v1",
           "OPENAI_API_KEY": "k", "TRAININGRUN_TASK": json.dumps({"prompt": "2 + 3 =", "answer": "5", "meta": {}})}
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "agents" / "calculator_agent.py")], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == '{"reward": 1.0}'
    conversation = [json.loads(line) for line in calls.read_text().splitlines()]
    assert conversation[-1] == [{"role": "user", "content": "2 + 3 ="},
                                {"role": "assistant", "content": "<calc> 2 + 3 </calc>"},
                                {"role": "tool", "content": "5"}]
