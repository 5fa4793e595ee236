"""The OpenAI-compatible HTTP server of looped_lm, built on `looped_lm.engine` (`looped_lm serve`).
The repository's serve/ directory installs as the package `looped_lm.serve` (setup.py).

    protocol.py    pydantic request / response types (the wire format)
    serving.py     handlers: text -> engine requests -> responses and SSE streams
    api_router.py  routes, each one line into serving.py
    app.py         the FastAPI app (errors, API key, metrics) and a loopback server for tests
    models.py      served names and NAME@K aliases      text.py     prompts, chat template, detokenizing
    errors.py      the OpenAI error envelope            metrics.py  Prometheus
    cli.py         `looped_lm serve` flags
    (vllm_plugin/, when present, is the optional vLLM backend: it does not use this server)

Only this package imports fastapi / uvicorn; importing `looped_lm.serve` itself (or its cli) does not.
"""
