"""Storage service: chunks on targets, replicated with CRAQ chain replication."""
