"""kvtrail.alerts: see docs/architecture.md."""
