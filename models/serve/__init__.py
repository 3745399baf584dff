"""An OpenAI-compatible HTTP server over :class:`models.LLM` (``dynamo-once serve``; FastAPI + uvicorn, the
``serve`` extra): :mod:`.app` the routes, :mod:`.protocol` the request and response shapes, :mod:`.bridge`
the event loop's side of the engine, :mod:`.engine_thread` the one thread that runs its steps and wakes the
loop once a step, :mod:`.cli` the command."""
