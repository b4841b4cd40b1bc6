"""The engine: compressed KV storage, the attention hook, exact chunked statistics, selection.

It runs any ``Policy`` and names no method: methods live above it, in ``d2o.methods``.
"""
