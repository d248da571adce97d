"""The HTTP server and what `specloop serve` wires around the engine: OpenAI protocol, API routes,
per-request serving, metrics, settings, the trace hook, and the follower that keeps the served drafter
the registry's `champion` (`drafter_follower.py`)."""
