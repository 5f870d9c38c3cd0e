"""``kdtree serve``: an OpenAI-compatible HTTP server over the engine (docs/serve.md is the reference).

A thin async front (FastAPI on uvicorn, :mod:`.app`) over one worker thread that owns the model
(:mod:`.worker`); requests are checked in :mod:`.protocol`, streamed text comes from :mod:`.detok` through
:mod:`.stops`, and :mod:`.metrics` exports Prometheus metrics. :mod:`.server` binds the socket and runs it.
"""
