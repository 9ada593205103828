"""Offline work: never on the routing path (the default predictor's training, …)."""
