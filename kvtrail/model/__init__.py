"""A model of PD page ownership: variants, transitions, properties, the checker and the monitors (docs/model.md)."""
