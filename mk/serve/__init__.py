"""``mk serve``: an OpenAI-compatible HTTP server (:mod:`.app`) over continuous batching
(:class:`mk.engine.scheduler.Scheduler`). Needs the ``serve`` extra (FastAPI, uvicorn)."""
