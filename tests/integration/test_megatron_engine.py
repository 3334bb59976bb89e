"""The in-process Megatron engine (rollout.engine.type megatron) on CPU, in a subprocess (the CPU shim is
process-global): KV-cache generation gives the same log-probabilities as a full forward of the finished sequences,
the same seed gives the same tokens, stop tokens and max new tokens end completions, and a weight version that
cannot be read completely (corrupted bytes, wrong tensors) is never half-applied: the engine stays on its version.
A LoRA engine without a base rebuilds it from an adapters-only version's base record (a rollout restarted alone)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.megatron
ROOT = Path(__file__).resolve().parents[2]

SIZES = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, vocab_size=16, seq_length=48,
             precision="fp32")


def _worker(store_url: str, out_path: str) -> None:
    import numpy as np
    import torch

    from trainingrun.contract.engine import Sampling
    from trainingrun.modeling.architecture import resolve
    from trainingrun.modeling.state import state_dict_arrays
    from trainingrun.engines.megatron import MegatronEngine
    from trainingrun.store import CorruptPayload, open_store

    store = open_store(store_url)
    engine = MegatronEngine(resolve(**SIZES), fetch=store.read_weights, seed=3, max_batch=24)
    arrays, dtypes = state_dict_arrays(engine.model)
    store.publish_weights(0, arrays, {"dtypes": dtypes})
    engine.load_weights(0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 16, size=int(rng.integers(1, 9))).tolist() + [1] for _ in range(10)]
    result = {}
    for name, s in {"t1": Sampling(temperature=1.0, max_new_tokens=10, stop_token_ids=(2,), seed=5),
                    "t07_topp": Sampling(temperature=0.7, top_p=0.8, max_new_tokens=10, stop_token_ids=(2,), seed=5)
                    }.items():
        out = engine.generate(prompts, 4, s)
        again = engine.generate(prompts, 4, s)
        diffs, reasons, ends_ok = [], {}, True
        with torch.no_grad():
            for p, group in zip(prompts, out):
                for c in group:
                    seq = torch.tensor([p + c.tokens.tolist()])
                    logits = engine.model(seq, torch.arange(seq.shape[1])[None], None, runtime_gather_output=True)
                    lp = torch.log_softmax(logits[0].float() / s.temperature, -1)[len(p) - 1:-1]
                    ref = lp.gather(-1, seq[0, len(p):, None]).squeeze(-1)
                    if s.top_p < 1.0:  # the distribution drawn from: the top-p nucleus renormalised
                        probs = lp.exp()
                        mass = []
                        for row in probs:
                            ranked = sorted(row.tolist(), reverse=True)
                            total, kept = 0.0, 0.0
                            for q in ranked:  # the most likely tokens until their mass reaches top_p
                                if total >= s.top_p:
                                    break
                                total += q
                                kept += q
                            mass.append(kept)
                        ref = ref - torch.log(torch.tensor(mass))
                    ref = ref.numpy()
                    diffs.append(float(np.abs(ref - c.logprobs).max()))
                    reasons[c.finish_reason] = reasons.get(c.finish_reason, 0) + 1
                    stopped = int(c.tokens[-1]) == 2
                    ends_ok &= (c.finish_reason == "stop") == stopped and (stopped or len(c.tokens) == 10)
                    ends_ok &= 2 not in c.tokens[:-1].tolist()
        result[name] = {"max_diff": max(diffs), "reasons": reasons, "ends_ok": bool(ends_ok),
                        "deterministic": all(np.array_equal(a.tokens, b.tokens) for x, y in zip(out, again)
                                             for a, b in zip(x, y)),
                        "n": [len(g) for g in out]}
    result["grouped"] = _grouped(engine, prompts)
    before = {k: v.clone() for k, v in engine.model.state_dict().items() if not k.endswith("_extra_state")}
    changed = {k: v + 0.05 for k, v in arrays.items()}
    # a version whose stored bytes are damaged: refused before anything is loaded
    store.publish_weights(1, changed, {"dtypes": dtypes})
    path = store.weights_path(1)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))
    try:
        engine.load_weights(1)
        result["corrupt"] = "loaded"
    except CorruptPayload as exc:
        result["corrupt"] = str(exc)
    # a version with a tensor missing
    store.publish_weights(2, {k: v for i, (k, v) in enumerate(changed.items()) if i}, {"dtypes": dtypes})
    try:
        engine.load_weights(2)
        result["missing"] = "loaded"
    except ValueError as exc:
        result["missing"] = str(exc)
    after = engine.model.state_dict()
    result["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    result["version_after_failures"] = engine.weight_version
    store.publish_weights(3, changed, {"dtypes": dtypes})
    engine.load_weights(3)
    result["version"] = engine.weight_version
    result["applied"] = all(torch.allclose(after[k], before[k] + 0.05) for k in before)
    result["lora_rebuild"] = _lora_rebuild()
    Path(out_path).write_text(json.dumps(result))


def _lora_rebuild() -> dict:
    """A LoRA engine with no base that gets adapters-only versions (a rollout restarted alone, issue 29): one naming
    a base of another digest, one naming none, one naming the trainers' seeded base (seed 3; the engine's own init
    is seed 5's): what each does to the engine."""
    import torch

    from trainingrun.contract.errors import ConfigError
    from trainingrun.engines.megatron import MegatronEngine
    from trainingrun.modeling.architecture import resolve
    from trainingrun.modeling.initialise import full_tensor
    from trainingrun.modeling.lora_base import base_reference
    from trainingrun.modeling.lora_targets import LoRASettings
    from trainingrun.modeling.state import tensors_arrays

    arch = resolve(**SIZES)
    ref = base_reference(arch, 3)
    versions: dict = {}
    engine = MegatronEngine(arch, fetch=lambda v: versions[v], seed=5, lora=LoRASettings(rank=2, alpha=4.0))
    own = {k: v for k, v in engine.model.state_dict().items() if not k.endswith(("_extra_state", ".scale_"))}
    gen = torch.Generator().manual_seed(0)
    adapters = {k: torch.randn(v.shape, generator=gen) for k, v in own.items() if ".adapter." in k}
    arrays, dtypes = tensors_arrays(adapters)
    for version, base in ((1, {**ref, "digest": "sha256:0"}), (2, None), (3, ref)):
        versions[version] = (arrays, {"dtypes": dtypes, "lora": "adapters", **({"base": base} if base else {})})
    out = {"digest": ref["digest"], "base_differs_before": any(
        not torch.equal(v, full_tensor(k, arch, seed=3)) for k, v in own.items() if ".adapter." not in k)}
    for version, kind in ((1, ConfigError), (2, ValueError)):
        try:
            engine.load_weights(version)
            out[f"v{version}"] = "loaded"
        except kind as exc:
            out[f"v{version}"] = f"{type(exc).__name__}: {exc}"
    out["version_after_refusals"] = engine.weight_version
    engine.load_weights(3)
    own = {k: v for k, v in engine.model.state_dict().items() if not k.endswith(("_extra_state", ".scale_"))}
    out["version"] = engine.weight_version
    out["adapters_loaded"] = all(torch.equal(own[k], v) for k, v in adapters.items())
    out["base_is_seed_3"] = all(torch.equal(v, full_tensor(k, arch, seed=3)) for k, v in own.items()
                                if ".adapter." not in k)
    out["tensors"] = len(own)
    return out


