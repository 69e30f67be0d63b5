"""Apache Cassandra 5.0, one node, from jars fetched from Maven Central."""

from __future__ import annotations

from pathlib import Path

from infra.maven import fetch_classpath
from infra.process import java, log_contains, port_open
from infra.server import TEMPLATES, LocalServer

POM = Path(__file__).parent / "maven" / "cassandra" / "pom.xml"
MAIN_CLASS = "org.apache.cassandra.service.CassandraDaemon"


class CassandraServer(LocalServer):
    name = "cassandra"

    @property
    def port(self) -> int:
        return self.settings.cassandra_port

    def fetch(self) -> None:
        self._lib = fetch_classpath(POM, self.settings.cache_dir)

    def prepare(self) -> list[str]:
        config = self.render(
            "cassandra.yaml.tmpl",
            "cassandra.yaml",
            data_dir=self.data_dir,
            host=self.settings.host,
            native_port=self.port,
            storage_port=self.settings.cassandra_storage_port,
            cluster_name="tandoor",
        )
        logs, triggers = self.data_dir / "logs", self.data_dir / "triggers"
        logs.mkdir(exist_ok=True)
        triggers.mkdir(exist_ok=True)
        return [
            java(),
            f"-javaagent:{self._jamm_jar()}",
            f"-Xmx{self.settings.cassandra_heap}",
            *_jvm_options(),
            f"-Dcassandra.config=file://{config}",
            f"-Dcassandra.storagedir={self.data_dir}",
            f"-Dcassandra.logdir={logs}",
            f"-Dcassandra.triggers_dir={triggers}",
            f"-Dlogback.configurationFile={TEMPLATES / 'cassandra-logback.xml'}",
            "-cp",
            f"{self._lib}/*",
            MAIN_CLASS,
        ]

    def is_ready(self) -> bool:
        return log_contains(
            self.process.log_file, "Starting listening for CQL clients"
        ) and port_open(self.settings.host, self.port)

    def _jamm_jar(self) -> Path:
        return next(self._lib.glob("jamm-*.jar"))


def _jvm_options() -> list[str]:
    lines = (TEMPLATES / "cassandra-jvm.options").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
