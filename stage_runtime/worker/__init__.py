"""Workers: one per rank; each owns its device and delegates to its model runner."""
