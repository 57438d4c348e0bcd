"""kvtrail.serving: see docs/architecture.md."""
