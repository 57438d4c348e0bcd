"""The audit lake's storage: stores exported as Hive-partitioned Parquet with a verifiable manifest (local or
S3), the catalog that reads it like a store, and the executor interface the fan-out runs on (docs/lake.md).
Its forensics - checkpoints, partition tasks, the questions - are :mod:`kvtrail.forensics.lake`."""
