"""Triptych: multimodal LLM serving with Encode-Prefill-Decode disaggregation."""

__version__ = "0.1.0"
