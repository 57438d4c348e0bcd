"""What the judge writes back into a store beside the events: persisted findings and runs, per-minute
aggregates, a window's counts from them."""
