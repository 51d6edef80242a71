"""docker/compose.yaml is a valid Compose file without a password in it (no Docker engine runs here).

It is interpolated the way Compose does (``${VAR}``, ``${VAR:-default}``, ``${VAR:?error}``, ``$$``)
from docker/.env.example with the required secrets filled in, then validated against the
compose-spec JSON schema (tests/deploy/compose-spec.json, from the compose-spec repository).
Where Debian's ``docker-compose`` is installed, its own ``config`` check runs as well.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.deploy.support import PROMETHEUS_DIR, ROOT

DOCKER_DIR = ROOT / "docker"
COMPOSE_FILE = DOCKER_DIR / "compose.yaml"
ENV_EXAMPLE = DOCKER_DIR / ".env.example"
# The schema says draft-07 (as "https://json-schema.org/draft-07/schema", a spelling jsonschema does
# not look up by itself).
VALIDATOR = jsonschema.Draft7Validator(json.loads((Path(__file__).parent / "compose-spec.json").read_text()))
SECRETS = (
    "POSTGRES_PASSWORD",
    "REDIS_PASSWORD",
    "GRAFANA_ADMIN_PASSWORD",
    "GORGO_METRICS_TOKEN",
    "SECRET_KEY",
)

_VARIABLE = re.compile(r"\$\$|\$\{(\w+)(?:(:?[-?])([^}]*))?\}|\$(\w+)")


class MissingVariable(Exception):
    pass


def read_env(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, value = line.partition("=")
            env[name.strip()] = value
    return env


def interpolate(value, env: dict[str, str]):
    """Compose's variable substitution over a loaded YAML document."""
    if isinstance(value, dict):
        return {key: interpolate(item, env) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, env) for item in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1) or match.group(4)
        operator, argument = match.group(2), match.group(3)
        current = env.get(name)
        unset = current is None or (current == "" and operator and operator.startswith(":"))
        if operator and operator.endswith("?") and unset:
            raise MissingVariable(f"{name}: {argument}")
        if operator and operator.endswith("-") and unset:
            return argument
        return current or ""

    return _VARIABLE.sub(substitute, value)


def filled_env() -> dict[str, str]:
    env = read_env(ENV_EXAMPLE)
    env.update({name: f"test-{name.lower()}" for name in SECRETS})
    return env


def compose_document() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def test_it_is_valid_against_the_compose_spec_schema() -> None:
    document = interpolate(compose_document(), filled_env())

    VALIDATOR.validate(document)
    assert {"postgres", "redis", "web", "worker", "beat", "gateway-us-east", "prometheus", "grafana"} <= set(
        document["services"]
    )


def test_it_catches_an_invalid_file() -> None:
    document = interpolate(compose_document(), filled_env())
    document["services"]["web"]["ports"] = {"8000": 8000}

    with pytest.raises(jsonschema.ValidationError):
        VALIDATOR.validate(document)


@pytest.mark.parametrize("secret", SECRETS)
def test_it_refuses_to_start_without_each_secret(secret: str) -> None:
    env = filled_env()
    env[secret] = ""

    with pytest.raises(MissingVariable, match=secret):
        interpolate(compose_document(), env)


def test_it_writes_no_password_and_protects_redis() -> None:
    text = COMPOSE_FILE.read_text()
    document = interpolate(compose_document(), filled_env())
    services = document["services"]

    for secret in SECRETS:
        # Each secret appears only as a required variable, never as a value.
        assert re.findall(rf"{secret}\b[^\n]*", text), secret
        for line in re.findall(rf"^.*{secret}:.*$", text, re.MULTILINE):
            assert f"${{{secret}:?" in line, line
    for service in services.values():
        environment = service.get("environment", {})
        for key, value in environment.items():
            if re.search(r"(?i)password|token|secret", key) and not key.endswith("_USER"):
                assert value.startswith("test-"), f"{key} is not from docker/.env"
    assert "--requirepass" in " ".join(services["redis"]["command"])
    for name in ("web", "worker", "beat", "gateway-us-east"):
        assert services[name]["environment"]["REDIS_URL"] == "redis://:test-redis_password@redis:6379/0"


def test_it_lists_every_variable_it_reads_in_the_env_example() -> None:
    listed = read_env(ENV_EXAMPLE)
    used = {
        match[0] or match[3]
        for match in _VARIABLE.findall(COMPOSE_FILE.read_text())
        if match != ("", "", "", "")
    }
    used.discard("")

    assert used - set(listed) == set(), "add them to docker/.env.example"


def test_it_keeps_env_example_comments_on_their_own_lines() -> None:
    # docker-compose 1.x reads "KEY=   # comment" as the value "# comment": a password of that text.
    inline = [line for line in ENV_EXAMPLE.read_text().splitlines() if re.match(r"^\w+=.*\s#", line)]

    assert inline == []


def test_it_mounts_the_prometheus_and_grafana_files_that_exist() -> None:
    services = interpolate(compose_document(), filled_env())["services"]
    mounts = {
        volume.split(":")[1]: (DOCKER_DIR / volume.split(":")[0]).resolve()
        for name in ("prometheus", "grafana")
        for volume in services[name]["volumes"]
        if volume.startswith("..")
    }

    assert mounts["/etc/prometheus"] == PROMETHEUS_DIR
    assert (mounts["/etc/prometheus"] / "prometheus.yml").is_file()
    assert (mounts["/etc/grafana/provisioning"] / "datasources" / "prometheus.yml").is_file()
    provider = yaml.safe_load((mounts["/etc/grafana/provisioning"] / "dashboards" / "gorgo.yml").read_text())
    dashboards_path = provider["providers"][0]["options"]["path"]
    assert sorted(mounts[dashboards_path].glob("*.json")), dashboards_path
    datasource = yaml.safe_load(
        (mounts["/etc/grafana/provisioning"] / "datasources" / "prometheus.yml").read_text()
    )
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"


def test_it_scrapes_the_services_compose_starts() -> None:
    services = compose_document()["services"]
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    targets = {
        target
        for job in config["scrape_configs"]
        for static in job.get("static_configs", [])
        for target in static["targets"]
    }

    for target in targets:
        host, port = target.split(":")
        assert host in services, target
        assert any(port in str(mapping) for mapping in services[host].get("ports", [])) or host == "web"
    assert "web" in interpolate(services["web"]["environment"], filled_env())["ALLOWED_HOSTS"].split(",")


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="Debian's docker-compose is not installed")
def test_it_passes_docker_compose_config(tmp_path: Path) -> None:
    shutil.copytree(DOCKER_DIR, tmp_path / "docker")
    env_lines = [f"{name}={value}" for name, value in filled_env().items()]
    (tmp_path / "docker" / ".env").write_text("\n".join(env_lines) + "\n")

    result = subprocess.run(
        ["docker-compose", "-f", "compose.yaml", "config", "-q"],
        cwd=tmp_path / "docker",
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert result.returncode == 0, result.stderr
