"""The HTTP server: OpenAI protocol, API routes, per-request serving, metrics, settings, the trace
hook and `specloop serve`."""
