"""Train–inference mismatch with a bf16 vLLM engine and an fp32 trainer (issue 18's figure for docs/rl.md).

The spec of tests/integration/test_vllm_e2e.py (tiny Llama HF directory, the launcher's own vLLM server in
bfloat16, disk weight sync after every rollout, maxPolicyLag 0, ppo, the parity reward), trained with
`policyLoss.oldLogprobs: trainer` three times, one short run each:

  none   rolloutCorrection none: the mismatch is recorded (mismatch_kl, logprob_abs_diff), nothing corrected
  tis    rolloutCorrection tis, threshold 2.0: each token's loss times min(rho, 2)
  mask   rolloutCorrection mask, token level, [0.95, 1.05]: tokens with rho outside are dropped from the numerator

rho = pi_old / pi_engine with pi_old the trainer's recomputed log-probabilities (fp32) and pi_engine vLLM's (bf16).
Prints the token-weighted means over each run's steps. Needs `make vllm`; starts one vLLM server per run, so run it
under the shared lock: `flock /work/brief/vllm.lock .venv/bin/python benchmarks/rl_mismatch_vllm.py [--rollouts 3]`.
Prints figures, asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the launcher helpers and the e2e spec of the tests

from tests.integration.test_vllm_e2e import REWARD_MODULE, write_spec  # noqa: E402
from tests.localrun import finish, records, start  # noqa: E402
from tests.services import make_tiny_llama, require_vllm  # noqa: E402

VARIANTS = {
    "none": {"oldLogprobs": "trainer"},
    "tis": {"oldLogprobs": "trainer", "rolloutCorrection": {"type": "tis", "threshold": 2.0}},
    "mask": {"oldLogprobs": "trainer",
             "rolloutCorrection": {"type": "mask", "level": "token", "threshold": 1.05, "lowerThreshold": 0.95}},
}
MEANS = ("mismatch_kl", "logprob_abs_diff", "correction_weight", "masked_fraction", "importance_ratio")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rollouts", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="rl-mismatch-"))
    (tmp / "parity_reward.py").write_text(REWARD_MODULE)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(tmp), os.environ.get("PYTHONPATH")) if p)
    model = make_tiny_llama(require_vllm(), tmp / "tiny-llama")
    results = {}
    for name in args.variants.split(","):
        spec = write_spec(tmp / f"{name}.yaml", model, sync="disk", dtype="bfloat16", rollouts=args.rollouts)
        doc = yaml.safe_load(spec.read_text())
        doc["spec"]["trainer"]["policyLoss"] = VARIANTS[name]
        spec.write_text(yaml.safe_dump(doc))
        out = tmp / name
        code, log = finish(start(spec, out), timeout=1500)
        if code != 0:
            raise SystemExit(f"{name}: exit {code}\n{log[-4000:]}")
        recs = records(out)
        tokens = [r["loss_tokens"] for r in recs]
        row = {f: sum(r[f] * t for r, t in zip(recs, tokens)) / sum(tokens) for f in MEANS}
        row["correction_weight_max"] = max(r["correction_weight_max"] for r in recs)
        row["old_logprob_seconds"] = sum(r.get("old_logprob_seconds", 0.0) for r in recs) / args.rollouts
        row["losses"] = [r["loss"] for r in recs]
        row["steps"] = len(recs)
        results[name] = row
        print(name, json.dumps(row), flush=True)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
