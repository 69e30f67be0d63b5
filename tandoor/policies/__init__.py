"""What every surface applies alike (the chat API, the OpenAI API, batch), shared by the
roles from below: quotas, API keys, moderation, context budgets, and the Redis keys they
and the workers use."""
