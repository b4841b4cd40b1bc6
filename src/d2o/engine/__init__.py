"""The engine: compressed KV storage, the attention hook, exact statistics; methods live in ``d2o.methods``."""
