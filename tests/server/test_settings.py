"""Settings declared once: the flags, environment variables, defaults, messages and docs table they make."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from exporter.cli import build_parser
from exporter.config.settings import Settings, flag_of, markdown_table, serve_options, settings_from
from exporter.exposition.series import LABEL_PRESETS, known_labels
from exporter.flags.option import ENV_PREFIX, SettingsError, env_name
from exporter.state.options import default_storage_path

DOCS = Path(__file__).resolve().parents[2] / "docs"
NUMBERS = [name for name, kind in typing.get_type_hints(Settings).items() if kind in (int, float)]


def serve(*flags: str) -> Settings:
    return settings_from(build_parser().parse_args(["serve", *flags]))


def test_every_setting_has_one_flag_with_its_environment_variable() -> None:
    options = serve_options()
    assert list(options) == [item.name for item in dataclasses.fields(Settings)]
    flags = [option.flag for option in options.values()]
    assert len(set(flags)) == len(flags)
    for option in options.values():
        assert option.variable == env_name(option.flag) == ENV_PREFIX + option.dest.upper()
    assert env_name("--web.listen-address") == "CACHE_CONFIG_EXPORTER_WEB_LISTEN_ADDRESS"
    parsed = vars(build_parser().parse_args(["serve"]))
    assert set(parsed) - {"command"} == {option.dest for option in options.values()}


def test_the_flags_defaults_are_the_settings_defaults() -> None:
    """Where a flag's default means something else (``--web.allowed-hosts``: loopback names on a loopback
    listener), ``Settings`` constructed directly serves any host."""
    assert serve() == dataclasses.replace(Settings(), storage_path=default_storage_path(), allowed_hosts=())
    assert Settings().allowed_hosts is None


def test_the_flags_set_the_settings_by_their_types(tmp_path: Path) -> None:
    settings = serve(
        "--web.workers", "3",
        "--web.read-timeout", "2.5",
        "--limits.bytes", "1000000",
        "--storage.path", str(tmp_path / "x.db"),
        "--cache-config.file", str(tmp_path / "base.yaml"),
        "--web.allow-unauthenticated-ingest",
        "--log.level", "debug",
    )  # fmt: skip
    assert (settings.workers, settings.read_timeout_seconds, settings.max_bytes) == (3, 2.5, 1_000_000)
    assert (settings.storage_path, settings.cache_config_file) == (tmp_path / "x.db", tmp_path / "base.yaml")
    assert (settings.allow_unauthenticated_ingest, settings.log_level) == (True, "debug")


def test_an_environment_variable_sets_the_value_and_a_flag_overrides_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHE_CONFIG_EXPORTER_LIMITS_BYTES", "4096")
    monkeypatch.setenv("CACHE_CONFIG_EXPORTER_WEB_ALLOW_UNAUTHENTICATED_INGEST", "yes")
    monkeypatch.setenv("CACHE_CONFIG_EXPORTER_WEB_METRICS_TOKEN_FILE", "")
    settings = serve()
    assert (settings.max_bytes, settings.allow_unauthenticated_ingest, settings.metrics_token_file) == (
        4096,
        True,
        None,
    )
    assert serve("--limits.bytes", "8192").max_bytes == 8192


@pytest.mark.parametrize(
    ("listen_address", "names", "served"),
    [
        ("127.0.0.1:1", "", ()),
        ("127.0.0.1:1", "Exporter.Example., other.example", ("exporter.example", "other.example")),
        ("127.0.0.1:1", "a.example,*", None),
        (":1", "", None),
    ],
)
def test_allowed_hosts_depend_on_the_listen_address(listen_address: str, names: str, served: object) -> None:
    flags = ["--web.listen-address", listen_address, "--web.allowed-hosts", names, "--web.allow-unauthenticated-ingest"]
    assert serve(*flags).allowed_hosts == served


@pytest.mark.parametrize("name", NUMBERS)
def test_a_number_that_is_not_positive_names_its_flag(name: str) -> None:
    with pytest.raises(SettingsError, match=rf"^{re.escape(flag_of(name))} must be positive, got 0"):
        serve(flag_of(name), "0")


def test_text_that_is_not_a_number_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve", "--web.workers", "many"])
    assert exited.value.code == 2
    assert "--web.workers: invalid int value: 'many'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--metric.prefix", "bad prefix"), "--metric.prefix 'bad prefix' is not a valid metric name prefix"),
        (("--web.telemetry-path", "/api/x"), "--web.telemetry-path '/api/x' must start with /"),
        (("--web.listen-address", "nowhere"), "--web.listen-address 'nowhere': expected HOST:PORT"),
        (("--web.listen-address", ":1"), "--web.listen-address :1 is reachable from other hosts, so ingest needs "
                                         "--web.ingest-token-file (or --web.allow-unauthenticated-ingest"),
        (("--web.tls-cert-file", "cert.pem"), "--web.tls-cert-file and --web.tls-key-file go together"),
        (("--web.tls-cert-file", "c", "--web.tls-key-file", "k", "--web.config.file", "w.yaml"),
         "--web.tls-cert-file/--web.tls-key-file and --web.config.file exclude each other"),
        (("--web.metrics-basic-auth-file", "users", "--web.config.file", "w.yaml"),
         "--web.metrics-basic-auth-file and --web.config.file exclude each other"),
        (("--metric.labels-denylist", "mamba_blok_size"),
         "--metric.labels-denylist: no vLLM release from 0.20.0 to 0.34.0 has a label named 'mamba_blok_size' "
         "(did you mean mamba_block_size"),
        (("--metric.labels-preset", "compact", "--metric.labels-allowlist", "block_size"),
         "--metric.labels-preset and --metric.labels-allowlist cannot be combined"),
    ],
)  # fmt: skip
def test_settings_that_cannot_work_name_their_flags(flags: tuple[str, ...], message: str) -> None:
    with pytest.raises(SettingsError) as refused:
        serve(*flags)
    assert str(refused.value).startswith(message)


def test_a_label_preset_is_an_allowlist_by_name_that_a_denylist_shortens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHE_CONFIG_EXPORTER_METRIC_LABELS_PRESET", "compact")
    chosen = serve("--metric.labels-denylist", "num_cpu_blocks").info_labels()
    assert {name for name in known_labels() if chosen.keeps(name)} == set(LABEL_PRESETS["compact"]) - {"num_cpu_blocks"}


def test_the_base_config_file_is_named_by_its_flag(tmp_path: Path) -> None:
    for path, reason in [(tmp_path / "base.ini", "use a .json"), (tmp_path / "missing.toml", "No such file")]:
        with pytest.raises(SettingsError, match=rf"^--cache-config.file {re.escape(str(path))}: {reason}"):
            serve("--cache-config.file", str(path)).base_labels()


def test_settings_travel_to_worker_processes_unchanged(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    settings = serve("--storage.path", str(tmp_path / "x.db"), "--web.allowed-hosts", "a.example", "--web.workers", "2")
    monkeypatch.setenv("CACHE_CONFIG_EXPORTER_SETTINGS_JSON", settings.to_environment())
    assert Settings.from_environment() == settings


def test_the_table_of_flags_in_the_docs_is_the_generated_one() -> None:
    """Generated, never edited by hand: run ``python -m exporter.config.settings --markdown`` and paste it between
    the settings markers of docs/operators.md."""
    generated = subprocess.run(
        [sys.executable, "-m", "exporter.config.settings", "--markdown"], capture_output=True, text=True, check=True
    ).stdout
    assert generated == markdown_table(list(serve_options().values()))
    page = (DOCS / "operators.md").read_text()
    begin, end = "<!-- settings:begin -->\n", "<!-- settings:end -->"
    assert page[page.index(begin) + len(begin) : page.index(end)] == generated
    assert all(f"| `{option.flag}` |" in generated for option in serve_options().values())


def test_the_table_of_limits_in_the_docs_states_the_declared_defaults() -> None:
    """The limits table explains what happens past each limit in prose; its defaults must still be the code's."""
    page = (DOCS / "security.md").read_text()
    section = page[page.index("## Limits and their defaults\n") :]
    rows = re.findall(r"^\| `(--[a-z.-]+)` \| `(\d+)`", section[: section.index("\n#")], re.MULTILINE)
    options = {option.flag: option for option in serve_options().values()}
    assert len(rows) >= 9
    for flag, documented in rows:
        assert float(documented) == options[flag].default, flag


