"""The ``vllm_server`` engine's options checked from the options alone, before the model loads
(:func:`check_server_options`), and how it sends a LoRA policy (:func:`sends_adapters`)."""

from __future__ import annotations

from typing import Any

from lightning_troll.engines.base import check_option, is_count, is_number
from lightning_troll.engines.server_http import LORA_RANKS
from lightning_troll.engines.server_weights import NCCL_OPTIONS, PUSHES

__all__ = ["check_server_options", "is_address", "sends_adapters"]


def check_server_options(o: dict[str, Any], lora: Any) -> None:
    """Refuses ``model.engine.options`` (``o``: every option, over the defaults) that the
    vllm_server engine cannot take, from the options alone: before the model loads."""
    servers, launch = o["servers"], o["launch"]
    strings = lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)  # noqa: E731
    check_option("servers", servers, servers is None or strings(servers),
                 "null or a list of addresses 'http://host:port'")  # fmt: skip
    check_option("launch", launch, is_count(launch, 0), "an integer >= 1 (servers to start)")
    if bool(servers) == bool(launch):
        raise ValueError(
            "model.engine.options: the vllm_server engine takes either servers (a list of "
            f"addresses) or launch (a count >= 1); got servers={servers!r}, launch={launch!r}"
        )
    bad = [a for a in servers or [] if not is_address(a)]
    if bad:
        raise ValueError(
            f"model.engine.options.servers must be addresses 'http://host:port'; got {bad[0]!r}"
        )
    gpus = o["gpus"]
    check_option("gpus", gpus, gpus is None or (strings(gpus) and len(gpus) == launch),
                 f"null or a list of one string per launched server ({launch}), each the "
                 "server's CUDA_VISIBLE_DEVICES, e.g. ['0', '1']")  # fmt: skip
    check_option("serve_args", o["serve_args"], o["serve_args"] is None or strings(o["serve_args"]),
                 "null or a list of strings")  # fmt: skip
    wait = o["wait_s"]
    check_option("wait_s", wait, is_number(wait) and wait >= 0, "a number >= 0 (seconds)")
    for name, unit in (("kv_cache_gib", "GiB"), ("start_timeout_s", "seconds")):
        check_option(name, o[name], is_number(o[name]) and o[name] > 0, f"a number > 0 ({unit})")
    check_option("threads", o["threads"], o["threads"] is None or is_count(o["threads"], 1),
                 "null or an integer >= 1")  # fmt: skip
    check_option("concurrency", o["concurrency"], is_count(o["concurrency"], 1),
                 "an integer >= 1")  # fmt: skip
    for name in ("log_dir", "push_dir", "model_name"):
        check_option(name, o[name], o[name] is None or isinstance(o[name], str), "null or a string")
    push, nccl = o["push"], o["nccl"]
    check_option("push", push, push in PUSHES, f"one of {sorted(PUSHES)}")
    if push != "folder" and o["push_dir"] is not None:
        raise ValueError(f"model.engine.options.push_dir is for push 'folder'; push is {push!r}: "
                         "leave push_dir out")  # fmt: skip
    if push != "nccl" and nccl is not None:
        raise ValueError(f"model.engine.options.nccl is for push 'nccl'; push is {push!r}: "
                         "leave nccl out")  # fmt: skip
    check_option("nccl", nccl,
                 nccl is None or (isinstance(nccl, dict) and set(nccl) <= set(NCCL_OPTIONS)),
                 f"null or a mapping of {', '.join(NCCL_OPTIONS)}")  # fmt: skip
    nccl = nccl or {}
    for name, good, allowed in (
        ("master_address", lambda v: isinstance(v, str), "a host name or address"),
        ("master_port", lambda v: is_count(v, 1) and v <= 65535, "an integer in 1-65535"),
        ("server_workers", lambda v: is_count(v, 1), "an integer >= 1 (workers of each server)"),
    ):
        if name in nccl:
            check_option(f"nccl.{name}", nccl[name], good(nccl[name]), allowed)
    sends_adapters(o["lora_push"], push, lora)


def is_address(value: Any) -> bool:
    """Whether ``value`` is a server's address as the engine takes it: ``http://host:port`` (or
    ``https://``)."""
    return isinstance(value, str) and value.startswith(("http://", "https://"))


def sends_adapters(lora_push: str | None, push: str, lora: Any) -> bool:
    """Whether ``model.engine.options.lora_push`` sends the LoRA adapter as an adapter."""
    if lora_push not in (None, "adapter", "merged"):
        raise ValueError(f"model.engine.options.lora_push must be 'adapter' or 'merged'; "
                         f"got {lora_push!r}")  # fmt: skip
    if lora is None:
        if lora_push == "adapter":
            raise ValueError("model.engine.options.lora_push='adapter' pushes LoRA adapters, "
                             "and model.lora is null: leave lora_push out")  # fmt: skip
        return False
    if lora_push is None:
        lora_push = "adapter" if push == "folder" else "merged"
    if lora_push == "merged":
        return False
    if push != "folder":
        raise ValueError(f"model.engine.options.lora_push='adapter' needs push 'folder' (the "
                         f"servers load adapters by path); push {push!r} sends whole weights: "
                         "set lora_push to 'merged'")  # fmt: skip
    if lora.r > LORA_RANKS[-1]:
        raise ValueError(f"model.lora.r={lora.r}: vLLM serves adapters of rank at most "
                         f"{LORA_RANKS[-1]}; set model.engine.options.lora_push to 'merged'")  # fmt: skip
    return True
