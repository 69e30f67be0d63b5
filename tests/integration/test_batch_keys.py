"""Lines sent with a key revoked before admission read them (it was down, or behind):
refused 401, and kept in `batch_outputs` under the key's owner. Without an owner they
had no row there, and an API batch, which counts its lines' rows, stayed in progress
for its whole completion window and then showed `expired`."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer

from infra.roles import AdmissionProcess, running
from producers.batch_topic import ResultsReader, send_lines
from tandoor.clients import cassandra_session
from tandoor.policies.api_keys import revoke_key
from tandoor.settings import Settings
from tests.integration.batch_lines import all_results, batch_key, question

pytestmark = pytest.mark.integration
LINES = 3


async def test_lines_of_a_key_revoked_before_they_were_read_are_kept_as_its_owners(
    settings: Settings,
    producer: AIOKafkaProducer,
    roles_env: dict[str, str],
    results: ResultsReader,
    tmp_path: Path,
) -> None:
    key, owner = await batch_key(settings, "revoked-batcher")
    batch_id = f"revoked-{uuid.uuid4().hex[:6]}"
    await revoke_key(settings, key)
    await send_lines(producer, key, batch_id, [question("smollm2", i) for i in range(LINES)])
    await send_lines(producer, "tdr_not-a-key", batch_id, [question("smollm2", LINES)])
    async with running([AdmissionProcess(tmp_path, roles_env)]):
        got = await all_results(results, batch_id, LINES + 1)
    assert {r["custom_id"]: r["response"]["status_code"] for r in got} == {
        f"line-{i}": 401 for i in range(LINES + 1)
    }
    with cassandra_session(settings, settings.keyspace) as session:
        rows = session.execute(
            "SELECT custom_id, status_code FROM batch_outputs WHERE user_id = %s AND batch_id = %s",
            (owner, batch_id),
        )
        # The key that never was anyone's writes nowhere.
        assert {row.custom_id: row.status_code for row in rows} == {
            f"line-{i}": 401 for i in range(LINES)
        }
