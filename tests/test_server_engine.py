"""The ``vllm_server`` engine against stand-in servers (``http.server`` in a thread, answering
vLLM's routes the way ``vllm serve`` does): prompts split among servers, token ids and log-probs
laid out, every completion tagged with the weight version that sampled it, weights pushed by
folder, LoRA adapters pushed as adapters, a restarted server given the weights again, the next
rollout sampled ahead, and the one-line refusals and faults. No vLLM needed;
``tests/test_server_vllm.py`` runs real servers."""

from __future__ import annotations

import json
import subprocess
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from lightning_troll.engines.base import EngineContext, SampleRequest, build_engine
from lightning_troll.engines.process import EngineDied
from lightning_troll.engines.sampling import SamplingConfig
from lightning_troll.engines.server_http import Launched, ServerDown, free_port
from lightning_troll.engines.server_weights import NCCLPush
from lightning_troll.engines.servers import ServerEngine, check_servers_answer, split_evenly
from lightning_troll.models.loading import load_policy, load_tokenizer
from lightning_troll.models.lora import LoraConfig, adapter_files, apply_lora
from lightning_troll.models.snapshots import AdapterSnapshot

TOKENIZER = load_tokenizer("tinymath")
EOS = TOKENIZER.eos_token_id


class StandIn:
    """A server answering vLLM's routes: completion ``k`` of a prompt is ``[last + 1 + k, EOS]``
    with log-probs ``-0.5`` each; ``fail`` makes a route answer HTTP 500. ``lora_rank``: started
    with ``--enable-lora --max-lora-rank`` that rank (None: without), ``runtime_lora``: with
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``; the adapters it holds are in ``adapters``;
    ``dtype``: what it computes in, as ``/server_info`` names it."""

    def __init__(self, name: str = "tinymath", tokenize=None, port: int | None = None,
                 lora_rank: int | None = 8, runtime_lora: bool = True,
                 dtype: str = "torch.float32") -> None:  # fmt: skip
        self.name, self.tokenize = name, tokenize or (lambda text: TOKENIZER.encode(
            text, add_special_tokens=False))  # fmt: skip
        self.version, self.requests, self.reloads, self.fail = None, [], [], set()
        self.lora_rank, self.runtime_lora, self.adapters, self.loads = (
            lora_rank,
            runtime_lora,
            {},
            [],
        )
        self.dtype, self.info_reads = dtype, 0
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _answer(self, code, payload):
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._answer(*stand_in.route(self.path, None))

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"null")
                self._answer(*stand_in.route(self.path, body))

        self.port = port or free_port()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.address = f"http://127.0.0.1:{self.port}"

    def route(self, path, body):
        if path in self.fail:
            return 500, {"error": {"message": f"{path} broke"}}
        if path == "/v1/models":
            return 200, {"data": [{"id": self.name, "root": f"/models/{self.name}"}]}
        if path == "/tokenize":
            return 200, {"tokens": self.tokenize(body["prompt"])}
        if path == "/weight_info":
            return 200, {"weight_version": self.version}
        if path == "/update_weight_version":
            self.version = body["new_version"]
            return 200, {"success": True}
        if path == "/collective_rpc":
            folder = Path(body["kwargs"]["weights_path"])
            self.reloads.append((folder, (folder / "model.safetensors").is_file()))
            return 200, {"results": [None]}
        if path == "/server_info?config_format=json" or "lora_adapter" in path:
            return self.lora_route(path, body)
        if path in ("/reset_prefix_cache", "/health"):
            return 200, {}
        if path == "/v1/completions":
            self.requests.append(body)
            last = body["prompt"][-1]
            choices = [{"index": k, "text": "", "token_ids": [last + 1 + k, EOS],
                        "logprobs": {"token_logprobs": [-0.5, -0.5]}}
                       for k in range(body["n"])]  # fmt: skip
            return 200, {"choices": choices}
        return 404, {"detail": "Not Found"}

    def lora_route(self, path, body):
        """``/server_info`` (its LoRA part) and the runtime LoRA routes."""
        if path == "/server_info?config_format=json":
            self.info_reads += 1
            lora = None if self.lora_rank is None else {"max_lora_rank": self.lora_rank}
            return 200, {
                "vllm_config": {"lora_config": lora, "model_config": {"dtype": self.dtype}},
                "vllm_env": {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": self.runtime_lora},
            }
        if path == "/v1/load_lora_adapter":
            self.loads.append(body)
            if body["lora_name"] in self.adapters and not body.get("load_inplace"):
                return 400, {"error": {"message": "already loaded"}}
            self.adapters[body["lora_name"]] = Path(body["lora_path"])
            return 200, "Success"
        if self.adapters.pop(body["lora_name"], None) is None:  # /v1/unload_lora_adapter
            return 404, {"error": {"message": "cannot be found"}}
        return 200, "Success"

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def stand_ins():
    servers = [StandIn(), StandIn()]
    yield servers
    for server in servers:
        server.stop()


def engine_for(addresses, **options):
    context = EngineContext("tinymath", "float32", TOKENIZER)
    return build_engine("vllm_server", context, {"servers": addresses, **options})


SAMPLING = SamplingConfig(max_new_tokens=4)


def asked(prompts, group, pad_id=TOKENIZER.pad_token_id):
    """The request of ``group`` completions of each prompt, 4 tokens at most, ended by EOS."""
    return SampleRequest(prompts, group, SAMPLING, pad_id, (EOS,))


def test_prompts_are_split_evenly_in_order():
    assert split_evenly(10, 3) == [0] * 4 + [1] * 3 + [2] * 3
    assert split_evenly(2, 3) == [0, 1]
    assert split_evenly(4, 2) == [0, 0, 1, 1]


def test_two_servers_share_a_rollout_and_tag_it_with_the_version_pushed(stand_ins, tmp_path):
    policy = load_policy("tinymath")
    engine = engine_for([s.address for s in stand_ins], push_dir=str(tmp_path))
    prompts = [[1, 5], [1, 6], [1, 7], [1, 8], [1, 9]]
    torch.manual_seed(0)
    generation = engine.generate(policy, asked(prompts, 2))
    # the first 3 prompts went to the first server, the last 2 to the second, as token ids
    assert sorted(r["prompt"] for r in stand_ins[0].requests) == prompts[:3]  # sent at once:
    assert sorted(r["prompt"] for r in stand_ins[1].requests) == prompts[3:]  # in any order
    first = stand_ins[0].requests[0]
    assert first["n"] == 2 and first["logprobs"] == 0 and first["stop_token_ids"] == [EOS]
    assert first["return_token_ids"] is True and first["max_tokens"] == 4
    seed_of = {tuple(r["prompt"]): r["seed"] for s in stand_ins for r in s.requests}
    seeds = [seed_of[tuple(p)] for p in prompts]
    assert seeds == [seeds[0] + 2 * i for i in range(5)]  # a seed of its own per request
    # prompt-major, G each: prompt i's completion k is [last + 1 + k, EOS], log-probs -0.5
    assert generation.input_ids.shape == (10, 2 + 2)
    assert generation.input_ids[:, 2:].tolist() == [[p[-1] + 1 + k, EOS]
                                                    for p in prompts for k in range(2)]  # fmt: skip
    assert generation.response_mask.all() and not generation.truncated.any()
    assert torch.equal(generation.logprobs, torch.full((10, 2), -0.5))
    # weights went by folder, version 1, to both; every completion is tagged with it
    assert all(len(s.reloads) == 1 and s.reloads[0][1] for s in stand_ins)
    assert engine.version == 1 and engine.last_versions == [1] * 10
    assert engine.last_fingerprint is not None
    engine.stale = True  # a refresh: the next rollout pushes version 2 first
    engine.generate(policy, asked(prompts[:2], 2))
    assert engine.last_versions == [2] * 4 and [s.version for s in stand_ins] == ["2", "2"]
    assert not stand_ins[0].reloads[0][0].exists()  # the older version's folder is removed
    engine.close()


def test_the_next_rollout_is_sampled_ahead_and_taken_when_it_is_asked_for(stand_ins, tmp_path):
    policy = load_policy("tinymath")
    engine = engine_for([s.address for s in stand_ins], push_dir=str(tmp_path))
    engine.load_weights(policy)
    prompts = [[1, 5], [1, 6]]
    engine.submit(asked(prompts, 3))
    engine.generate(policy, asked(prompts, 3))
    assert engine.figures()["engine/server_prefetched"] == 1.0
    assert sum(len(s.requests) for s in stand_ins) == 2  # not asked twice
    engine.close()


def test_a_server_that_is_not_up_is_refused_naming_its_address(tmp_path, monkeypatch):
    """Refused while it is built, the engine leaves no temporary push folder behind."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    address = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerDown, match=f"server at {address} did not answer GET /v1/models"):
        engine_for([address])
    assert issubclass(ServerDown, EngineDied)  # the rollout callback makes it a fault
    assert list(tmp_path.iterdir()) == []


def test_a_server_of_another_model_tokenizer_or_dtype_is_refused_before_training():
    other = StandIn(name="Qwen3-0.6B")
    odd = StandIn(tokenize=lambda text: [1, 2, 3])
    rounded = StandIn(dtype="torch.bfloat16")
    try:
        with pytest.raises(ValueError, match=f"server at {rounded.address} computes in bfloat16; "
                           "this run's model.dtype is float32: start it with --dtype float32"):  # fmt: skip
            engine_for([rounded.address])
        auto = EngineContext("tinymath", "auto", TOKENIZER)
        build_engine("vllm_server", auto, {"servers": [rounded.address]}).close()
        with pytest.raises(ValueError, match=f"server at {other.address} serves 'Qwen3-0.6B'"):
            engine_for([other.address])
        with pytest.raises(ValueError, match=f"server at {odd.address} tokenizes otherwise"):
            engine_for([odd.address])
        engine_for([other.address], model_name="Qwen3-0.6B", push_dir=None).close()
    finally:
        other.stop()
        odd.stop()
        rounded.stop()


def test_an_error_answer_or_a_server_gone_ends_the_rollout_naming_the_address(stand_ins):
    policy = load_policy("tinymath")
    engine = engine_for([s.address for s in stand_ins])
    engine.load_weights(policy)
    stand_ins[1].fail.add("/v1/completions")
    with pytest.raises(ServerDown, match=f"{stand_ins[1].address} answered POST /v1/completions "
                                         "with HTTP 500"):  # fmt: skip
        engine.generate(policy, asked([[1, 5], [1, 6]], 2, pad_id=0))
    stand_ins[1].fail.clear()
    stand_ins[0].stop()
    with pytest.raises(ServerDown, match=f"{stand_ins[0].address} did not answer"):
        engine.generate(policy, asked([[1, 5], [1, 6]], 2, pad_id=0))
    stand_ins[0].stop = lambda: None  # already stopped
    root = engine._push.root  # no push_dir: a temporary folder of the engine's own
    engine.close()
    assert not root.exists()


def test_the_servers_given_are_asked_before_the_model_loads(stand_ins):
    """The command line's check: a server that answers passes, one that does not is refused as
    bad input naming its address; malformed options are left to the options' own check."""
    check_servers_answer({"servers": [s.address for s in stand_ins]})
    assert all(len(s.requests) == 0 for s in stand_ins)  # asked, not sampled from
    down = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ValueError, match=rf"^model.engine.options.servers: the vLLM server at "
                       rf"{down} did not answer GET /v1/models"):  # fmt: skip
        check_servers_answer({"servers": [stand_ins[0].address, down]})
    for malformed in ({"servers": down}, {"servers": ["x:1"]}, {"servers": [down], "wait_s": -1},
                      {"servers": [down], "colour": 1}, {"launch": 1}, None):  # fmt: skip
        check_servers_answer(malformed)


