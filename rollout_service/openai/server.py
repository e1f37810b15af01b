"""serve_openai: the app under uvicorn on one box, in the foreground or on a thread of this process."""
from __future__ import annotations

import ipaddress
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_service.openai.app import openai_app

logger = logging.getLogger("rollout_service.openai")
START_TIMEOUT_S = 30.0


@dataclass
class OpenAIServer:
    """A server running on a thread (serve_openai(block=False)): where it listens and how to stop it."""

    url: str  # http://host:port/v1, an OpenAI client's base_url
    token: str
    token_file: Path | None
    app: Any
    _server: Any
    _thread: threading.Thread

    def stop(self, timeout_s: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout_s)

    def __enter__(self) -> "OpenAIServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _warn_if_exposed(host: str) -> None:
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        logger.warning(f"openai endpoint: listening on {host}, reachable from other machines; only the bearer "
                       "token guards it, and it travels in clear text (put TLS in front)")


def serve_openai(client: Any, host: str = "127.0.0.1", port: int = 8000, token: str | None = None,
                 token_file: Any = None, *, block: bool = True, log_level: str = "warning",
                 **app_options: Any) -> OpenAIServer | None:
    """Serve `client` as an OpenAI-compatible endpoint (openai_app's options pass through) on host:port
    (127.0.0.1 unless told otherwise; port 0 picks a free one). `block=True` runs uvicorn in this thread until
    it is stopped (Ctrl-C / SIGTERM) and returns None; `block=False` starts it on a daemon thread and returns
    an OpenAIServer (url, token, stop()) once it accepts connections."""
    import uvicorn

    _warn_if_exposed(host)
    app = openai_app(client, token=token, token_file=token_file, **app_options)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off", access_log=False)
    server = uvicorn.Server(config)
    where = f" (token in {app.state.token_file})" if app.state.token_file else ""
    if block:
        logger.warning(f"openai endpoint: http://{host}:{port}/v1{where}")
        server.run()
        return None
    thread = threading.Thread(target=server.run, name="openai-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"serve_openai: uvicorn did not start on {host}:{port} (port taken?)")
        time.sleep(0.02)
    bound = server.servers[0].sockets[0].getsockname()[1]
    return OpenAIServer(f"http://{host}:{bound}/v1", app.state.token, app.state.token_file, app, server, thread)


def tokenizer_for(model: Any) -> Any:
    """The transformers tokenizer of a model source as a service config names it (the embedded model, a
    .gguf file or a HF folder): a Ray service's workers hold theirs, the endpoint needs its own copy."""
    import os

    from transformers import AutoTokenizer

    from rollout_service.model.gguf_cache import pretrained_location
    from rollout_service.model.loader import gguf_file

    if not isinstance(model, (str, os.PathLike)):
        raise ValueError(f"the OpenAI endpoint needs the model's tokenizer: cannot load one from a "
                         f"{type(model).__name__}; pass tokenizer=")
    gguf = gguf_file(model)
    path, extra = pretrained_location(gguf) if gguf is not None else (Path(os.fspath(model)).expanduser(), {})
    return AutoTokenizer.from_pretrained(path, local_files_only=True, **extra)
