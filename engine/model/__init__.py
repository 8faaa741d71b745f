"""Model architectures, weight loading (GGUF, safetensors), weight quantization and export."""
