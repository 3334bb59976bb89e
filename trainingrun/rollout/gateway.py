"""The rollout's OpenAI-compatible gateway: the HTTP endpoint agents call for the policy (docs/rl.md, "Agents").

    POST /v1/chat/completions   messages (text content), optional tools, max_tokens / max_completion_tokens, stop,
                                stream; answered as OpenAI answers (one choice; streamed as one chunk and [DONE])
    GET  /v1/models             the policy, as one model

Every request carries its episode's key (`Authorization: Bearer KEY`, the OPENAI_API_KEY the episode's agent was
given): the key names the episode's `Session` (`rollout/sessions.py`), which turns the messages into token ids,
generates through the engine and records the turn. A key of no running episode — a wrong one, or one whose episode
ended — is answered 401 and counted (`unauthorized`); it touches no episode. A malformed request (`invalid`: the
field and what is wrong), one past the caps (`limit`), or a body over MAX_BODY bytes (`limit`) is answered 400 (413)
and fails its episode; the engine refusing it, 500 (`engine`); no engine left, 503 (the rollout then fails).
A request's `temperature` and `top_p` are checked as numbers and not used (the spec's sampling is: sessions.py);
`n` must be 1; other fields (`model`, `user`, `seed`, `tool_choice`, ...) are ignored.

Where it listens: 127.0.0.1 for agents the rollout runs itself (`command`: they are its children, in the same pod);
an agent service (`url`) gets the address the rollout's host name resolves to (the pod's IP in a cluster, where the
gateway listens on every address). The port is `agent.port`, or one the system picks. A port that stays taken for
BIND_SECONDS is a configuration error naming the field. The server is the standard library's threading HTTP server
(HTTP/1.1, keep-alive, a listen backlog for every episode at once); at most `max_handlers` requests are served at
once (more: 503), connections idle for IDLE_SECONDS are closed.
"""

from __future__ import annotations

import errno
import json
import math
import secrets
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from trainingrun.contract.engine import EngineUnavailable
from trainingrun.contract.errors import ConfigError
from trainingrun.rollout.sessions import MESSAGE_KEYS, AgentFailure, ChatRequest, Revoked, Session

FIELD = "rollout.source.generate.agent"
MAX_BODY = 8 * 1024 * 1024
MAX_MESSAGES = 4096
BIND_SECONDS = 10.0
IDLE_SECONDS = 120.0
ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_chat(body: Any) -> ChatRequest:
    """A chat completions request body, checked; AgentFailure("invalid", naming the field) otherwise."""
    def bad(what: str) -> AgentFailure:
        return AgentFailure("invalid", what)

    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs or len(msgs) > MAX_MESSAGES:
        raise bad(f"messages: must be a list of 1 to {MAX_MESSAGES} messages")
    messages = tuple(_message(m, i) for i, m in enumerate(msgs))
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or len(tools) > 1024):
        raise bad("tools: must be a list (at most 1024)")
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None and (not _is_int(limit) or limit < 1):
        raise bad(f"max_tokens: must be a positive integer, got {limit!r}")
    for name in ("temperature", "top_p"):
        value = body.get(name)
        if value is not None and (not _is_number(value) or not math.isfinite(value) or value < 0):
            raise bad(f"{name}: must be a non-negative number, got {value!r}")
    n = body.get("n")
    if n is not None and n != 1:
        raise bad(f"n: only 1 choice per request, got {n!r}")
    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else stop if stop is not None else ()
    if not isinstance(stops, (list, tuple)) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise bad("stop: must be a non-empty string or a list of at most 4")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream: must be a bool")
    return ChatRequest(messages=messages, tools=tuple(tools) if tools is not None else None, max_tokens=limit,
                       stop=tuple(stops), stream=stream)


def _message(m: Any, i: int) -> dict[str, Any]:
    """A message as the sessions compare and the template renders it: its known keys, content as text."""
    if not isinstance(m, dict):
        raise AgentFailure("invalid", f"messages[{i}]: must be an object")
    role = m.get("role")
    if role not in ROLES:
        raise AgentFailure("invalid", f"messages[{i}].role: {role!r}; allowed: {', '.join(ROLES)}")
    content = m.get("content")
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise AgentFailure("invalid", f"messages[{i}].content: only text parts ({{\"type\": \"text\", \"text\": "
                                          "...}) are served")
        content = "".join(p["text"] for p in content)
    elif content is None and role == "assistant":
        content = ""
    if not isinstance(content, str):
        raise AgentFailure("invalid", f"messages[{i}].content: must be text, got {type(content).__name__}")
    out = {k: m[k] for k in MESSAGE_KEYS[2:] if m.get(k) is not None}
    for k in ("name", "tool_call_id"):
        if k in out and not isinstance(out[k], str):
            raise AgentFailure("invalid", f"messages[{i}].{k}: must be a string")
    if "tool_calls" in out and not isinstance(out["tool_calls"], list):
        raise AgentFailure("invalid", f"messages[{i}].tool_calls: must be a list")
    return {"role": role, "content": content, **out}


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 1024
    gateway: Gateway


