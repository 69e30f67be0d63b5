"""OpenAI's Files and Batches API, on `batch.requests` and the admission role."""
