"""The runtime: sequences, scheduler, sampler, model runner and the engine loop on its torch thread
(the KV cache they fill is the model's, `engine/model/kv_cache.py`)."""
