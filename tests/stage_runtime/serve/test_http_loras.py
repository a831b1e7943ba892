"""/v1/loras and the ``loras`` request field on the real stage process (in-process executor, step mode); the
inference gateway's model-server contract read from its ``/metrics`` under load as the endpoint picker reads it
(through the ``engineConfigs`` entry shipped in ``manifests/inference-gateway/``, selected by the label the operator
puts on stage pods; ``support.endpoint_picker``); plus the startup refusal: a startup adapter that does not fit exits 2 with a reason naming it and the key —
a misshapen PEFT file, and a kohya file made for SDXL (diffusers converts its keys, then they fit no module)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import numpy as np
import pytest
import safetensors.torch as st
from lora_layouts import write_layout
from lora_probes import write_adapter
from serve_probes import decode_png, metric_samples, wait_gone, wait_until
from stage_process import StageProcess, running_stage
from support.endpoint_picker import engine_config, extract

from stage_operator.api.meta import ENGINE_TYPE, LABEL_ENGINE_TYPE
from stage_runtime.client import StageClient

ARGS = ["--device", "cpu", "--executor", "uni", "--execution-mode", "step", "--max-num-seqs", "4"]
EPP_CONFIG = Path(__file__).resolve().parents[3] / "manifests" / "inference-gateway" / "endpoint-picker-config.yaml"
COST = "diffstage.cost-outstanding-pixel-steps"
LONG = 999                  # steps: the requests run until the test aborts them


@pytest.fixture(scope="module")
def adapters(tiny_sd_path, tiny_sdxl_path, tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("http-loras")
    files = {name: write_adapter(tiny_sd_path, out / name, seed=seed) for name, seed in (("a", 1), ("b", 2))}
    tensors = st.load_file(str(Path(files["a"]) / "pytorch_lora_weights.safetensors"))
    key = sorted(k for k in tensors if k.startswith("unet."))[0]
    st.save_file({**tensors, key: tensors[key][:, :3].contiguous()}, str(out / "misshapen.safetensors"))
    st.save_file({"transformer" + k[4:] if k.startswith("unet.") else k: v for k, v in tensors.items()},
                 str(out / "flux-keys.safetensors"))
    return {**files, "misshapen": str(out / "misshapen.safetensors"), "misshapen_key": key,
            "other": str(out / "flux-keys.safetensors"), "sdxl-kohya": write_layout("kohya", tiny_sdxl_path,
                                                                                   out / "sdxl-kohya", seed=3),
            "sdxl-kohya_key": "key 'text_encoder_2."}


@pytest.fixture(scope="module")
def lora_stage(tiny_sd_path, adapters, tmp_path_factory):
    logs = tmp_path_factory.mktemp("lora-stage")
    with running_stage(["--model", tiny_sd_path, *ARGS, "--lora", f"a={adapters['a']}", "--max-loras", "3"],
                       logs / "stage.log") as stage:
        yield stage


def generate(client: httpx.Client, **body) -> httpx.Response:
    return client.post("/v1/images/generations", json={"prompt": "a cat", "size": "64x64", "seed": 3,
                                                       "num_inference_steps": 2, **body})


def test_loras_are_listed_loaded_used_and_unloaded_over_http(lora_stage, adapters):
    with httpx.Client(base_url=lora_stage.http_url, timeout=120) as c:
        before = metric_samples(c.get("/metrics").text)          # the module's other tests use adapter a too
        listed = c.get("/v1/loras").json()
        assert listed["max_loras"] == 3 and [(a["name"], a["pinned"]) for a in listed["data"]] == [("a", True)]
        assert listed["data"][0]["modules"] == {"text_encoder": 8, "unet": 40}
        loaded = c.post("/v1/loras", json={"name": "b", "path": adapters["b"]})
        assert loaded.status_code == 200 and loaded.json()["name"] == "b" and not loaded.json()["pinned"]
        base = decode_png(generate(c).json()["data"][0]["b64_json"])
        styled = generate(c, loras=[{"name": "a", "scale": 0.9}, {"name": "b", "scale": 0.3}])
        assert styled.status_code == 200, styled.text
        assert np.abs(decode_png(styled.json()["data"][0]["b64_json"]).astype(int) - base).max() > 0
        unknown = generate(c, loras=[{"name": "nope"}])
        assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "loras.0.name"
        twice = generate(c, loras=[{"name": "a"}, {"name": "a"}])
        assert twice.status_code == 400 and twice.json()["error"]["param"] == "loras"
        assert c.get("/v1/requests").json()["requests"] == []
        metrics = metric_samples(c.get("/metrics").text)
        requests_a = ("diffstage_lora_requests", (("adapter", "a"),))
        assert metrics[requests_a] - before.get(requests_a, 0.0) == 1
        assert metrics[("diffstage_lora_adapters_resident", ())] == 2
        assert c.delete("/v1/loras/b").json() == {"name": "b", "unloaded": True}
        gone = c.delete("/v1/loras/b")
        assert gone.status_code == 404 and "no LoRA adapter named 'b'" in gone.json()["error"]["message"]
        unloads = ("diffstage_lora_operations", (("kind", "unloads"),))
        assert metric_samples(c.get("/metrics").text)[unloads] - before[unloads] == 1


def test_a_file_that_does_not_fit_is_refused_with_400_naming_the_adapter_and_key(lora_stage, adapters):
    with httpx.Client(base_url=lora_stage.http_url, timeout=120) as c:
        bad = c.post("/v1/loras", json={"name": "bad", "path": adapters["misshapen"]})
        assert bad.status_code == 400, bad.text
        message = bad.json()["error"]["message"]
        assert "LoRA adapter 'bad'" in message and adapters["misshapen_key"] in message and "shape" in message
        other = c.post("/v1/loras", json={"name": "other", "path": adapters["other"]})
        assert other.status_code == 400 and "matches no module" in other.json()["error"]["message"]
        kohya = c.post("/v1/loras", json={"name": "kohya", "path": adapters["sdxl-kohya"]})
        assert kohya.status_code == 400, kohya.text
        message = kohya.json()["error"]["message"]
        assert f"LoRA adapter 'kohya' from {adapters['sdxl-kohya']!r}" in message and "key 'text_encoder_2." in message
        bad_name = c.post("/v1/loras", json={"name": "../x", "path": adapters["b"]})
        assert bad_name.status_code == 400 and bad_name.json()["error"]["param"] == "name"
        assert [a["name"] for a in c.get("/v1/loras").json()["data"]] == ["a"]


async def test_the_lora_rpcs_are_declared_control_rpcs_over_zmq(lora_stage):
    async with StageClient(lora_stage.zmq_url) as client:
        listed = await client.collective_rpc("list_loras", timeout=30)
    assert [a["name"] for a in listed] == ["a"]


async def test_the_endpoint_picker_reads_waiting_running_utilisation_and_adapters_under_load(lora_stage):
    assert LABEL_ENGINE_TYPE == "llm-d.ai/engine-type"
    config = engine_config(EPP_CONFIG, ENGINE_TYPE)
    async with httpx.AsyncClient(base_url=lora_stage.http_url, timeout=120) as http:
        idle = extract((await http.get("/metrics")).text, config)
        assert (idle["WaitingQueueSize"], idle["RunningRequestsSize"], idle["KVCacheUsagePercent"], idle[COST]) == (
            0, 0, 0.0, 0)
        listed = (await http.get("/v1/loras")).json()
        resident = {a["name"] for a in listed["data"]}                # "a" (loaded at startup), as the stage says
        assert "a" in resident and listed["max_loras"] == 3
        assert (idle["ActiveModels"], idle["WaitingModels"], idle["MaxActiveModels"]) == (resident, set(), 3)
        body = {"prompt": "x", "size": "32x32", "num_inference_steps": LONG, "loras": [{"name": "a", "scale": 0.5}]}
        ids = [f"epp-{i}" for i in range(5)]                          # max_num_seqs 4: four run, one waits
        tasks = [asyncio.create_task(http.post("/v1/images/generations", json={**body, "request_id": rid}))
                 for rid in ids]
        try:
            async def four_running_one_waiting() -> bool:
                stats = (await http.get("/v1/stats")).json()
                return (stats["running"], stats["waiting"]) == (4, 1)

            await wait_until(four_running_one_waiting, 120, "four requests running and one waiting")
            loaded = extract((await http.get("/metrics")).text, config)
            assert (loaded["WaitingQueueSize"], loaded["RunningRequestsSize"]) == (1, 4)
            assert loaded["KVCacheUsagePercent"] == 1.0                  # every batch slot busy
            assert (loaded["ActiveModels"], loaded["WaitingModels"], loaded["MaxActiveModels"]) == (resident, {"a"}, 3)
            # outstanding pixel-steps: all of the waiting request's, and what is left of the running ones' (all of
            # it until their first step ends, which a loaded machine may not have reached yet)
            assert LONG * 32 * 32 < loaded[COST] <= 5 * LONG * 32 * 32
            first = (await http.get("/v1/stats")).json()["cost"]

            async def worked() -> dict | None:
                cost = (await http.get("/v1/stats")).json()["cost"]
                return cost if cost["completed_total"] > first["completed_total"] and cost["rate"] > 0 else None

            later = await wait_until(worked, 120, "completed pixel-steps and a completion rate")
            assert later["outstanding"] < first["outstanding"]
        finally:
            await http.post("/v1/abort", json={"request_ids": ids})
            await asyncio.gather(*tasks, return_exceptions=True)
        await wait_gone(http, *ids)
        after = extract((await http.get("/metrics")).text, config)
        assert (after["WaitingQueueSize"], after["RunningRequestsSize"], after[COST]) == (0, 0, 0)
        assert after["WaitingModels"] == set()


@pytest.mark.parametrize("bad", ["misshapen", "sdxl-kohya"])
def test_a_startup_adapter_that_does_not_fit_exits_2_naming_it_and_the_key(tiny_sd_path, adapters, tmp_path, bad):
    term = tmp_path / "termination.log"
    stage = StageProcess(["--model", tiny_sd_path, *ARGS, "--lora", f"bad={adapters[bad]}"],
                         tmp_path / "stage.log", termination_log=term)
    stage.start(wait_ready=False)
    try:
        assert stage.wait(120) == 2, stage.log[-2000:]
    finally:
        stage.kill()
    reason = term.read_text()
    assert reason.startswith("LoraLoadError: ") and "'bad'" in reason and adapters[f"{bad}_key"] in reason
    assert adapters[bad] in reason                                       # the file
