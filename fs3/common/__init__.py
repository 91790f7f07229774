"""Shared foundations: config, errors, ids, checksums, clock, logging, metrics."""
