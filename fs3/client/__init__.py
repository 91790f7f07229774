"""fs3 client library: routing cache and the storage client (the file-system API builds on these)."""
