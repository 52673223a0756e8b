"""The host face: what an embedding program talks to. ``Runtime`` (api.py) starts the actors and
hands out one ``GenerationStream`` per request (streams.py); ``RuntimeConfig`` (config.py) says how
it runs; validation.py checks a request before any actor sees it. Hosts import these names from
``runtime`` itself (docs/api.md, "Imports"); this package re-exports nothing, so importing one of
its modules does not load the others. Its place among the layers: docs/design.md, "Layers"."""
