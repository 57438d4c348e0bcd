"""kvtrail: audit, observability and forensics of KV-cache page ownership in LLM serving."""

__version__ = "0.1.0"
