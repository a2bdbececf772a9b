"""`specav serve`: an OpenAI-compatible HTTP server over the engine (see docs/serving.md).

    cli.py              the command line
    app.py              routes, streaming, errors, authentication (FastAPI)
    protocol.py         the OpenAI wire format (pydantic request bodies, response objects)
    engine_loop.py      the engine's background thread and the bounded request queue
    metrics.py          Prometheus metrics from step records and request timings
    estimator_state.py  the estimator's state across restarts
"""