def test_wait_s_waits_for_a_server_to_come_back():
    port = free_port()
    late: list[StandIn] = []
    timer = threading.Timer(1.5, lambda: late.append(StandIn(port=port)))
    timer.start()
    try:
        engine = engine_for([f"http://127.0.0.1:{port}"], wait_s=20)  # not up for 1.5 s
        assert engine.servers[0].model == "tinymath"
        engine.close()
    finally:
        timer.join()
        for server in late:
            server.stop()
    with pytest.raises(ValueError, match=r"wait_s must be a number >= 0 \(seconds\); got -1"):
        engine_for([f"http://127.0.0.1:{port}"], wait_s=-1)


def test_the_options_are_checked_naming_them():
    with pytest.raises(ValueError, match="either servers .* or launch"):
        engine_for([])
    with pytest.raises(ValueError, match="servers must be addresses 'http://host:port'; got 'x:1'"):
        engine_for(["x:1"])
    with pytest.raises(ValueError, match="push must be one of"):
        engine_for(["http://127.0.0.1:1"], push="carrier-pigeon")


A = "http://127.0.0.1:1"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"servers": A}, r"servers must be null or a list of addresses 'http://host:port'; "
                         r"got 'http://127.0.0.1:1'"),
        ({"launch": True}, r"launch must be an integer >= 1 \(servers to start\); got True"),
        ({"servers": [A], "wait_s": "5"}, r"wait_s must be a number >= 0 \(seconds\); got '5'"),
        ({"servers": [A], "concurrency": 2.5}, r"concurrency must be an integer >= 1; got 2.5"),
        ({"servers": [A], "concurrency": None}, r"concurrency must be an integer >= 1; got None"),
        ({"launch": 2, "gpus": [0, 1]}, r"gpus must be null or a list of one string per launched "
                                        r"server \(2\), .*; got \[0, 1\]"),
        ({"launch": 1, "kv_cache_gib": "2"}, r"kv_cache_gib must be a number > 0 \(GiB\); got '2'"),
        ({"launch": 1, "start_timeout_s": 0},
         r"start_timeout_s must be a number > 0 \(seconds\); got 0"),
        ({"launch": 1, "threads": 0}, r"threads must be null or an integer >= 1; got 0"),
        ({"launch": 1, "serve_args": "--enforce-eager"},
         r"serve_args must be null or a list of strings; got '--enforce-eager'"),
        ({"servers": [A], "push": "nccl", "nccl": {"port": 1}},
         r"nccl must be null or a mapping of master_address, master_port, server_workers; "
         r"got \{'port': 1\}"),
        ({"servers": [A], "push": "nccl", "nccl": {"master_port": 70000}},
         r"nccl.master_port must be an integer in 1-65535; got 70000"),
        ({"servers": [A], "nccl": {"master_port": 29600}},
         r"nccl is for push 'nccl'; push is 'folder': leave nccl out"),
        ({"servers": [A], "push": "nccl", "push_dir": "/tmp/weights"},
         r"push_dir is for push 'folder'; push is 'nccl': leave push_dir out"),
    ],
)  # fmt: skip
def test_bad_options_are_refused_from_the_options_alone(options, message):
    """Before the model loads: nothing is built and no server is reached (none listens at A)."""
    with pytest.raises(ValueError, match=r"^model\.engine\.options\." + message + "$"):
        ServerEngine.check_options(options)
    ServerEngine.check_options({"servers": [A], "push": "nccl", "nccl": {"master_port": 29600}})


