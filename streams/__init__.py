"""faust-streaming apps over the token and usage streams."""
