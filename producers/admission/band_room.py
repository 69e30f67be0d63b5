"""How many more prompts a model's batch band may take: `batch_backlog_per_worker` per
worker (a quarter of its `max_num_seqs` unset), less what the band holds. The band is
measured every POLL_S; what was forwarded since is counted here, so a flood waits in
admission, not in Kafka. Each admission replica takes the part of that room its share
of `batch.requests` partitions gives it: each took it all, and two replicas (as
deployed) filled the band twice over."""

from __future__ import annotations

import math

from producers.model_load import LoadMonitor, ModelLoad
from tandoor.settings import Settings


class BandRoom:
    def __init__(self, settings: Settings, load: LoadMonitor) -> None:
        self._settings = settings
        self._load = load
        self._sent: dict[str, int] = {}  # model -> forwarded since its load was measured
        self._measured: dict[str, ModelLoad] = {}
        self.share = 1.0  # of batch.requests' partitions this replica reads

    def room(self, model: str) -> int:
        load = self._load.load(model)
        if load is None:
            return 0  # not measured yet, or Kafka cannot be asked: wait
        if self._measured.get(model) is not load:
            self._measured[model], self._sent[model] = load, 0
        workers = max(1, load.workers)  # none yet: one worker's worth waits for it
        per_worker = self._settings.batch_backlog_per_worker
        per_worker = per_worker or max(1, self._settings.models[model].max_num_seqs // 4)
        free = workers * per_worker - load.backlog.get("batch", 0)
        # Rounded up: a replica with few partitions is never held back for good (the
        # band holds at most one line more per replica).
        return math.ceil(max(free, 0) * self.share) - self._sent.get(model, 0)

    def sent(self, model: str) -> None:
        self._sent[model] = self._sent.get(model, 0) + 1
