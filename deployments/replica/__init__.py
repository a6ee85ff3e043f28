"""The replica's pure units: admission gate, fast loop, OOM split, shedding, batch formation."""
