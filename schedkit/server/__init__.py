"""The OpenAI-compatible HTTP server (``schedkit serve``) and its Prometheus metrics.

Needs the server extras (``pip install 'schedkit[serve]'``: FastAPI, uvicorn, uvloop,
prometheus_client); ``import schedkit`` does not import this package.
"""
