"""A reward service of the user's own for `reward.type: remote` (docs/rl.md, "Rewards served over HTTP"), standard
library only: it scores examples/rl.yaml's task as the built-in `token_match` does, and can misbehave on purpose.

    python examples/reward_server.py --port 8700 [--fail 0.1] [--hang 0.05] [--seed 0] [--token-env RM_TOKEN]

    POST /score  {"samples": [{"prompt", "prompt_tokens", "response", "response_tokens", "reference", "meta"}, ...]}
             ->  {"rewards": [float, ...]}      one per sample: the fraction of reference positions the response gets
                                                right, over max(len(response), len(reference))

`--fail P`: a request is answered 500 with probability P (the rollout retries it); `--hang P`: a request is held
without an answer for `--hang-seconds` (the rollout's timeoutSeconds fails its samples). Which requests misbehave is a
function of `--seed`, the request's body and how often that body came before (a retry draws again), not of the order
in which concurrent requests arrive: a run against it is as reproducible as the run itself. `--token-env VAR`: requests
must carry `Authorization: Bearer <$VAR>` (else 401). Point a run at it with

    reward: {type: remote, timeoutSeconds: 2, remote: {url: "http://127.0.0.1:8700/score", batchSize: 64}}
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def token_match(response, reference) -> float:
    """The fraction of reference positions right, over the longer of the two (the built-in token_match)."""
    response, reference = list(response), list(reference)
    n = max(len(response), len(reference))
    return 1.0 if n == 0 else sum(a == b for a, b in zip(response, reference)) / n


class RewardServer(ThreadingHTTPServer):
    """The service; `counts` says what it did (answered, failed, hung, refused)."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, port: int, *, fail: float = 0.0, hang: float = 0.0, hang_seconds: float = 30.0,
                 seed: int = 0, token: str | None = None):
        super().__init__(("127.0.0.1", port), _Handler)
        self.fail, self.hang, self.hang_seconds, self.token = fail, hang, hang_seconds, token
        self.seed = seed
        self.seen: dict[bytes, int] = {}  # digest of a body -> how often it came
        self.lock = threading.Lock()
        self.counts = {"answered": 0, "failed": 0, "hung": 0, "refused": 0}
        self.stopping = threading.Event()

    def count(self, what: str) -> None:
        with self.lock:
            self.counts[what] += 1

    def draw(self, body: bytes) -> float:
        """A uniform number in [0, 1) of (seed, body, the how-manieth time this body came)."""
        digest = hashlib.sha256(body).digest()
        with self.lock:
            n = self.seen.get(digest, 0)
            self.seen[digest] = n + 1
        h = hashlib.sha256(f"{self.seed}:{n}:".encode() + digest).digest()
        return int.from_bytes(h[:8], "big") / 2 ** 64

    def handle_error(self, request, client_address):  # a client that gave up on a hung request
        pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: RewardServer

    def do_POST(self):  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        srv = self.server
        if srv.token is not None and self.headers.get("Authorization") != f"Bearer {srv.token}":
            srv.count("refused")
            return self._send(401, {"error": "missing or wrong Authorization"})
        x = srv.draw(body)
        if x < srv.hang:
            srv.count("hung")
            srv.stopping.wait(srv.hang_seconds)
            return self._send(503, {"error": "gave up"})
        if x < srv.hang + srv.fail:
            srv.count("failed")
            return self._send(500, {"error": "the reward model is busy"})
        try:
            samples = json.loads(body)["samples"]
            rewards = [token_match(s["response"], s["reference"]) for s in samples]
        except (ValueError, KeyError, TypeError) as exc:
            srv.count("refused")
            return self._send(400, {"error": f"bad request: {exc}"})
        srv.count("answered")
        self._send(200, {"rewards": rewards})

    def _send(self, status: int, obj) -> None:
        data = json.dumps(obj).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client gave up (its timeout)
            pass

    def log_message(self, *args):
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8700)
    parser.add_argument("--fail", type=float, default=0.0, help="probability of a 500 answer")
    parser.add_argument("--hang", type=float, default=0.0, help="probability of holding a request unanswered")
    parser.add_argument("--hang-seconds", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--token-env", default=None, help="environment variable holding the bearer token required")
    args = parser.parse_args()
    token = os.environ[args.token_env] if args.token_env else None
    srv = RewardServer(args.port, fail=args.fail, hang=args.hang, hang_seconds=args.hang_seconds, seed=args.seed,
                       token=token)
    print(f"reward server on http://127.0.0.1:{srv.server_address[1]}/score", flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        srv.stopping.set()
        time.sleep(0.1)
        srv.server_close()
        print(json.dumps(srv.counts), flush=True)


if __name__ == "__main__":
    main()
