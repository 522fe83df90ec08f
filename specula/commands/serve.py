"""`specula serve`: an OpenAI-compatible HTTP server over one loaded target (and draft)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from specula.commands.common import (add_method_args, add_model_args, add_prefix_cache_arg, add_tool_args,
                                     flags_in_errors, load_spec, method_help, served_model_name)
from specula.errors import ConfigError


def register(sub) -> None:
    p = sub.add_parser(
        "serve", help="serve the model over an OpenAI-compatible HTTP API",
        description="Serve /v1/completions, /v1/chat/completions (with stream), /v1/models, /tokenize, /detokenize, "
                    "/health and /metrics. "
                    "Up to --max-batch-size requests are decoded at once (continuous batching); every response carries a speculative_decoding object.")
    add_model_args(p)
    p.add_argument("--method", default=None, help=method_help(default=True))
    add_method_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    g.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 = any free port)")
    g.add_argument("--api-key", default=os.environ.get("SPECULA_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize "
                        "(default: $SPECULA_API_KEY, else no key)")
    g.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (default 1 MiB)")
    g.add_argument("--chat-max-tokens", type=int, default=512,
                   help="max_tokens of chat requests that give none (default 512, capped by the context)")
    g.add_argument("--max-batch-size", type=int, default=8,
                   help="requests decoded at once, continuous batching (default 8; 1 = one at a time)")
    add_prefix_cache_arg(g)
    g.add_argument("--chunked-prefill-size", type=int, default=None, metavar="TOKENS",
                   help="prompt tokens prefilled between two decode steps while other requests decode, so a long "
                        "prompt does not stop the running streams for its whole prefill (SGLang's option; default "
                        "128 on specula's CPU kernels, where outputs stay bit for bit the same; else 0; 0: whole "
                        "prompts)")
    g.add_argument("--max-queue", type=int, default=256,
                   help="requests waiting for a place in the batch; more get 503 with Retry-After (default 256)")
    g.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a generation request may take, queueing included; then 504 "
                        "(default 600; 0 = no limit)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM / Ctrl-C: seconds in-flight requests get to finish before they are cancelled "
                        "(default 30; inf: no limit, until a second signal forces the exit)")
    g.add_argument("--served-model-name", default=None,
                   help="model id clients send and /v1/models lists (default: the --target value; not empty)")
    add_tool_args(p.add_argument_group("tool calling (vLLM's options)"))
    cors = p.add_argument_group("CORS (browser pages on other origins; vLLM's options)")
    cors.add_argument("--allowed-origins", default='["*"]',
                      help='JSON list of origins allowed to call the API from a browser (default \'["*"]\': any; '
                           '\'[]\' sends no CORS headers)')
    cors.add_argument("--allowed-methods", default='["*"]',
                      help='JSON list of HTTP methods allowed cross-origin (default \'["*"]\')')
    cors.add_argument("--allowed-headers", default='["*"]',
                      help='JSON list of request headers allowed cross-origin (default \'["*"]\')')
    cors.add_argument("--allow-credentials", action="store_true",
                      help="allow cookies and HTTP authentication on cross-origin requests")
    p.set_defaults(handler=run)


def _json_list(flag: str, text: str) -> tuple[str, ...]:
    """`text` as vLLM's CORS options read it: a JSON list of strings."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{flag} takes a JSON list of strings, e.g. '[\"*\"]' or "
                          f"'[\"http://localhost:3000\"]', got {text!r}")
    return tuple(value)


def run(args: argparse.Namespace) -> int:
    from dataclasses import fields

    from specula.serve import ServerConfig, create_server

    options = [field.name for field in fields(ServerConfig)]  # its errors name them (max_queue, port=70000)
    with flags_in_errors(args, options):
        config = ServerConfig(  # validate everything before loading models
            model_name=served_model_name(args), host=args.host, port=args.port, api_key=args.api_key,
            max_body_bytes=args.max_body_bytes, chat_max_tokens=args.chat_max_tokens,
            max_batch_size=args.max_batch_size, chunked_prefill_size=args.chunked_prefill_size,
            max_queue=args.max_queue,
            request_timeout=args.request_timeout, shutdown_timeout=args.shutdown_timeout,
            allowed_origins=_json_list("--allowed-origins", args.allowed_origins),
            allowed_methods=_json_list("--allowed-methods", args.allowed_methods),
            allowed_headers=_json_list("--allowed-headers", args.allowed_headers),
            allow_credentials=args.allow_credentials, enable_auto_tool_choice=args.enable_auto_tool_choice,
            tool_call_parser=args.tool_call_parser,
        )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    spec, method = load_spec(args)
    with flags_in_errors(args, options):  # a port taken: port=, host=
        server = create_server(spec, config)
    print(f"specula serve: {config.model_name} (method {method}) listening on {server.url}"
          f"{' (API key required)' if config.api_key else ''}", file=sys.stderr, flush=True)
    server.serve_forever()  # until SIGTERM / Ctrl-C, then a graceful shutdown
    print("specula serve: stopped", file=sys.stderr, flush=True)
    return 0
