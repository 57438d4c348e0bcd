"""The kvtrail service: HTTP ingest, the live judge, the query API and its access control."""
