"""Compiled steps: the model's forward traced once at start by torch.compile, and the saved graphs."""
