"""kvd: a KV-cache transfer daemon for disaggregated LLM inference."""

__version__ = "0.1.0"
