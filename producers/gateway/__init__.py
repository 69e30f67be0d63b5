"""The HTTP gateway: chat clients in, prompt events out, replies streamed back."""
