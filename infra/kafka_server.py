"""Apache Kafka in KRaft mode, one node, from jars fetched from Maven Central."""

from __future__ import annotations

import base64
import subprocess
import uuid
from pathlib import Path

from infra.errors import StartError
from infra.maven import fetch_classpath
from infra.process import java, log_contains, port_open
from infra.server import LocalServer

POM = Path(__file__).parent / "maven" / "kafka" / "pom.xml"


class KafkaServer(LocalServer):
    name = "kafka"

    @property
    def port(self) -> int:
        return self.settings.kafka_port

    def fetch(self) -> None:
        self._lib = fetch_classpath(POM, self.settings.cache_dir)

    def prepare(self) -> list[str]:
        properties = self.render(
            "kafka-server.properties",
            "server.properties",
            host=self.settings.host,
            port=self.port,
            controller_port=self.settings.kafka_controller_port,
            log_dirs=self.data_dir / "log",
        )
        self.render("kafka-log4j2.properties", "log4j2.properties")
        self._format_storage(properties)
        return [*self._java(), "kafka.Kafka", str(properties)]

    def is_ready(self) -> bool:
        return log_contains(self.process.log_file, "Kafka Server started") and port_open(
            self.settings.host, self.port
        )

    def _java(self) -> list[str]:
        heap = self.settings.kafka_heap
        return [
            java(),
            f"-Xms{heap}",
            f"-Xmx{heap}",
            "-XX:+UseG1GC",
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={self.conf_dir / 'log4j2.properties'}",
            f"-Dkafka.logs.dir={self.settings.home / 'logs'}",
            "-cp",
            f"{self._lib}/*",
        ]

    def _format_storage(self, properties: Path) -> None:
        """KRaft needs formatted storage once; a formatted folder is left alone."""
        if (self.data_dir / "log" / "meta.properties").exists():
            return
        cluster_id = new_cluster_id()
        argv = [
            *self._java(),
            "kafka.tools.StorageTool",
            "format",
            "-t",
            cluster_id,
            "-c",
            str(properties),
            "-g",
        ]
        result = subprocess.run(argv, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise StartError(f"kafka: formatting storage failed:\n{result.stdout}{result.stderr}")


def new_cluster_id() -> str:
    """A random KRaft cluster id: 16 bytes, URL-safe base64, never starting with "-"
    (StorageTool would read it as an option; Kafka's own Uuid.randomUuid skips those too)."""
    while True:
        candidate = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not candidate.startswith("-"):
            return candidate
