"""The serving engine: Llama-family models, KV cache, continuous batching, speculation, HTTP API."""