def test_a_restarted_server_is_given_the_current_version_again(stand_ins, tmp_path):
    policy = load_policy("tinymath")
    engine = engine_for([s.address for s in stand_ins], push_dir=str(tmp_path))
    engine.load_weights(policy)
    engine.generate(policy, asked([[1, 5], [1, 6]], 2))
    assert engine.figures()["engine/server_repushes"] == 0.0
    folder = stand_ins[1].reloads[0][0]
    stand_ins[1].version = "default"  # restarted: it holds the weights it started with
    with pytest.warns(UserWarning, match=f"server at {stand_ins[1].address} holds weight version "
                                         "'default', not the version 1 pushed"):  # fmt: skip
        engine.generate(policy, asked([[1, 5], [1, 6]], 2))
    assert stand_ins[1].reloads == [(folder, True), (folder, True)]  # the kept folder, again
    assert len(stand_ins[0].reloads) == 1 and stand_ins[1].version == "1"
    assert engine.last_versions == [1] * 4
    assert engine.figures()["engine/server_repushes"] == 1.0
    # with NCCL there is no folder to give it: the run still ends, naming the server
    folder_push, engine._push = engine._push, NCCLPush()
    stand_ins[1].version = "default"
    with pytest.raises(ServerDown, match=f"{stand_ins[1].address} holds weight version 'default'"
                                         ".*push 'nccl' cannot give"):  # fmt: skip
        engine.generate(policy, asked([[1, 5], [1, 6]], 2))
    engine._push = folder_push
    engine.close()


