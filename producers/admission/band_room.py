"""How many more prompts a model's batch band may take: `batch_backlog_per_worker` per
worker (a quarter of its `max_num_seqs` unset), less what the band holds. The band is
measured every POLL_S; what was forwarded since is counted here, so a flood waits in
admission, not in Kafka."""

from __future__ import annotations

from producers.model_load import LoadMonitor, ModelLoad
from tandoor.settings import Settings


class BandRoom:
    def __init__(self, settings: Settings, load: LoadMonitor) -> None:
        self._settings = settings
        self._load = load
        self._sent: dict[str, int] = {}  # model -> forwarded since its load was measured
        self._measured: dict[str, ModelLoad] = {}

    def room(self, model: str) -> int:
        load = self._load.load(model)
        if load is None:
            return 0  # not measured yet, or Kafka cannot be asked: wait
        if self._measured.get(model) is not load:
            self._measured[model], self._sent[model] = load, 0
        workers = max(1, load.workers)  # none yet: one worker's worth waits for it
        held = load.backlog.get("batch", 0) + self._sent.get(model, 0)
        per_worker = self._settings.batch_backlog_per_worker
        per_worker = per_worker or max(1, self._settings.models[model].max_num_seqs // 4)
        return workers * per_worker - held

    def sent(self, model: str) -> None:
        self._sent[model] = self._sent.get(model, 0) + 1
