"""The front doors: the OpenAI-compatible HTTP server (``app``), the ZMQ door and its client,
and the serving core they share (``service``). ``radixserve serve`` runs them (``frontend``)."""