LORA = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])


def lora_engine(addresses, **options):
    context = EngineContext("tinymath", "float32", TOKENIZER, lora=LORA)
    return build_engine("vllm_server", context, {"servers": addresses, **options})


def lora_snapshot(seed: int):
    """A LoRA policy whose snapshot adapter holds seeded noise (the module, in behaviour mode,
    is what an engine is handed)."""
    policy = apply_lora(load_policy("tinymath"), LORA)
    snapshot = AdapterSnapshot(policy)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if ".snapshot" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator))
    return snapshot


def test_lora_adapters_are_pushed_as_adapters_and_named_in_every_request(stand_ins, tmp_path):
    from safetensors.torch import load_file

    engine = lora_engine([s.address for s in stand_ins], push_dir=str(tmp_path))
    snapshot = lora_snapshot(0)
    prompts = [[1, 5], [1, 6], [1, 7]]
    with snapshot.behaviour() as behaviour:
        engine.generate(behaviour, asked(prompts, 2))
        tensors, config = adapter_files(behaviour)
    folder = tmp_path / "version-1"
    for server in stand_ins:  # loaded by path under the version's name, no whole-weight reload
        assert server.loads == [{"lora_name": "lightning-troll-v1", "lora_path": str(folder)}]
        assert server.reloads == [] and server.version == "1"
        assert {r["model"] for r in server.requests} == {"lightning-troll-v1"}
    # peft's save format: the snapshot adapter's weights, without its name, and its config
    written = load_file(str(folder / "adapter_model.safetensors"))
    assert (
        written.keys() == tensors.keys() and len(written) == 3 * 2 * 2
    )  # 3 layers, q and v, A and B
    assert all(torch.equal(written[k], tensors[k]) for k in written)
    assert next(iter(written)).endswith("q_proj.lora_A.weight")
    stored = json.loads((folder / "adapter_config.json").read_text())
    assert stored == config and stored["r"] == 4 and stored["inference_mode"] is True
    assert sorted(stored["target_modules"]) == ["q_proj", "v_proj"]
    assert engine.last_versions == [1] * 6
    # the next version: loaded under its own name, the previous one unloaded, its folder removed
    engine.stale = True
    with snapshot.behaviour() as behaviour:
        engine.generate(behaviour, asked(prompts, 2))
        assert [s.adapters for s in stand_ins] == [{"lightning-troll-v2": folder.parent /
                                                    "version-2"}] * 2  # fmt: skip
        assert not folder.exists() and stand_ins[1].requests[-1]["model"] == "lightning-troll-v2"
        # a server that restarted is given the adapter again, from the kept folder
        stand_ins[0].adapters, stand_ins[0].version = {}, "default"
        with pytest.warns(UserWarning, match="holds weight version 'default'"):
            engine.generate(behaviour, asked(prompts, 2))
    assert stand_ins[0].loads[-1] == {"lora_name": "lightning-troll-v2", "load_inplace": True,
                                      "lora_path": str(tmp_path / "version-2")}  # fmt: skip
    assert engine.figures()["engine/server_repushes"] == 1.0
    assert engine.last_versions == [2] * 6
    engine.close()


