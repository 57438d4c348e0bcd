"""The witness's HTTP face (``kvtrail witness serve``): c2sp.org/tlog-witness' add-checkpoint."""
