"""Chatting in a conversation: post a message, stream the reply, stop, resume."""
