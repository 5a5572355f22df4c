"""TokenLoom: multimodal tokenization (Ray Data + Iceberg) and streaming MoE training."""

__version__ = "0.1.0"