def _grouped(engine, prompts) -> dict:
    """Grouped generation: stop once 4 groups finished (the rest cut where they are), then continue the cut samples
    (under another version label): tokens, logprobs (KV cache vs a full forward) and per-token versions."""
    import numpy as np
    import torch

    from trainingrun.contract.engine import ABORTED, GroupRequest, Sampling

    s = Sampling(temperature=1.0, max_new_tokens=12, stop_token_ids=(2,), seed=7)
    requests = [GroupRequest(prompt=p, n=4, seed=i) for i, p in enumerate(prompts)]
    order: list[int] = []
    out = engine.generate_groups(requests, s, on_group=lambda i, comps: order.append(i) or len(order) >= 4)
    complete = [i for i, g in enumerate(out) if all(c.finished for c in g)]
    cut = [i for i, g in enumerate(out) if not all(c.finished for c in g)]
    again: list[int] = []
    engine._version = 9  # the continuation runs under "newer weights" (same tensors: the logprobs must still match)
    cont = engine.generate_groups([GroupRequest(prompt=prompts[i], n=4, seed=i, prefixes=tuple(out[i])) for i in cut],
                                  s, on_group=lambda i, comps: again.append(i) or False)
    engine._version = 0
    ok_prefix, ok_versions, diffs = True, True, []
    with torch.no_grad():
        for i, g in zip(cut, cont):
            for old, new in zip(out[i], g):
                ok_prefix &= np.array_equal(new.tokens[: len(old.tokens)], old.tokens) and new.finished
                ok_prefix &= np.array_equal(new.logprobs[: len(old.tokens)], old.logprobs)
                want = [0] * len(old.tokens) + [9 if old.finish_reason == ABORTED else 0] * (len(new.tokens)
                                                                                             - len(old.tokens))
                ok_versions &= new.versions.tolist() == want
                seq = torch.tensor([prompts[i] + new.tokens.tolist()])
                logits = engine.model(seq, torch.arange(seq.shape[1])[None], None, runtime_gather_output=True)
                lp = torch.log_softmax(logits[0].float(), -1)
                ref = lp[len(prompts[i]) - 1:-1].gather(-1, seq[0, len(prompts[i]):, None]).squeeze(-1).numpy()
                diffs.append(float(np.abs(ref - new.logprobs).max()))
    return {"reported": order, "complete": complete, "cut": cut,
            "cut_tokens": [len(c.tokens) for i in cut for c in out[i] if c.finish_reason == ABORTED],
            "continued_reported": sorted(again), "ok_prefix": bool(ok_prefix), "ok_versions": bool(ok_versions),
            "max_diff": max(diffs) if diffs else 0.0}


