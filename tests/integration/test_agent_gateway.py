"""Agents through the gateway (`rollout.source.generate.agent`: rollout/agents.py, gateway.py, sessions.py) in the
rollout loop against a real file store, with a scripted engine over the agent example's tokenizer (the in-process engine:
test_agent_gateway_e2e.py) and agent programs in real processes (tests/gateway_agent.py: standard library, HTTP only).

  token in, token out   every model token of every sample is what the engine returned for exactly the context before
                        it (loss mask 1, its log-probability bit for bit); everything else has mask 0
  segments              a request that rewrote its history starts a new token sequence: one sample per sequence
  faulty agents         hang, flood, no reward, crash, a wrong key, 10^6 tokens, malformed: failed by reason (the
                        wrong key: 401, counted, no episode touched), the rollout goes on within the timeout
  url mode              an agent service; one that errors or cannot be reached
  an engine dies        a pool of two simulated servers, one killed mid-episode: the episodes continue on the other
  the port taken        a configuration error naming agent.port
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from tests.episodes_check import Recording, check_sample
from tests.integration.test_episodes import ScriptedEngine
from tests.integration.test_generate_rollout import loop, publish_versions
from tests.simengine import SimProcess, publish_disk_version
from trainingrun.api import parse_trainingrun
from trainingrun.api.spec.rollout import AgentSpec
from trainingrun.contract.engine import Completion, EngineError, EngineUnavailable, Sampling
from trainingrun.contract.errors import ConfigError
from trainingrun.contract.published import read
from trainingrun.engines.vllm.engine import VLLMEngine, make_clients
from trainingrun.modeling.tokenizer import run_tokenizer
from trainingrun.rollout.agents import AgentRunner
from trainingrun.rollout.gateway import Gateway
from trainingrun.rollout.prompts import Prompt
from trainingrun.store import open_store

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "examples" / "data" / "agent-model"
TOK = run_tokenizer(MODEL)
EOS = 2
AGENT = [sys.executable, "-S", str(ROOT / "tests" / "gateway_agent.py")]
QUESTION = "State the final answer to the following arithmetic problem: {a} + {b} ="


class ChatScript(ScriptedEngine):
    """A grouped engine over the agent model's word tokenizer: the completion of a context is `script(text of the
    context)`'s words and the end token (cut at max new tokens); log-probabilities from a hash of the context."""

    def generate_groups(self, requests, sampling, *, on_group=None):
        out = []
        for i, r in enumerate(requests):
            ctx = [int(t) for t in r.prompt]
            ids = (TOK.encode(self.script(TOK.decode(ctx))) + [EOS])[: sampling.max_new_tokens]
            rng = np.random.default_rng([len(ctx), *ctx[-8:], self.version])
            c = Completion(tokens=np.asarray(ids, np.int32), logprobs=-rng.random(len(ids)).astype(np.float32),
                           finish_reason="stop" if ids[-1] == EOS else "length")
            out.append([c])
            if on_group is not None:
                on_group(i, [c])
        return out

    def generate(self, prompts, n, sampling):
        raise AssertionError("the gateway sends grouped requests")


class RecordingGroups(Recording):
    """Recording (tests/episodes_check.py) of grouped calls: `calls` holds (contexts, 1, completions)."""

    def generate_groups(self, requests, sampling, *, on_group=None):
        out = self.engine.generate_groups(requests, sampling, on_group=on_group)
        self.calls.append(([list(map(int, r.prompt)) for r in requests], 1, out))
        return out


def calculator(text: str) -> str:
    """Calls the calculator with the question's expression, then answers with its sum."""
    question = text.split("problem:", 1)[1].split("=", 1)[0]
    if "</calc>" in text:
        a, _, b = question.split()
        return str(int(a) + int(b))
    return f"<calc> {question.strip()} </calc>"


def spec_doc(prompts_path, agent, **rollout) -> dict:
    r = {"source": {"type": "generate", "generate": {
            "prompts": {"type": "jsonl", "jsonl": {"path": str(prompts_path)}},
            "sampling": {"maxNewTokens": 8, "stopTokenIds": [9]}, "agent": agent}},
         "samplesPerRollout": 8, "groupSize": 2, "numRollouts": 1, "maxPendingRollouts": 100,
         "steps": {"policy": "dynamic"}, "filters": {"zeroVariance": False}}
    r.update(rollout)
    return {"apiVersion": "trainingrun.dev/v1alpha1", "kind": "TrainingRun", "metadata": {"name": "gw"},
            "spec": {"seed": 3, "model": {"hf": str(MODEL), "seqLength": 96},
                     "trainer": {"replicas": 2, "maxTokensPerGPU": 1024, "lossType": "ppo"}, "rollout": r}}


def write_prompts(path: Path, behaviours: list[str]) -> Path:
    lines = [{"prompt": QUESTION.format(a=k, b=k + 1), "answer": str(2 * k + 1), "meta": {"behaviour": b}}
             for k, b in enumerate(behaviours)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def run(tmp_path, behaviours, agent=None, script=calculator, **rollout):
    agent = {k: v for k, v in {"command": AGENT, "maxTurns": 3, "timeoutSeconds": 60, **(agent or {})}.items()
             if v is not None}
    tmp_path.mkdir(parents=True, exist_ok=True)
    spec = parse_trainingrun(spec_doc(write_prompts(tmp_path / "prompts.jsonl", behaviours), agent,
                                      **rollout)).spec
    store = open_store(f"file://{tmp_path}/store")
    publish_versions(store, range(10))
    engine = RecordingGroups(ChatScript(store, script))
    said: list[str] = []
    lp = loop(spec, store, engine, progress=said.append)
    t0 = time.monotonic()
    result = lp.run()
    return store, engine, result, time.monotonic() - t0, said


def payloads(store, k):
    return [store.read_payload(k, r) for r in range(2)]


def samples(payload):
    o = payload["offsets"]
    return [(payload["tokens"][a:b], payload["loss_mask"][a:b], payload["logprobs"][a:b], payload["sample_ids"][i],
             payload["rewards"][i]) for i, (a, b) in enumerate(zip(o[:-1], o[1:]))]


def test_every_turn_trained_is_exactly_what_the_engine_generated(tmp_path):
    store, engine, result, _, _ = run(tmp_path, ["calc"] * 8, samplesPerRollout=8, numRollouts=2)
    assert result.rollouts == 2
    pairs = engine.pairs()
    for k in range(2):
        ep = read(store, k).stats.episodes
        assert ep.agent and ep.episodes == 8 and ep.failures == {} and ep.turns == 16  # a call, then the answer
        assert ep.requests == 16 and ep.request_seconds > 0 and ep.unauthorized == 0 and ep.rewrites == 0
        seen = []
        for pl in payloads(store, k):
            assert (pl["versions"] == k).all()  # the weight version the rollout was generated with
            for tokens, mask, logps, sid, reward in samples(pl):
                assert check_sample(tokens, mask, logps, pairs) == 2
                text = TOK.decode(tokens.tolist())
                a = int(text.split("problem:")[1].split()[0])
                assert f"tool : <unk> </s> assistant : {2 * a + 1} </s>" in text  # the tool's answer, then the sum
                assert reward == 1.0  # the agent's reward: its answer was right
                seen.append(int(sid))
        group = range(4 * k, 4 * k + 4)  # source rollout k: prompts 4k .. 4k + 3, 2 episodes each, maxTurns 3
        assert sorted(seen) == [(g * 2 + i) * 3 for g in group for i in range(2)]


@pytest.mark.parametrize("samples_mode", ["episode", "turn"])
def test_a_request_that_rewrote_its_history_starts_a_new_sequence(tmp_path, samples_mode):
    store, engine, _, _, _ = run(tmp_path, ["rewrite"] * 4, {"samples": samples_mode}, script=lambda t: "7")
    ep = read(store, 0).stats.episodes
    assert ep.failures == {} and ep.turns == 24 and ep.rewrites == 8  # 3 turns each; the second one rewrote
    got = [s for pl in payloads(store, 0) for s in samples(pl)]
    assert len(got) == (16 if samples_mode == "episode" else 24)
    pairs = {(tuple(ctx), tuple(c.tokens.tolist())): c for ctx, c in engine.pairs()}
    for tokens, mask, logps, _sid, _r in got:
        if samples_mode == "episode":
            check_sample(tokens, mask, logps, engine.pairs())
        else:  # a turn's sample: its context unmasked, then exactly the engine's completion for that context
            start = int(np.argmax(mask))
            assert mask[start:].all() and not mask[:start].any()
            c = pairs[(tuple(tokens[:start].tolist()), tuple(tokens[start:].tolist()))]
            assert np.array_equal(logps[start:], c.logprobs) and not logps[:start].any()
    texts = sorted((TOK.decode(t.tolist()) for t, *_ in got), key=len)
    if samples_mode == "episode":
        # the first sequence: the question and its answer; the second: the edited conversation rendered whole
        # (the edit "edited" is a word the tokenizer does not know), then two turns around the tool's message
        first, second = texts[0], texts[-1]
        assert first.endswith("assistant : 7 </s>") and "<unk>" not in first
        assert second.count("assistant : 7 </s>") == 2 and "7 <unk> </s> user : <unk> </s>" in second
        assert second.endswith("tool : <unk> </s> assistant : 7 </s>")
    ids = [int(s[3]) for s in got]
    assert len(ids) == len(set(ids))


def test_faulty_agents_fail_their_episodes_only_and_are_counted(tmp_path):
    behaviours = ["calc", "hang", "flood", "silent", "crash", "badreward", "wrongkey", "greedy", "malformed",
                  "stream"]
    store, engine, result, seconds, said = run(tmp_path, behaviours, {"timeoutSeconds": 4, "failedReward": -1.0},
                                               samplesPerRollout=20)
    assert result.rollouts == 1 and seconds < 30  # the hanging agents were stopped at their timeout
    ep = read(store, 0).stats.episodes
    assert ep.episodes == 20
    assert ep.failures == {"timeout": 2, "limit": 4, "no_reward": 4, "exit": 2, "invalid": 2}, said
    assert ep.unauthorized == 2  # the wrong key: refused, counted, no episode touched (theirs went on)
    rec = ep.record()
    assert rec["agent_failures"] == 14 and rec["agent_failures_limit"] == 4 and rec["agent_failures_engine"] == 0
    rewards = sorted(float(s[4]) for pl in payloads(store, 0) for s in samples(pl))
    # failed episodes with a turn train it with failedReward; the calc-like ones (calc, wrongkey, stream) earn 1;
    # hang, badreward, malformed and greedy never got a turn: no sample
    assert rewards == [-1.0] * 6 + [1.0] * 6, rewards
    for pl in payloads(store, 0):
        for tokens, mask, logps, *_ in samples(pl):
            check_sample(tokens, mask, logps, engine.pairs())
    assert any("episodes failed (the agent's)" in m for m in said)
    leftover = subprocess.run(["pgrep", "-f", "tests/gateway_agent.py"], capture_output=True, text=True).stdout
    assert not leftover.strip(), "agent processes outlived their episodes"


class AgentService:
    """An agent service (url mode) in a thread of the test: runs the calculator loop against the gateway in its
    handler, or answers `status` with a body."""

    def __init__(self, status: int = 200):
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.bodies.append(body)
                if status != 200:
                    data = b"agent service broke"
                else:
                    env = {**os.environ, "OPENAI_BASE_URL": body["base_url"], "OPENAI_API_KEY": body["api_key"],
                           "TRAININGRUN_TASK": json.dumps(body["task"])}
                    proc = subprocess.run(AGENT, input=json.dumps(body["task"]) + "\n", env=env, capture_output=True,
                                          text=True, timeout=60)
                    data = proc.stdout.strip().splitlines()[-1].encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.bodies: list[dict] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/episode"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def episodes_of(tmp_path, agent: AgentSpec, behaviours: list[str], n: int = 2, engine=None):
    """One run of the agent runner over the scripted engine (or `engine`): (episodes, its failure messages)."""
    store = open_store(f"file://{tmp_path}/store")
    publish_versions(store, [0])
    if engine is None:
        engine = ChatScript(store, calculator)
        engine.load_weights(0)
    runner = AgentRunner(agent, tokenizer=TOK, stop_ids=(EOS, 9), stops=(), max_new_tokens=8, seq_length=96,
                         model="m")
    prompts = [Prompt(tokens=np.zeros(1, np.int32), reference=str(2 * k + 1), index=k,
                      text=QUESTION.format(a=k, b=k + 1), meta={"behaviour": b}) for k, b in enumerate(behaviours)]
    try:
        by_prompt = runner.run(engine, prompts, n, Sampling(max_new_tokens=8, stop_token_ids=(EOS, 9)), seed=1)
        return [e for g in by_prompt for e in g], runner.messages
    finally:
        runner.close()


def test_url_mode_posts_each_task_to_the_agent_service(tmp_path):
    good, broken = AgentService(), AgentService(status=500)
    try:
        store, engine, _, _, _ = run(tmp_path / "good", ["calc"] * 4, {"command": None, "url": good.url})
        ep = read(store, 0).stats.episodes
        assert ep.failures == {} and ep.turns == 16 and len(good.bodies) == 8
        assert {tuple(sorted(b)) for b in good.bodies} == {("api_key", "base_url", "task")}
        assert good.bodies[0]["base_url"].startswith("http://127.0.0.1:") and good.bodies[0]["base_url"].endswith("/v1")
        assert len({b["api_key"] for b in good.bodies}) == 8  # a fresh key per episode
        for pl in payloads(store, 0):
            for tokens, mask, logps, *_ in samples(pl):
                assert check_sample(tokens, mask, logps, engine.pairs()) == 2
        episodes, messages = episodes_of(tmp_path / "broken", AgentSpec(url=broken.url), ["calc"] * 2)
        assert {(e.end, e.failure) for e in episodes} == {("failed", "error")}
        assert "HTTP 500" in messages[0] and "agent service broke" in messages[0]
        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            gone = f"http://127.0.0.1:{s.getsockname()[1]}/episode"
        episodes, messages = episodes_of(tmp_path / "gone", AgentSpec(url=gone), ["calc"] * 2)
        assert {(e.end, e.failure) for e in episodes} == {("failed", "error")} and "refused" in messages[0]
    finally:
        good.close()
        broken.close()


class Failing(ChatScript):
    """Refuses the requests of questions about 1 (`EngineError`); with `fault`, raises it at the second call."""

    def __init__(self, fault: BaseException | None = None):
        super().__init__(None, calculator)
        self.version, self.fault, self.calls = 0, fault, 0

    def generate_groups(self, requests, sampling, *, on_group=None):
        self.calls += 1
        if self.fault is not None and self.calls == 2:
            raise self.fault
        if any("problem: 1 +" in TOK.decode([int(t) for t in r.prompt]) for r in requests):
            raise EngineError("prompt refused (a stand-in for vLLM's 400)")
        return super().generate_groups(requests, sampling, on_group=on_group)


def test_a_refused_request_fails_its_episode_and_a_failed_engine_the_rollout(tmp_path):
    spec = AgentSpec(command=AGENT, max_turns=3, concurrency=1)  # one at a time: one engine call per request
    episodes, messages = episodes_of(tmp_path / "refused", spec, ["calc"] * 3, engine=Failing())
    assert [(e.end, e.failure) for e in episodes] == [("done", None)] * 2 + [("failed", "engine")] * 2 + \
        [("done", None)] * 2
    assert "prompt refused" in messages[0]
    for fault in (RuntimeError("CUDA error: an illegal memory access"), EngineUnavailable("no engine is live")):
        t0 = time.monotonic()
        with pytest.raises(type(fault), match=str(fault)):
            episodes_of(tmp_path / type(fault).__name__, AgentSpec(command=AGENT, max_turns=3, concurrency=4),
                        ["hang", "calc", "calc", "calc"], engine=Failing(fault))
        assert time.monotonic() - t0 < 30  # the hanging agent was stopped, not waited for (timeoutSeconds 300)
    leftover = subprocess.run(["pgrep", "-f", "tests/gateway_agent.py"], capture_output=True, text=True).stdout
    assert not leftover.strip(), "agent processes outlived the rollout's failure"


def test_the_gateways_port_taken_is_a_configuration_error_naming_the_field():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(ConfigError, match=rf"rollout.source.generate.agent.port: .*127.0.0.1:{port}"):
            Gateway(host="127.0.0.1", port=port, advertise="127.0.0.1", model="m", bind_seconds=0.5).start()
        assert 0.5 <= time.monotonic() - t0 < 5  # it waited for the port (a previous attempt's rollout may linger)
    # a port freed while the gateway waits is taken
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    threading.Timer(0.3, holder.close).start()
    g = Gateway(host="127.0.0.1", port=port, advertise="127.0.0.1", model="m", bind_seconds=5).start()
    try:
        assert g.port == port and g.base_url == f"http://127.0.0.1:{port}/v1"
    finally:
        g.close()


def test_an_engine_dying_mid_episode_the_episodes_continue_on_the_other(tmp_path):
    store = open_store(f"file://{tmp_path}/store")
    publish_disk_version(store, tmp_path / "weights", 0)
    servers = [SimProcess(token_seconds=0.01, median_tokens=6, length_sigma=0.3, vocab=320) for _ in range(2)]
    said: list[str] = []
    pool = VLLMEngine(make_clients([s.url for s in servers], timeout=60), fetch=lambda v: store.read_weights(v)[1],
                      concurrency=8, restart_timeout=5, say=said.append)
    runner = AgentRunner(AgentSpec(command=AGENT, max_turns=4, concurrency=16, timeout_seconds=60),
                         tokenizer=TOK, stop_ids=(EOS,), stops=(), max_new_tokens=8, seq_length=96, model="m")
    try:
        pool.load_weights(0)
        prompts = [Prompt(tokens=np.zeros(1, np.int32), reference="1", index=k, text=QUESTION.format(a=k, b=1),
                          meta={"behaviour": "flood"}) for k in range(8)]
        killer = threading.Thread(target=lambda: (wait_for(lambda: sum(pool.served().values()) >= 12),
                                                  servers[0].kill()))
        killer.start()
        by_prompt = runner.run(pool, prompts, 2, Sampling(max_new_tokens=8, stop_token_ids=(EOS,)), seed=1)
        killer.join()
        flat = [e for g in by_prompt for e in g]
        # every episode had its 4 turns (then the flood ran into maxTurns): none lost a turn to the dead engine,
        # and each is one token sequence — its later turns continued its tokens on the other engine
        assert all(len(e.turns) == 4 and len(e.sequences()) == 1 for e in flat)
        assert {e.failure for e in flat} == {"limit"}
        served = pool.served()
        assert served["engine-0"] > 0 and served["engine-1"] > served["engine-0"], served
        assert any("engine-0" in m and "taken out of the pool" in m for m in said), said
    finally:
        runner.close()
        pool.close()
        for s in servers:
            s.close()


def wait_for(cond, timeout: float = 60.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout
        time.sleep(0.01)


def test_a_command_that_cannot_run_is_a_configuration_error():
    with pytest.raises(ConfigError, match=r"rollout.source.generate.agent.command: 'no-such-agent-program'"):
        AgentRunner(AgentSpec(command=["no-such-agent-program", "--x"]), tokenizer=TOK, stop_ids=(EOS,), stops=(),
                    max_new_tokens=8, seq_length=96, model="m")


RUNNER = """
import sys, numpy as np
from tests.integration.test_agent_gateway import AGENT, QUESTION, TOK, Failing
from trainingrun.api.spec.rollout import AgentSpec
from trainingrun.contract.engine import Sampling
from trainingrun.rollout.agents import AgentRunner
from trainingrun.rollout.prompts import Prompt
runner = AgentRunner(AgentSpec(command=[*AGENT, sys.argv[1]], concurrency=4), tokenizer=TOK, stop_ids=(2,), stops=(),
                     max_new_tokens=8, seq_length=96, model="m")
prompts = [Prompt(tokens=np.zeros(1, np.int32), reference="1", index=k, text=QUESTION.format(a=k, b=1),
                  meta={"behaviour": "hang"}) for k in range(2)]
runner.run(Failing(), prompts, 2, Sampling(max_new_tokens=8), seed=1)
"""


def test_the_agents_die_with_the_rollout(tmp_path):
    """A rollout SIGKILLed while its agents run leaves none behind (each dies with the thread that started it)."""
    marker = f"agents-of-{tmp_path.name}"  # an argument of theirs, ignored by them
    proc = subprocess.Popen([sys.executable, "-c", RUNNER, marker], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})

    def agents() -> list[str]:
        found = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
        return [pid for pid in found if int(pid) != proc.pid]

    try:
        wait_for(lambda: len(agents()) >= 4)
        proc.kill()
        proc.wait()
        wait_for(lambda: not agents(), timeout=10)
    finally:
        proc.kill()
        for pid in agents():
            os.kill(int(pid), 9)


def test_prompts_given_as_token_ids_are_refused_for_agents(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "2 + 3 =", "answer": "5"}) + "\n" + json.dumps({"prompt_tokens": [5, 6]})
                    + "\n")
    spec = parse_trainingrun(spec_doc(path, {"command": AGENT})).spec
    store = open_store(f"file://{tmp_path}/store")
    with pytest.raises(ConfigError, match="prompts.jsonl: line 2 gives prompt_tokens; an agent is given its task as "
                                          "text"):
        loop(spec, store, ChatScript(store, calculator))
