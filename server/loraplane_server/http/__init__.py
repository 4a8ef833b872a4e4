"""The HTTP API: LoRAX, OpenAI and vLLM-compatible routes, adapter admin, health and Prometheus metrics.

`create_app(ServerConfig)` builds the FastAPI app; `serve(ServerConfig)` runs it under uvicorn with a
graceful SIGTERM drain. Module map: docs/structure.md.
"""
