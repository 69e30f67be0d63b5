"""The admission role: batch lines from `batch.requests` into the batch band, checked,
charged and interleaved fairly between tenants."""
