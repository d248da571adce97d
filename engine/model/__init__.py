"""The model: the Llama-family decoder, its config, attention, RoPE, KV cache, tokenizer and base-model
fingerprint.

Not here: reading files (`engine/loaders/`) or making the model fast on a CPU (`engine/cpu/`).
"""
