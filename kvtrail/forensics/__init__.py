"""kvtrail.forensics: see docs/architecture.md."""
