"""Event and API models, topic names and serialization shared by every role."""
