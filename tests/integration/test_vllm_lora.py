"""LoRA weight sync to a real vLLM server on CPU (issue 29 item 5): the server serves the tiny Llama base with
`--enable-lora` (`server.lora_args`) and every weight version is a LoRA adapter the trainer publishes as a PEFT
directory (`publish.AdapterPublisher`), loaded with `/v1/load_lora_adapter` and named by the requests.

  run        `trainingrun run` with `trainer.lora` (rank 4), real Megatron trainer, fp32 engine, maxPolicyLag 0, two
             rollouts: every version a rollout asked for loads as an adapter (the server's log names each), the
             older one is unloaded, the engine's label names the last one, logprob_abs_diff ≤ 1e-3 (fp32, as for
             full weights) and every sync moves ≤ 5 % of the model's bytes; the last version's directory is a PEFT adapter that
             `peft.PeftModel` loads onto the base and that scores like vLLM serving it, and its tensors equal the
             trainer's adapters (the run's final checkpoint, `export-hf --adapter`) exactly
  refused    an adapter directory whose file changed after it was published is refused by its digest before vLLM
             reads it (the label is left as it was, the adapter never served)

One server for the module (its own flags: not the session's server), in the vLLM shared scope (tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.integration.test_vllm_e2e import REWARD_MODULE, write_spec
from tests.localrun import ROOT, finish, records, start
from tests.services import free_port

pytestmark = [pytest.mark.megatron, pytest.mark.vllm, pytest.mark.timeout(900)]
pytest.importorskip("peft", reason="the dev extra (peft) is not installed")

RANK = 4
ROLLOUTS = 2
FP32_TOL = 1e-3
LINE = [1, 5, 9, 33, 7, 100, 200, 3, 4, 17]


def _spec(tmp_path: Path, model: Path, url: str):
    path = write_spec(tmp_path / "lora.yaml", model, sync="disk", dtype="float32", url=url, rollouts=ROLLOUTS,
                      trainer={"lora": {"rank": RANK, "alpha": 2 * RANK}})
    doc = yaml.safe_load(path.read_text())
    doc["spec"]["metrics"] = {"enabled": False}
    doc["spec"]["trainer"]["checkpoint"]["interval"] = 0  # the end-of-run checkpoint only
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture(scope="module")
def lora_server(tiny_llama_dir, tmp_path_factory):
    """A vLLM server (fp32) started with the LoRA flags a run with trainer.lora rank 4, maxPolicyLag 0 gets."""
    from trainingrun.api import load_trainingrun
    from trainingrun.engines.vllm.server import VLLMServer, lora_args
    from tests.services import require_vllm

    d = tmp_path_factory.mktemp("vllm-lora")
    spec = load_trainingrun(_spec(d, tiny_llama_dir, "http://127.0.0.1:1")).spec
    flags = lora_args(spec)
    assert flags == ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2", "--max-cpu-loras", "2"]
    server = VLLMServer(str(tiny_llama_dir), port=free_port(), python=require_vllm(), log_path=d / "server.log",
                        dtype="float32", max_model_len=512, extra_args=tuple(flags))
    server.start()
    try:
        server.wait_healthy(600)
        yield server
    finally:
        server.close()


@pytest.fixture
def reward_module(tmp_path: Path, monkeypatch):
    (tmp_path / "parity_reward.py").write_text(REWARD_MODULE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p))


def test_lora_rl_run_loads_every_version_as_an_adapter(lora_server, tiny_llama_dir: Path, tmp_path: Path,
                                                       reward_module) -> None:
    from safetensors.torch import load_file

    from tests.integration.test_lora_train import _peft_logprobs
    from trainingrun.engines.vllm import sync
    from trainingrun.engines.vllm.client import VLLMClient
    from trainingrun.engines.vllm.publish import adapter_name, version_dir
    from trainingrun.engines.vllm.worker_ext import file_digests
    from trainingrun.trainer.checkpoint import latest_checkpoint

    log_start = lora_server.log_path.stat().st_size
    out = tmp_path / "run"
    code, log = finish(start(_spec(tmp_path, tiny_llama_dir, lora_server.url), out))
    assert code == 0, log[-4000:]
    recs = records(out)
    assert [r["weight_version"] for r in recs] == list(range(ROLLOUTS)), recs
    model_bytes = (tiny_llama_dir / "model.safetensors").stat().st_size  # fp32, the engine's dtype
    diffs = [r["logprob_abs_diff"] for r in recs]
    synced = [r["weight_sync_bytes"] for r in recs]
    print(f"LoRA on vLLM (fp32): logprob_abs_diff {diffs}; bytes per sync {synced} = "
          f"{[f'{b / model_bytes:.2%}' for b in synced]} of the model's {model_bytes}")
    assert all(r["policy_lag"] == 0 for r in recs)
    assert max(diffs) <= FP32_TOL, diffs  # the engine generated with the trainer's adapters
    assert all(0 < b <= 0.05 * model_bytes for b in synced), synced

    # every version was loaded as its adapter, the older ones unloaded; the label names the last version
    server_log = lora_server.log_path.read_text(errors="replace")[log_start:]
    for v in range(ROLLOUTS):  # rollout k generated with version k: the initial weights, then one per rollout
        assert f"Loaded new LoRA adapter: name '{adapter_name(v)}'" in server_log, v
    for v in range(ROLLOUTS - 1):
        assert f"Removed LoRA adapter: name '{adapter_name(v)}'" in server_log, v
    client = VLLMClient(lora_server.url, timeout=60)
    assert client.weight_version().endswith(str(ROLLOUTS - 1))

    # the last published directory (the weights after the last step, which no rollout asked for): PEFT loads it,
    # it scores like vLLM serving it, its tensors are the trainer's
    weights = out / "checkpoints" / "weights"
    last = ROLLOUTS
    published = version_dir(weights, last)
    assert sorted(p.name for p in published.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert sorted(p.name for p in weights.iterdir()) == [published.name]  # older versions released (lag 0)
    sync.load_adapter(client, str(published), adapter_name(last), f"v{last}", files=file_digests(published))
    served = client.prompt_logprobs(LINE, model=adapter_name(last))
    peft = _peft_logprobs(tiny_llama_dir, published, [LINE])[0]
    base = client.prompt_logprobs(LINE)
    gap = max(abs(a - b) for a, b in zip(served, peft))
    print(f"vLLM(adapter) vs PEFT(base + published adapter): max |Δ logprob| {gap:.2e}")
    assert gap <= FP32_TOL
    assert max(abs(a - b) for a, b in zip(served, base)) > 10 * FP32_TOL  # the adapter is applied
    export = tmp_path / "export"
    ckpt = latest_checkpoint(out / "checkpoints")
    proc = subprocess.run([sys.executable, "-m", "trainingrun", "export-hf", str(ckpt), "--out", str(export),
                           "--adapter"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    mine, theirs = load_file(str(published / "adapter_model.safetensors")), load_file(
        str(export / "adapter_model.safetensors"))
    assert sorted(mine) == sorted(theirs)
    assert all(mine[k].equal(theirs[k]) for k in mine), [k for k in mine if not mine[k].equal(theirs[k])]
    config = json.loads((published / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (RANK, 2 * RANK)


def test_a_changed_adapter_directory_is_refused_by_its_digest(lora_server, tmp_path: Path) -> None:
    from safetensors.torch import save_file
    import torch

    from trainingrun.contract.engine import WeightsRefused
    from trainingrun.engines.vllm import sync
    from trainingrun.engines.vllm.client import VLLMClient
    from trainingrun.engines.vllm.worker_ext import file_digests
    from trainingrun.modeling.lora import peft_config

    good = tmp_path / "good"
    good.mkdir()
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(2):  # the tiny Llama: hidden 128, rank 8 q_proj adapters
        pre = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
        tensors[f"{pre}.lora_A.weight"] = torch.randn(8, 128, generator=gen) * 0.1
        tensors[f"{pre}.lora_B.weight"] = torch.randn(128, 8, generator=gen) * 0.1
    save_file(tensors, str(good / "adapter_model.safetensors"))
    (good / "adapter_config.json").write_text(json.dumps(peft_config(8, 2.0, ["q_proj"], None)))
    files = file_digests(good)
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    data = bytearray((bad / "adapter_model.safetensors").read_bytes())
    data[-1] ^= 0xFF  # same size, one byte changed
    (bad / "adapter_model.safetensors").write_bytes(bytes(data))

    client = VLLMClient(lora_server.url, timeout=60)
    client.set_weight_version("before")
    with pytest.raises(WeightsRefused, match="SHA-256"):
        sync.load_adapter(client, str(bad), "changed", "v-bad", files=files)
    assert client.weight_version() == "before"  # refused before the label and the load
    models = {m["id"] for m in client._request("GET", "/v1/models")["data"]}
    assert "changed" not in models
    # the intact directory loads and is served by its name; a second load of the same name is no error
    result = sync.load_adapter(client, str(good), "intact", "v-good", files=files)
    assert result["adapter"] == "intact" and client.weight_version() == "v-good"
    assert sync.load_adapter(client, str(good), "intact", "v-good", files=files)["adapter"] == "intact"
    assert client.complete([1, 5, 9], max_tokens=2, model="intact")[0].token_ids
    sync.load_adapter(client, str(good), "intact-2", "v-good-2", files=files, unload=["intact", "never-loaded"])
    models = {m["id"] for m in client._request("GET", "/v1/models")["data"]}
    assert "intact" not in models and "intact-2" in models
