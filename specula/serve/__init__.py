"""OpenAI-compatible HTTP server (`specula serve`): /v1/completions, /v1/chat/completions
(streaming as server-sent events), /v1/models, /health and Prometheus /metrics, with a
`speculative_decoding` object on every response.

    from specula.serve import ServerConfig, create_server
    server = create_server(specula.load("smollm2-135m"), ServerConfig(model_name="smollm2-135m"))
    server.serve_forever()
"""

from specula.serve.app import ServerConfig, SpeculaServer, create_server
from specula.serve.protocol import APIError

__all__ = ["APIError", "ServerConfig", "SpeculaServer", "create_server"]
