"""Tandoor: serve a chat LLM to many users as an event pipeline on Kafka."""

from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
