"""SSE fan-out to chat clients; persistence of finished messages into Cassandra."""
