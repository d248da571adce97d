"""The serving side: `model/` and `loaders/` (the Llama-family target and how it is read), `cpu/` (its
CPU fast paths), `runtime/` (sequences, KV cache, scheduler, sampler, engine loop), `speculation/`
(proposers, the DFlash drafter, the verify rule) and `server/` (the OpenAI-compatible HTTP API).

Not here: anything offline (training and evaluating drafters is in `daemon/`)."""
