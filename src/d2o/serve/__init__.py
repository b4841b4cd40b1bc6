"""``d2o serve``: an OpenAI-compatible server with continuous batching and admission by KV memory.

``config`` (options, checked before torch loads), ``protocol`` (the OpenAI request and response
formats), ``engine`` (the model, the queue, admission, one thread doing all model work), ``jobs`` (a
request's job, and the lanes of rows that decode together),
``app`` (the FastAPI application over an engine), ``stats`` (the Prometheus text of ``/metrics``),
``ray_serve`` (the same application as a Ray Serve deployment).
"""
