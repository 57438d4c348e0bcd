"""The one way to ask: every face (CLI, service, dashboard, report, metrics) asks its questions here,
of a store file, a running service or a lake, and only formats the answers."""
