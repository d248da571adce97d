"""Loaders: a Hugging Face directory or a GGUF file into a `StoredModel`, then into a served `LoadedModel`."""
