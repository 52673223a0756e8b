"""A real ``mlxrt serve`` process on 127.0.0.1, driven by the official ``openai`` client (and by
``mlxrt ps/load/unload``): the model list, load and unload, auto-load, keep-alive.

Each server runs on an ephemeral port, every request is bounded, and the process is always
stopped (SIGTERM, then SIGKILL), whatever the test does.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from bench.http_client import HOST
from bench.serving import ServerCommand, running
from runtime.backends.simulated import greedy_continuation
from runtime.cli import main

REQUEST_TIMEOUT_S = 120.0
EXPECTED = bytes(greedy_continuation(list(b"hello"), 3)).decode()


@contextlib.contextmanager
def mlxrt_serve(*args: str) -> Iterator[str]:
    """``mlxrt serve ARGS`` on a free loopback port until it answers ``/health``; its URL. The
    bench's launcher starts, waits for and stops it (SIGTERM, then SIGKILL), as it does its own."""
    # Memory only: a test never writes to the user's cache folder.
    argv = (sys.executable, "-m", "runtime.cli", "serve", "--quiet", "--no-disk-cache", *args)
    with running([ServerCommand("runtime", argv, model="")]) as [server]:
        yield f"http://{HOST}:{server.port}"


def client_for(url: str) -> openai.OpenAI:
    """A client for ``url``; use it in a ``with``: one dropped unclosed leaves its sockets to the
    garbage collector, whose ResourceWarning then fails whichever test collects them."""
    return openai.OpenAI(
        base_url=f"{url}/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S, max_retries=0
    )


def states(client: openai.OpenAI) -> dict[str, str]:
    """Each listed model's state: the server's extra field, which the client keeps."""
    return {model.id: (model.model_extra or {})["state"] for model in client.models.list()}


def wait_for(condition: Callable[[], bool], what: str, within_s: float = 30.0) -> None:
    """Poll a server-side condition (another process: nothing to wait on), bounded."""
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"waited {within_s} s for {what}")
        time.sleep(0.05)


def post(client: openai.OpenAI, path: str, **body: object) -> dict[str, Any]:
    return client.post(path, body=body, cast_to=dict[str, Any])  # type: ignore[no-any-return]


def test_the_openai_client_lists_loads_and_unloads_models() -> None:
    with (
        mlxrt_serve("--backend", "simulated", "--model", "m", "--model", "other") as url,
        client_for(url) as client,
    ):
        assert states(client) == {"m": "loaded", "other": "loaded"}
        [card] = [model for model in client.models.list() if model.id == "m"]
        assert card.object == "model" and card.owned_by == "mlx-actor-runtime"
        # Named on the command line without --keep-alive: kept loaded (issue 21).
        assert (card.model_extra or {})["keep_alive"] is None

        text = client.completions.create(model="m", prompt="hello", max_tokens=3, temperature=0)
        assert text.choices[0].text == EXPECTED

        unloaded = post(client, "/models/unload", model="m")
        assert unloaded == {"model": "m", "status": "unloaded", "epoch": 1}
        assert states(client)["m"] == "available"
        loaded = post(client, "/models/load", model="m", keep_alive=-1)
        assert (loaded["status"], loaded["keep_alive"]) == ("loaded", None)
        with pytest.raises(openai.ConflictError) as already:
            post(client, "/models/load", model="m")
        assert already.value.code == "model_already_loaded"
        with pytest.raises(openai.NotFoundError) as unknown:
            post(client, "/models/load", model="nope")
        assert unknown.value.code == "model_not_available"


def test_a_request_loads_an_unloaded_model_and_the_keep_alive_unloads_it() -> None:
    with (
        mlxrt_serve("--backend", "simulated", "--model", "m", "--keep-alive", "0") as url,
        client_for(url) as client,
    ):
        wait_for(lambda: states(client)["m"] == "idle", "the idle model to unload")
        # Auto-load: the request waits for the load, then is answered as usual.
        chat = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert chat.choices[0].message.content
        stream = client.completions.create(
            model="m", prompt="hello", max_tokens=3, temperature=0, stream=True
        )
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == EXPECTED
        wait_for(lambda: states(client)["m"] == "idle", "the keep-alive to unload it again")


def test_mlxrt_ps_load_and_unload_talk_to_the_server(capsys: pytest.CaptureFixture[str]) -> None:
    with mlxrt_serve("--backend", "simulated", "--model", "m", "--model", "b") as url:
        assert main(["unload", "b", "--url", url]) == 0
        assert main(["ps", "--url", url]) == 0
        table = capsys.readouterr().out.splitlines()
        assert table[0].split() == ["unloaded", "b"]
        header = ["NAME", "STATE", "REQUESTS", "KEEP-ALIVE", "UNLOADS", "IN", "WHERE", "DISK"]
        assert table[1].split() == [*header, "CACHE"]
        assert table[2].split()[:4] == ["m", "loaded", "0", "forever"]
        assert table[2].split()[-3:] == ["in", "process", "off"]
        assert len(table) == 3  # b is available, not loaded: `mlxrt models` lists those
        assert main(["load", "b", "--keep-alive", "1h", "--url", url]) == 0
        assert "keep-alive 1h" in capsys.readouterr().out
        assert main(["unload", "nope", "--url", url]) == 1
        assert "not loaded" in capsys.readouterr().err
    assert main(["ps", "--url", url]) == 2  # the server is gone
    assert "no server answers" in capsys.readouterr().err


@pytest.mark.real_model
def test_a_known_model_loads_on_demand_next_to_the_default_one(
    real_gguf: Callable[[str], Path],
) -> None:
    for name in ("smollm2-135m-instruct", "gemma3-270m"):
        real_gguf(name)  # fetched beforehand (or skipped): the server then only converts
    with mlxrt_serve("--kv-budget-mib", "256") as url, client_for(url) as client:
        listed = states(client)
        assert listed["smollm2-135m-instruct"] == "loaded"
        assert listed["gemma3-270m"] == "available"
        text = client.completions.create(
            model="gemma3-270m", prompt="The capital of France is", max_tokens=4, temperature=0
        )
        assert text.choices[0].text.strip()
        [gemma] = [model for model in client.models.list() if model.id == "gemma3-270m"]
        extra = gemma.model_extra or {}
        assert (extra["state"], extra["source"], extra["cache"]) == ("loaded", "known", None)
        assert post(client, "/models/unload", model="gemma3-270m")["status"] == "unloaded"
        assert states(client)["gemma3-270m"] == "available"