class Gateway:
    """The HTTP server (see the module docstring). `open(key, session)` admits an episode's key, `close_key` ends it;
    `unauthorized` counts the requests answered 401 (`take_unauthorized` reads and resets it)."""

    def __init__(self, *, host: str, port: int, advertise: str, model: str, max_handlers: int = 256,
                 say: Callable[[str], None] | None = None, bind_seconds: float = BIND_SECONDS):
        self.host, self.port, self.advertise, self.model = host, port, advertise, model
        self.say = say or (lambda _msg: None)
        self.bind_seconds = bind_seconds
        self.slots = threading.BoundedSemaphore(max_handlers)
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self.unauthorized = 0
        self.server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> Gateway:
        t0 = time.monotonic()
        while True:
            try:
                self.server = _Server((self.host, self.port), _Handler)
                break
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE or time.monotonic() - t0 >= self.bind_seconds:
                    raise ConfigError(f"{FIELD}.port: the gateway cannot listen on {self.host}:{self.port} "
                                      f"({exc.strerror or exc}); choose another port or leave agent.port unset "
                                      "(the system picks one)") from None
                time.sleep(0.25)
        self.server.gateway = self
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="gateway", daemon=True)
        self._thread.start()
        return self

    @property
    def base_url(self) -> str:
        return f"http://{self.advertise}:{self.port}/v1"

    def open(self, key: str, session: Session) -> None:
        with self._lock:
            self._sessions[key] = session

    def close_key(self, key: str) -> None:
        with self._lock:
            self._sessions.pop(key, None)

    def session(self, key: str | None) -> Session | None:
        with self._lock:
            found = self._sessions.get(key) if key else None
            if found is None:
                self.unauthorized += 1
            return found

    def count_unauthorized(self) -> None:
        with self._lock:
            self.unauthorized += 1

    def take_unauthorized(self) -> int:
        with self._lock:
            n, self.unauthorized = self.unauthorized, 0
            return n

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    timeout = IDLE_SECONDS

    def log_message(self, fmt: str, *args: Any) -> None:  # the gateway's own counters say what happened
        pass

    # ---- routes
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path.rstrip("/") != "/v1/models":
            return self._error(404, "not_found", f"no route {self.path}")
        if self._session() is None:
            return None
        g = self.server.gateway
        return self._json(200, {"object": "list", "data": [{"id": g.model, "object": "model", "created": 0,
                                                             "owned_by": "trainingrun"}]})

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        if self.path.rstrip("/") != "/v1/chat/completions":
            self._drain()
            return self._error(404, "not_found", f"no route {self.path}")
        g = self.server.gateway
        if not g.slots.acquire(blocking=False):
            self.close_connection = True
            return self._error(503, "overloaded", "the gateway serves too many requests at once; retry")
        try:
            self._chat()
        finally:
            g.slots.release()

    # ---- the chat request
    def _chat(self) -> None:
        length = self.headers.get("Content-Length")
        session = self._session(drain=False)
        if session is None:
            self.close_connection = True
            return
        if length is None or not length.isdigit():
            self.close_connection = True
            return self._failed(session, AgentFailure("invalid", "the request needs a Content-Length", 411))
        if int(length) > MAX_BODY:
            self.close_connection = True
            return self._failed(session, AgentFailure("limit", f"a request body of {length} bytes (at most "
                                                               f"{MAX_BODY})", 413))
        try:
            body = json.loads(self.rfile.read(int(length)))
        except (ValueError, UnicodeDecodeError) as exc:
            return self._failed(session, AgentFailure("invalid", f"the body is not JSON: {exc}"))
        try:
            request = parse_chat(body)
        except AgentFailure as exc:
            return self._failed(session, exc)
        try:
            turn = session.complete(request)
        except AgentFailure as exc:  # the session failed its episode
            return self._error(exc.status, exc.reason, exc.message)
        except Revoked:
            self.server.gateway.count_unauthorized()
            return self._error(401, "invalid_api_key", "the episode of this key is over")
        except EngineUnavailable as exc:
            return self._error(503, "engine_unavailable", str(exc))
        except Exception as exc:  # noqa: BLE001 - the engine failed: the rollout fails with it (sessions.py)
            return self._error(500, "engine_error", f"{type(exc).__name__}: {exc}")
        g = self.server.gateway
        rid, created = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())
        usage = {"prompt_tokens": turn.prompt_tokens, "completion_tokens": turn.completion_tokens,
                 "total_tokens": turn.prompt_tokens + turn.completion_tokens}
        if not request.stream:
            return self._json(200, {"id": rid, "object": "chat.completion", "created": created, "model": g.model,
                                    "choices": [{"index": 0, "message": {"role": "assistant", "content": turn.text},
                                                 "finish_reason": turn.finish_reason, "logprobs": None}],
                                    "usage": usage})
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": g.model}
        chunks = [{**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": turn.text},
                                        "finish_reason": None}]},
                  {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": turn.finish_reason}],
                   "usage": usage}]
        data = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return self._send(200, data.encode(), "text/event-stream")

    def _failed(self, session: Session, exc: AgentFailure) -> None:
        """A request refused before it reached its session: the episode fails with it all the same."""
        session.refuse(exc)
        self._error(exc.status, exc.reason, exc.message)

    # ---- helpers
    def _session(self, drain: bool = True) -> Session | None:
        auth = self.headers.get("Authorization", "")
        key = auth[7:].strip() if auth.startswith("Bearer ") else None
        session = self.server.gateway.session(key)
        if session is None:
            if drain:
                self._drain()
            self.close_connection = True
            self._error(401, "invalid_api_key", "no running episode has this key (OPENAI_API_KEY)")
        return session

    def _drain(self) -> None:
        length = self.headers.get("Content-Length")
        if length and length.isdigit() and int(length) <= MAX_BODY:
            self.rfile.read(int(length))
        else:
            self.close_connection = True

    def _error(self, status: int, code: str, message: str) -> None:
        kind = "invalid_request_error" if status < 500 else "server_error"
        self._json(status, {"error": {"message": message, "type": kind, "code": code}})

    def _json(self, status: int, payload: Any) -> None:
        self._send(status, json.dumps(payload).encode(), "application/json")

    def _send(self, status: int, data: bytes, content_type: str) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the agent went away (killed, timed out): nothing to answer
            self.close_connection = True
