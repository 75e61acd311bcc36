"""Leaf math that `models/` and `parallel/` both use; imports neither."""
