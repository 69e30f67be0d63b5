"""Process-wide logging set-up: one line per event, the logger name says which role."""

import logging


def configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)-5s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("aiokafka", "cassandra"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
