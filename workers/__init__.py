"""Inference workers: Kafka in, vLLM, token events out."""