def test_megatron_engine(tmp_path):
    out = tmp_path / "out.json"
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from tests.integration.test_megatron_engine import _worker; "
            f"_worker({f'file://{tmp_path}/store'!r}, {str(out)!r})")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    for name in ("t1", "t07_topp"):
        assert r[name]["max_diff"] < 1e-5, r[name]  # KV cache vs full forward, same weights
        assert r[name]["deterministic"] and r[name]["ends_ok"] and r[name]["n"] == [4] * 10
        assert r[name]["reasons"].get("stop", 0) > 0 and r[name]["reasons"].get("length", 0) > 0
    g = r["grouped"]
    # on_group saw exactly the finished groups, in order, until "enough"; the rest were cut, none lost
    assert len(g["reported"]) == 4 and sorted(g["reported"]) == sorted(g["complete"][: len(g["reported"])])
    assert sorted(g["complete"] + g["cut"]) == list(range(10)) and g["cut"]
    assert any(n > 0 for n in g["cut_tokens"])  # cut mid-completion: partial tokens kept
    assert g["continued_reported"] == list(range(len(g["cut"])))  # every continued group finished
    assert g["ok_prefix"] and g["ok_versions"] and g["max_diff"] < 1e-5, g
    assert "checksum" in r["corrupt"] and "missing" in r["missing"]
    assert r["unchanged"] and r["version_after_failures"] == 0  # never half-applied
    assert r["version"] == 3 and r["applied"]
    # issue 29: a LoRA engine with no base (a rollout restarted alone) rebuilds it from the record an adapters-only
    # version names — the trainers' seeded base, its adapters on it; a record of another digest is refused naming the
    # field and both digests, one naming no base is refused, and neither loads anything
    lo = r["lora_rebuild"]
    assert lo["v1"].startswith("ConfigError: spec.seed / spec.model: weight version 1"), lo["v1"]
    assert "sha256:0" in lo["v1"] and lo["digest"] in lo["v1"], lo["v1"]
    assert lo["v2"].startswith("ValueError: ") and "names no base" in lo["v2"], lo["v2"]
    assert lo["version_after_refusals"] == -1 and lo["base_differs_before"]
    assert lo["version"] == 3 and lo["adapters_loaded"] and lo["base_is_seed_3"] and lo["tensors"] > 0, lo