def test_lora_push_merged_sends_the_merged_weights(stand_ins, tmp_path):
    engine = lora_engine([stand_ins[0].address], push_dir=str(tmp_path), lora_push="merged")
    with lora_snapshot(0).behaviour() as behaviour:
        engine.generate(behaviour, asked([[1, 5]], 2))
    assert stand_ins[0].loads == [] and len(stand_ins[0].reloads) == 1
    assert stand_ins[0].requests[0]["model"] == "tinymath"
    engine.close()


def test_a_server_that_cannot_load_adapters_is_refused_naming_what_to_add():
    plain = StandIn(lora_rank=None, runtime_lora=False)
    small = StandIn(lora_rank=1)
    try:
        with pytest.raises(ValueError, match=f"server at {plain.address} cannot load this run's "
                                             r"LoRA adapters \(rank 4\) by path: start it with "
                                             "--enable-lora --max-lora-rank 8 and the environment "
                                             "variable VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, or "
                                             "set model.engine.options.lora_push to 'merged'"):  # fmt: skip
            lora_engine([plain.address])
        with pytest.raises(ValueError, match=r"start it with --max-lora-rank 8 \(it has 1\), or"):
            lora_engine([small.address])
        lora_engine([plain.address], lora_push="merged").close()  # whole weights: no LoRA needed
    finally:
        plain.stop()
        small.stop()


