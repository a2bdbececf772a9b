"""`specav serve [MODEL]`: the OpenAI-compatible server on the command line, flags in vLLM's names.

    specav serve                                   # the packaged default pair on 127.0.0.1:8000
    specav serve /path/to/target.gguf --speculative-config '{"model": "/path/to/drafter.gguf"}'
    specav serve --port 9000 --api-key secret --estimator-state ~/.cache/specav/estimator.pt

Everything that can be checked before loading models is checked first (the speculative JSON,
the server flags, the estimator state's file): a bad value exits 2 with one line naming it,
as the other commands do. The model and engine flags are the same as `specav generate`'s.

Must not know: how requests are answered (app.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from typing import Callable

from specav.config import ConfigError, ServerConfig


def _default(name: str):
    return next(f for f in dataclasses.fields(ServerConfig) if f.name == name).default


def add_serve_parser(sub, add_engine_flags: Callable[[argparse.ArgumentParser], None]) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching, streaming, metrics)")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="target, as --model: a local HF directory, a .gguf file, or 'default' (the packaged pair)")
    add_engine_flags(p)
    p.add_argument("--max-num-seqs", dest="max_batch_size", type=int, default=argparse.SUPPRESS,
                   help="requests batched in one step (vLLM's name for --max-batch-size)")
    p.add_argument("--host", default=_default("host"), help="address to bind (default %(default)s)")
    p.add_argument("--port", type=int, default=_default("port"), help="port to bind (default %(default)s)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients pass as 'model' (default: the model argument)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health")
    p.add_argument("--max-queued-requests", type=int, default=_default("max_queued_requests"),
                   help="requests that may wait for a place in the batch before new ones get 429 "
                        "(default %(default)s)")
    p.add_argument("--estimator-state", default=None, metavar="PATH",
                   help="restore the online estimator from PATH on start (if it exists), save it there on "
                        "shutdown (SIGTERM, SIGINT)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def cmd_serve(args: argparse.Namespace) -> int:
    from specav.cli import engine_config

    if args.model_tag is not None:
        if args.model not in ("default", args.model_tag):
            raise ConfigError(f"the model is given twice ({args.model_tag!r} and --model {args.model!r}); give one")
        args.model = args.model_tag
    config = engine_config(args)
    server = ServerConfig(host=args.host, port=args.port, served_model_name=tuple(args.served_model_name or ()),
                          api_key=args.api_key, max_queued_requests=args.max_queued_requests,
                          estimator_state=args.estimator_state)
    if server.estimator_state and config.speculative is None:
        raise ConfigError("--estimator-state needs speculative decoding (there is no estimator with "
                          "--no-speculation); drop one of them")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    engine, identity = _load(config, server)
    return run(engine, server, args.model, identity, args.log_level)


def _load(config, server: ServerConfig):
    """The engine, with the estimator's saved state restored (refused if it belongs elsewhere)."""
    from specav.engine.engine import Engine
    from specav.server import estimator_state

    identity = None
    if config.speculative is not None:
        identity = estimator_state.identity(config.target.path, config.speculative.model,
                                            config.speculative.num_speculative_tokens)
        if server.estimator_state:
            _check_state_early(server.estimator_state, identity)
    engine = Engine.from_config(config)
    if server.estimator_state and engine.scorer is not None:
        if estimator_state.load(server.estimator_state, engine.scorer, identity):
            logging.getLogger("specav.server").info("specav: restored the estimator's state from %s",
                                                    server.estimator_state)
    return engine, identity


def _check_state_early(path: str, identity: dict) -> None:
    """Refuse a state file of another pair or K before spending a minute loading models."""
    from specav.server import estimator_state

    class _Probe:
        def load_state_dict(self, state) -> None:
            pass

    estimator_state.load(path, _Probe(), identity)


def run(engine, server: ServerConfig, model: str, identity: dict | None, log_level: str = "info") -> int:
    """Serve until SIGTERM or SIGINT (uvicorn's graceful shutdown; the app saves the estimator's state)."""
    import uvicorn

    from specav.server.app import build_app

    app = build_app(engine, server, model, identity)
    uvicorn_config = uvicorn.Config(app, host=server.host, port=server.port, log_level=log_level,
                                    timeout_graceful_shutdown=5)
    try:
        uvicorn.Server(uvicorn_config).run()
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled, once the app has shut down
        pass
    return 0


def main(argv: list[str] | None = None) -> int:
    from specav.cli import main as specav_main

    return specav_main(["serve", *(sys.argv[1:] if argv is None else argv)])
