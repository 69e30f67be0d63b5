"""Conversations: the sidebar, opening a chat, renaming and deleting."""
