"""The serving side, in subfolders lowest first (each imports only those before it): `model/` (the
Llama-family target, its KV cache), `cpu/` (its CPU fast paths), `loaders/` (how a target is read),
`speculation/` (proposers, the DFlash drafter, the verify rule), `runtime/` (sequences, scheduler,
sampler, engine loop) and `server/` (the OpenAI-compatible HTTP API and the registry follower).

Not here: anything offline (training and evaluating drafters is in `daemon/`)."""
