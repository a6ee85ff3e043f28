"""The simulator: the broker's own control on a virtual clock against emulated models."""
