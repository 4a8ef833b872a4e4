"""The HTTP API: LoRAX, OpenAI and vLLM-compatible routes, adapter admin, health and Prometheus metrics.

`app.py`: `create_app(ServerConfig)` builds the FastAPI app; `serve(ServerConfig)` runs it under uvicorn with a
graceful SIGTERM drain. One module per API (openai.py, lorax.py, admin.py, health.py); module map: docs/structure.md.

May import: serving.bounded_labels, engine, spec, adapters, store, executor, kernels, platforms.
"""