FORMER = "--limits.engines-per-deployment"


def test_a_renamed_flag_is_still_read_under_its_former_name_and_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Configurations written for a flag's former name keep their meaning; the new name wins where both are set."""
    assert serve(FORMER, "7").max_engines_per_replica == 7
    assert serve(f"{FORMER}=8").max_engines_per_replica == 8
    monkeypatch.setenv(env_name(FORMER), "9")
    assert serve().max_engines_per_replica == 9
    monkeypatch.setenv(env_name(flag_of("max_engines_per_replica")), "10")
    assert serve().max_engines_per_replica == 10
    assert serve("--limits.engines-per-replica", "11").max_engines_per_replica == 11


def test_a_former_name_used_is_named_with_the_name_to_use(monkeypatch: pytest.MonkeyPatch) -> None:
    option = serve_options()["max_engines_per_replica"]
    new, variable = option.flag, option.variable
    assert option.former_names_used(["serve", "--limits.engines-per-replica", "3"]) == []
    assert option.former_names_used(["serve", FORMER, "3"]) == [(FORMER, new)]
    assert option.former_names_used(["serve", f"{FORMER}=3"]) == [(FORMER, new)]
    assert option.former_names_used(["serve", f"{FORMER}s=3"]) == []  # another flag, not a form of this one
    monkeypatch.setenv(env_name(FORMER), "3")
    assert option.former_names_used(["serve"]) == [(env_name(FORMER), variable)]
