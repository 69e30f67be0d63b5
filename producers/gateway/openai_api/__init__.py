"""OpenAI-compatible API: /v1/chat/completions and /v1/models, for unchanged clients."""
