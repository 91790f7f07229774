"""Multi-host reliability: clusters in network namespaces, fault injection, history checks."""
