"""kvtrail.dashboards: see docs/architecture.md."""