def test_a_servers_configuration_is_read_once_for_its_checks_and_not_when_none_asks(stand_ins):
    """The LoRA and dtype checks share one ``/server_info`` read per server; with
    ``model.dtype: auto`` and no adapters neither asks, and the route is not read."""
    lora_engine([s.address for s in stand_ins]).close()
    assert [s.info_reads for s in stand_ins] == [1, 1]
    engine_for([stand_ins[0].address]).close()  # the dtype check alone
    assert stand_ins[0].info_reads == 2
    auto = EngineContext("tinymath", "auto", TOKENIZER)
    build_engine("vllm_server", auto, {"servers": [stand_ins[1].address]}).close()
    assert stand_ins[1].info_reads == 1


def test_the_lora_push_options_are_checked_naming_them():
    address = "http://127.0.0.1:1"
    with pytest.raises(ValueError, match="lora_push must be 'adapter' or 'merged'; got 'both'"):
        lora_engine([address], lora_push="both")
    with pytest.raises(ValueError, match="lora_push='adapter' needs push 'folder'"):
        lora_engine([address], push="nccl", lora_push="adapter")
    with pytest.raises(ValueError, match="lora_push='adapter' pushes LoRA adapters, and "
                                         "model.lora is null"):  # fmt: skip
        engine_for([address], lora_push="adapter")
    context = EngineContext("tinymath", "float32", TOKENIZER, lora=LoraConfig(r=1024))
    with pytest.raises(ValueError, match="model.lora.r=1024: vLLM serves adapters of rank at most "
                                         "512; set model.engine.options.lora_push to 'merged'"):  # fmt: skip
        build_engine("vllm_server", context, {"launch": 1})


def test_launched_servers_get_the_lora_flags_and_on_a_cpu_whole_prefills(monkeypatch, tmp_path):
    started = []

    class Recorded:
        def __init__(self, command, env, **_):
            started.append((command, env))

    monkeypatch.setattr(subprocess, "Popen", Recorded)
    Launched(1, "models/m", "float32", ["--max-model-len", "64"], None, 1, None, str(tmp_path),
             lora_rank=12, cpu=True)  # fmt: skip
    Launched(1, "models/m", "float32", [], ["0"], 1, None, str(tmp_path))
    (command, env), (plain, plain_env) = started
    assert command[-6:] == ["--no-enable-chunked-prefill", "--enable-lora", "--max-lora-rank", "16",
                            "--max-model-len", "64"]  # fmt: skip
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert plain[-2:] == ["--seed", "0"] and plain_env["CUDA_VISIBLE_DEVICES"] == "0"
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in plain_env
