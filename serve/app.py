"""The FastAPI app: handlers, routes, error envelope, API key, metrics; and a loopback server in a
thread for tests and benchmarks.

    app = build_app(engine, tokenizer, "my-model", api_key=None)   # the engine starts with the app
"""

from __future__ import annotations

import contextlib
import hmac
import socket
import threading
import time

from fastapi import FastAPI

from looped_lm import __version__
from looped_lm.data.tokenizer import Tokenizer
from looped_lm.engine.engine import Engine
from looped_lm.errors import UserError
from looped_lm.serve import text
from looped_lm.serve.api_router import router
from looped_lm.serve.errors import APIError, install_error_handlers
from looped_lm.serve.metrics import HTTPMetricsMiddleware, ServerMetrics
from looped_lm.serve.models import ServedModels
from looped_lm.serve.serving import OpenAIServing

OPEN_PATHS = frozenset({"/health", "/metrics", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})

DESCRIPTION = """OpenAI-compatible API for looped_lm models (DiffusionBlocks, looped, Huginn, GPT).

K (denoising iterations per token) is chosen per request: `num_iterations` in the body (the openai client
sends it through `extra_body`), or a model alias `NAME@K` from `/v1/models`, else the server default;
responses report it in `num_iterations`, and in `warning` when it is not the model's usual chain (K < B
skips blocks; on a DiffusionBlocks model, K above B and the default may be worse). `bridge`, `exit_threshold` and `exit_criterion` choose the
chain's bridge and adaptive exit, as `looped_lm generate`'s flags do. With `--api-key`, every route but
/health, /metrics and the docs needs `Authorization: Bearer KEY`."""


class APIKeyMiddleware:
    """401 unless exactly one `Authorization: Bearer <key>` header (constant-time compare), before the body
    is read. Two Authorization headers are ambiguous (proxies and frameworks disagree on which one wins):
    refused, whatever they hold."""

    def __init__(self, app, api_key: str):
        self.app, self.key = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = [value for name, value in scope["headers"] if name == b"authorization"]
            if len(given) > 1:
                denied = APIError(401, f"{len(given)} Authorization headers: send exactly one",
                                  code="invalid_api_key").response()
                await denied(scope, receive, send)
                return
            if not hmac.compare_digest(given[0] if given else b"", self.key):
                denied = APIError(401, "Incorrect API key provided", code="invalid_api_key").response()
                await denied(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: Engine, tokenizer: Tokenizer, model_name: str, api_key: str | None = None,
              max_request_work: int | None = None, chat_template: str | None = None) -> FastAPI:
    """api_key None: no authentication; any other value turns it on (an empty or blank key is refused,
    never read as "off"). max_request_work: the denoising calls one request may cost (None: unbounded).
    chat_template: a Jinja template that replaces the model's (None: the model's, else the plain one)."""
    if api_key is not None and not api_key.strip():
        raise UserError("the API key is empty: give a key, or None to serve without authentication")
    template = text.chat_template(tokenizer, chat_template)  # compiled now: a broken template fails at start
    models = ServedModels(model_name, engine)
    metrics = ServerMetrics(engine)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="looped_lm", version=__version__, description=DESCRIPTION, lifespan=lifespan)
    app.state.serving = OpenAIServing(engine, tokenizer, models, metrics, max_request_work, template)
    install_error_handlers(app)
    app.include_router(router)
    if api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(HTTPMetricsMiddleware, metrics=metrics, paths={r.path for r in router.routes} | OPEN_PATHS)
    _document(app, bearer=api_key is not None, limits=_limits(engine, tokenizer))
    return app


def _limits(engine: Engine, tokenizer: Tokenizer) -> dict[str, dict | None]:
    """This server's bounds on request integers, by field (None: the field does not apply to this model,
    and the document leaves it out; {}: it applies, unbounded)."""
    k = {"minimum": 1, "maximum": engine.max_iterations} if engine.max_iterations else None
    tokens = {"maximum": engine.max_len}
    chain = {} if engine.limits is not None and engine.limits.default_bridge is not None else None
    exit_rule = {} if engine.limits is not None and engine.limits.adaptive_exit else None
    return {"num_iterations": k, "bridge": chain, "exit_threshold": exit_rule, "exit_criterion": exit_rule,
            "max_tokens": tokens, "max_completion_tokens": tokens,
            "prompt": {"maximum": tokenizer.vocab_size - 1}, "tokens": {"maximum": tokenizer.vocab_size - 1}}


def _bound_integers(node, bounds: dict) -> None:
    """Set `bounds` on every integer schema under `node` (anyOf branches and array items included)."""
    if isinstance(node, dict):
        if node.get("type") == "integer":
            node.update(bounds)
        for value in node.values():
            _bound_integers(value, bounds)
    elif isinstance(node, list):
        for value in node:
            _bound_integers(value, bounds)


def _document(app: FastAPI, bearer: bool, limits: dict[str, dict | None]) -> None:
    """The OpenAPI document as the server behaves: invalid input is a 400 envelope (FastAPI would list
    a 422); request integers carry this server's bounds (K, context, vocabulary; `limits`); and with a key
    the bearer scheme is declared on exactly the routes APIKeyMiddleware guards."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = generate()
            for name, model in schema.get("components", {}).get("schemas", {}).items():
                props = model.get("properties", {}) if name.endswith("Request") else {}
                for field, bounds in limits.items():
                    if field in props and bounds is None:
                        del props[field]
                    elif field in props:
                        _bound_integers(props[field], bounds)
            for path, operations in schema["paths"].items():
                for op in operations.values():
                    op.get("responses", {}).pop("422", None)
                    if bearer and path not in OPEN_PATHS:
                        op["security"] = [{"bearer": []}]
                        op.setdefault("responses", {}).setdefault(
                            "401", {"description": "missing or wrong API key",
                                    "content": {"application/json": {"schema": {
                                        "$ref": "#/components/schemas/ErrorResponse"}}}})
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            if bearer:
                schema.setdefault("components", {})["securitySchemes"] = {"bearer": {"type": "http",
                                                                                     "scheme": "bearer"}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


class BackgroundServer:
    """uvicorn on 127.0.0.1 (a free port unless given) in a thread: for tests and benchmarks.

        with BackgroundServer(app) as server:
            OpenAI(base_url=server.url + "/v1", api_key="x")
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn  # optional: the serve extra

        self.host, self.port = host, port
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_keep_alive=30))
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> "BackgroundServer":
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True,
                                       name="looped_lm-server")
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout=30)
