"""Audit records without a model: an allocator-shaped synthetic stream (synth) and the fleet trace simulator."""
