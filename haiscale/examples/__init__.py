"""Runnable examples: ``python -m haiscale.examples.train_gpt --help``."""
