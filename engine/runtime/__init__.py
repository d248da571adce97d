"""The runtime: sequences, KV cache, scheduler, sampler, model runner and the engine loop on its torch thread."""
