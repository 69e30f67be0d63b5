"""Local servers (fetch, start, stop), topic and CQL bootstrap."""
