"""mgmtd, the cluster manager: node registry, heartbeats, chain tables and routing information."""
