"""Forensics on the audit lake: page-state checkpoints, per-(node, hour) replay tasks, the cross-partition
stage and the questions (the lake's storage itself is :mod:`kvtrail.audit.lake`)."""
