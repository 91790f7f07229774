"""Rank programs the HaiScale tests start as processes (one module per parallelism)."""
