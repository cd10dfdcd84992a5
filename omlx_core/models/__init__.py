"""Model sources: GGUF conversion and the embedded default model."""
